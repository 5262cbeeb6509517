"""The Omni frontend's request limits (``limits.*``) and its preprocessing errors, without any stage: each hostile
request is a 400 naming the limit, found from sizes and headers before anything is decoded or tokenized."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni_serve.api import protocol as P
from omni_serve.api.errors import OpenAIError


@pytest.fixture(scope="module")
def frontend(omni_tiny_dir):
    from omni_serve.families.qwen2_5_omni.frontend import Qwen25OmniFrontend as OmniFrontend
    from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec

    spec = OmniGraphSpec.model_validate({"checkpoint": omni_tiny_dir, "limits": {
        "max_prompt_chars": 1000, "max_media_parts": 3, "max_total_image_pixels": 100 * 100}})
    return OmniFrontend(spec, stages=None)  # prepare() calls no stage


def prepare(frontend, content) -> OpenAIError | object:
    req = P.ChatCompletionRequest.model_validate(
        {"model": "qwen2.5-omni", "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    try:
        return asyncio.run(frontend.prepare(req))
    except OpenAIError as err:
        return err


def image(width: int, height: int, fmt: str = "PNG") -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(buf, format=fmt)
    return {"type": "image_url", "image_url": {"url": f"data:image/{fmt.lower()};base64,"
                                                      + base64.b64encode(buf.getvalue()).decode()}}


def audio(rate: int, channels: int) -> dict:
    buf = io.BytesIO()
    sf.write(buf, np.zeros((rate // 10, channels), dtype=np.float32), rate, format="WAV", subtype="PCM_16")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}


def expect_400(result, param: str, words: str) -> None:
    assert isinstance(result, OpenAIError), result
    assert result.status_code == 400 and result.param == param and words in result.message, result.message


def test_within_the_limits_a_request_is_prepared(frontend):
    prepared = prepare(frontend, [image(60, 40), audio(16000, 1), {"type": "text", "text": "x" * 500}])
    assert not isinstance(prepared, OpenAIError) and prepared.media is not None


def test_text_beyond_max_prompt_chars_is_refused_before_tokenizing(frontend, monkeypatch):
    monkeypatch.setattr(frontend.inputs, "processor", None)  # tokenizing would now fail: it must not happen
    expect_400(prepare(frontend, "y" * 1001), "messages", "1001 characters")
    expect_400(prepare(frontend, [{"type": "text", "text": "y" * 600}] * 2), "messages", "1200 characters")


def test_media_parts_beyond_the_limit_are_refused_before_decoding(frontend):
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}  # never decoded
    expect_400(prepare(frontend, [bad] * 4), "messages", "4 media parts")


def test_the_images_pixels_are_counted_together_from_their_headers(frontend):
    expect_400(prepare(frontend, [image(80, 80), image(80, 80)]), "messages[0].content[1].image_url.url",
               "pixels in all")


def test_audio_headers_are_checked_before_decoding(frontend):
    expect_400(prepare(frontend, [audio(96000, 1)]), "messages[0].content[0].input_audio.data", "96000 Hz")
    expect_400(prepare(frontend, [audio(16000, 4)]), "messages[0].content[0].input_audio.data", "4 channels")


def test_formats_the_api_does_not_document_are_refused(frontend):
    expect_400(prepare(frontend, [image(8, 8, "BMP")]), "messages[0].content[0].image_url.url", "accepted format")


def test_a_processor_failure_is_a_fixed_400_and_its_text_stays_in_the_log(frontend, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ValueError("internal detail /opt/secret")

    monkeypatch.setattr(frontend, "inputs", type("Broken", (), {"__call__": broken, "sampling_rate": 16000})())
    with caplog.at_level("WARNING"):
        err = prepare(frontend, [image(30, 30)])
    expect_400(err, "messages", "Could not process the request's media (request chatcmpl-")
    assert "secret" not in err.message and "internal detail /opt/secret" in caplog.text


def test_prompt_and_max_tokens_beyond_the_kv_cache_are_a_400_not_an_engine_failure(omni_tiny_dir):
    """The tiny thinker's context is 4096 tokens; a KV cache of 64 blocks x 16 holds 1024 per request."""
    from omni_serve.families.qwen2_5_omni.frontend import Qwen25OmniFrontend as OmniFrontend
    from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec

    spec = OmniGraphSpec.model_validate({"checkpoint": omni_tiny_dir,
                                         "stages": {"thinker": {"engine": {"ar": {"num_kv_blocks": 64}}}}})
    small = OmniFrontend(spec, stages=None)
    assert small.kv_capacity == 1024 < small.max_model_len

    def ask(max_tokens: int):
        req = P.ChatCompletionRequest.model_validate(
            {"model": "qwen2.5-omni", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
        try:
            return asyncio.run(small.prepare(req))
        except OpenAIError as err:
            return err

    err = ask(1500)
    assert isinstance(err, OpenAIError) and err.status_code == 400 and err.code == "context_length_exceeded"
    assert "KV cache holds 1024 tokens" in err.message
    assert not isinstance(ask(100), OpenAIError)
