"""The served Qwen3-ASR graph over real HTTP (Ray Serve, the default ``auto`` connector: shared memory on this one
node), with the official ``openai`` client: transcripts equal transformers' greedy ``generate`` window by window
with every upload in flight at once (long audio included; negative control), streamed and not; translation is not
served; bad input is a 400 in OpenAI's shape; a client that leaves mid-stream leaves every stage idle and no
payload behind."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.asr_cases import CLIPS, Reference, speechy, wav
from tests.integration.http_waits import busy_stages, held_payloads, ray_directory_size, shm_leftovers, wait_until

pytestmark = pytest.mark.integration
MODEL = "qwen3-asr"


@pytest.fixture(scope="module")
def client(asr_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{asr_app}/v1", api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def reference(qwen3_asr_tiny_dir):
    return Reference(qwen3_asr_tiny_dir)


def transcribe(client, samples, **kw):
    return client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav(samples), "audio/wav"), **kw)


def test_uploads_in_flight_equal_generate_window_by_window(client, reference):
    languages = [None, "en", None, "English"]
    with ThreadPoolExecutor(len(CLIPS)) as pool:
        replies = list(pool.map(lambda i: transcribe(client, CLIPS[i], response_format="verbose_json",
                                                     language=languages[i]), range(len(CLIPS))))
    for i, (clip, reply) in enumerate(zip(CLIPS, replies)):
        want = reference.tokens(clip, language=languages[i])
        assert [s.tokens for s in reply.segments] == want, f"clip {i}"
    assert len(replies[-1].segments) == 3  # 7.5 s in windows of at most 3 s
    assert [s.tokens for s in replies[0].segments] != reference.tokens(CLIPS[1])  # negative control


def test_official_client_streamed_and_not(client):
    plain = transcribe(client, CLIPS[3], language="en")
    text = transcribe(client, CLIPS[3], language="en", response_format="text")
    events = list(transcribe(client, CLIPS[3], language="en", stream=True))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1) and len(events) > 2
    assert events[-1].type == "transcript.text.done" and events[-1].text == plain.text == text.strip()
    assert "".join(e.delta for e in events[:-1]) == plain.text
    assert plain.usage.output_tokens > 0


def test_translation_is_not_served_and_bad_input_is_a_400(asr_app):
    files = {"file": ("a.wav", wav(CLIPS[0]), "audio/wav")}
    r = httpx.post(f"{asr_app}/v1/audio/translations", data={"model": MODEL}, files=files)
    assert r.status_code == 404
    for data, files_, param in [({"model": "whisper-1"}, files, "model"),
                                ({"model": MODEL, "response_format": "vtt"}, files, "response_format"),
                                ({"model": MODEL, "language": "xx"}, files, "language"),
                                ({"model": MODEL}, {"file": ("a.wav", b"RIFF....WAVEfmt ", "audio/wav")}, "file")]:
        r = httpx.post(f"{asr_app}/v1/audio/transcriptions", data=data, files=files_)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_client_leaving_mid_stream_leaves_nothing_behind(asr_app):
    from omni_serve import settings

    long = speechy(90.0, 7)  # 30+ windows: still running when the client leaves after its first text
    idle_payloads = held_payloads()  # the session's other graphs may hold some (late writes awaiting their sweep)
    with httpx.stream("POST", f"{asr_app}/v1/audio/transcriptions", timeout=300,
                      data={"model": MODEL, "language": "en", "stream": "true"},
                      files={"file": ("a.wav", wav(long), "audio/wav")}) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
        assert "transcript.text.delta" in first
    assert busy_stages(asr_app) == {}
    # A window's stage may still write a payload after its cancel, which nobody reads: its producer's TTL sweep frees
    # it (OMNI_SERVE_DATA_TTL_S, then a sweep period of at most 5 s); that sweep is the bound.
    wait_until(lambda: held_payloads() <= idle_payloads, settings.DATA_TTL_S + 5 + 15,
               f"payloads left on the data plane: {shm_leftovers()}, ray directory {ray_directory_size()}")
