"""Unit tests for omni_serve.api.protocol and omni_serve.api.sse.

The request shapes come from the official ``openai`` client itself: it is pointed
at an in-process ``httpx.MockTransport`` that records the JSON it sends and
answers with our own response models, which the client must parse back.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ValidationError

from omni_serve.api.errors import OpenAIError, bad_request
from omni_serve.api.protocol import (
    AudioOutputOptions,
    ChatCompletionAudio,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionDelta,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaAudio,
    ImageURLPart,
    InputAudioPart,
    ModelCard,
    ModelList,
    TextPart,
    UsageInfo,
)
from omni_serve.api.sse import SSE_DONE, sse_error, sse_event, sse_failure
from tests.openai_mock import Recorder, make_client

AUDIO_B64 = base64.b64encode(b"RIFF....WAVEfmt ").decode()
IMAGE_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()


def minimal(**extra: Any) -> dict[str, Any]:
    return {"model": "qwen2.5-omni", "messages": [{"role": "user", "content": "hi"}], **extra}


def error_locs(exc: ValidationError) -> list[tuple[Any, ...]]:
    return [tuple(e["loc"]) for e in exc.errors()]


# ----------------------------------------------------------------------------- openai client shapes


def audio_response(model: str) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id="chatcmpl-1",
        created=1_700_000_000,
        model=model,
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatCompletionMessage(
                    content="Hello there.",
                    audio=ChatCompletionAudio(id="audio-1", data=AUDIO_B64, transcript="Hello there.", expires_at=1_700_003_600),
                ),
                finish_reason="stop",
            )
        ],
        usage=UsageInfo(prompt_tokens=12, completion_tokens=4, total_tokens=16),
    )


def test_official_client_multimodal_request_parses_and_response_round_trips() -> None:
    reply = httpx.Response(200, json=audio_response("qwen2.5-omni").model_dump(exclude_none=True))
    recorder = Recorder(reply)
    client = make_client(recorder)

    completion = client.chat.completions.create(
        model="qwen2.5-omni",
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is said here and shown there?"},
                    {"type": "input_audio", "input_audio": {"data": AUDIO_B64, "format": "wav"}},
                    {"type": "image_url", "image_url": {"url": IMAGE_URL, "detail": "auto"}},
                ],
            },
        ],
        max_completion_tokens=64,
        temperature=0.7,
        top_p=0.9,
        seed=7,
        stop=["\n\n"],
        user="tester",
        extra_body={"repetition_penalty": 1.05},
    )

    sent = recorder.bodies[0]
    req = ChatCompletionRequest.model_validate(sent)
    assert req.model == "qwen2.5-omni"
    assert req.output_modalities() == ["text", "audio"]
    assert req.wants_audio() is True
    assert req.audio == AudioOutputOptions(voice="Chelsie", format="wav")
    assert req.max_new_tokens(512) == 64
    assert (req.temperature, req.top_p, req.seed, req.stop, req.user) == (0.7, 0.9, 7, ["\n\n"], "tester")
    assert req.stream is False and req.n == 1
    assert not hasattr(req, "repetition_penalty")  # extra fields accepted, ignored

    system, user = req.messages
    assert system.role == "system" and system.content == "You are a helpful assistant."
    assert isinstance(user.content, list)
    text, audio, image = user.content
    assert isinstance(text, TextPart) and text.text.startswith("What is said")
    assert isinstance(audio, InputAudioPart)
    assert audio.input_audio.data == AUDIO_B64 and audio.input_audio.format == "wav"
    assert isinstance(image, ImageURLPart)
    assert image.image_url.url == IMAGE_URL and image.image_url.detail == "auto"

    # The client parses our response model, audio included.
    assert completion.id == "chatcmpl-1"
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "Hello there."
    assert choice.message.audio is not None
    assert choice.message.audio.data == AUDIO_B64
    assert choice.message.audio.transcript == "Hello there."
    assert completion.usage is not None and completion.usage.total_tokens == 16


def test_official_client_stream_request_and_sse_chunks() -> None:
    model = "qwen2.5-omni"
    chunks = [
        ChatCompletionChunk(id="c1", created=1, model=model, choices=[ChatCompletionChunkChoice(delta=ChatCompletionDelta(role="assistant", content=""))]),
        ChatCompletionChunk(id="c1", created=1, model=model, choices=[ChatCompletionChunkChoice(delta=ChatCompletionDelta(content="Hi"))]),
        ChatCompletionChunk(
            id="c1",
            created=1,
            model=model,
            choices=[ChatCompletionChunkChoice(delta=ChatCompletionDelta(audio=DeltaAudio(id="a1", data=AUDIO_B64, transcript="Hi", expires_at=5)))],
        ),
        ChatCompletionChunk(id="c1", created=1, model=model, choices=[ChatCompletionChunkChoice(delta=ChatCompletionDelta(), finish_reason="stop")]),
        ChatCompletionChunk(id="c1", created=1, model=model, choices=[], usage=UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4)),
    ]
    stream_text = "".join(sse_event(c) for c in chunks) + SSE_DONE
    reply = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream_text.encode())
    recorder = Recorder(reply)
    client = make_client(recorder)

    received = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=10,
        )
    )

    req = ChatCompletionRequest.model_validate(recorder.bodies[0])
    assert req.stream is True
    assert req.stream_options is not None and req.stream_options.include_usage is True
    assert req.max_new_tokens(99) == 10
    assert req.output_modalities() == ["text"] and not req.wants_audio()

    assert len(received) == 5
    assert received[0].choices[0].delta.role == "assistant"
    assert received[1].choices[0].delta.content == "Hi"
    delta_audio = received[2].choices[0].delta.audio
    assert delta_audio is not None
    assert (delta_audio.id, delta_audio.data, delta_audio.transcript) == ("a1", AUDIO_B64, "Hi")
    assert received[3].choices[0].finish_reason == "stop"
    assert received[4].choices == [] and received[4].usage is not None and received[4].usage.total_tokens == 4


# ----------------------------------------------------------------------------- request validation


def test_minimal_request_defaults() -> None:
    req = ChatCompletionRequest.model_validate(minimal())
    assert req.modalities is None
    assert req.output_modalities() == ["text"]
    assert req.wants_audio() is False
    assert req.max_new_tokens(256) == 256
    assert req.stream is False and req.n == 1 and req.audio is None
    assert req.messages == [ChatMessage(role="user", content="hi")]


def test_openais_unserved_fields_are_accepted_at_the_values_that_ask_for_nothing() -> None:
    """What clients send when they ask for no tools, logprobs, format or penalties (the official client passes
    explicit defaults through as given) parses; asking for any of them is a 400 (test_api_errors)."""
    recorder = Recorder(httpx.Response(200, json=audio_response("qwen2.5-omni").model_dump(exclude_none=True)))
    make_client(recorder).chat.completions.create(
        model="qwen2.5-omni", messages=[{"role": "user", "content": "hi"}], tools=[], tool_choice="auto",
        parallel_tool_calls=False, logprobs=False, top_logprobs=0, response_format={"type": "text"},
        presence_penalty=0.0, frequency_penalty=0, logit_bias={})
    req = ChatCompletionRequest.model_validate(recorder.bodies[0])
    assert req.tools == [] and req.tool_choice == "auto" and req.logprobs is False
    assert ChatCompletionRequest.model_validate({**minimal(), "tool_choice": "none"}).tool_choice == "none"


def test_max_new_tokens_precedence() -> None:
    assert ChatCompletionRequest.model_validate(minimal(max_tokens=5)).max_new_tokens(100) == 5
    both = ChatCompletionRequest.model_validate(minimal(max_tokens=5, max_completion_tokens=9))
    assert both.max_new_tokens(100) == 9


def test_message_variants_parse() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": AUDIO_B64}}], "name": "bob"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]},
            ],
            "modalities": ["audio", "text"],
            "audio": {"voice": "Ethan", "format": "pcm16"},
            "stop": "END",
            "logprobs": False,
        }
    )
    assert req.messages[1].content[0].input_audio.format == "wav"  # type: ignore[index,union-attr]
    assert req.messages[1].name == "bob"
    assert req.messages[2].content is None
    assert req.audio is not None and req.audio.format == "pcm16"
    assert req.wants_audio() and req.stop == "END"


@pytest.mark.parametrize(
    ("extra", "loc"),
    [
        ({"modalities": ["text", "video"]}, ("modalities", 1)),
        ({"modalities": []}, ("modalities",)),
        ({"modalities": ["audio"], "audio": {"voice": "Chelsie"}}, ("modalities",)),
        ({"modalities": ["text", "text"]}, ("modalities",)),
        ({"n": 2}, ("n",)),
        ({"temperature": 3}, ("temperature",)),
        ({"temperature": -0.1}, ("temperature",)),
        ({"top_p": 0}, ("top_p",)),
        ({"seed": 2**63}, ("seed",)),
        ({"seed": -2**63 - 1}, ("seed",)),
        ({"top_p": 1.5}, ("top_p",)),
        ({"max_tokens": 0}, ("max_tokens",)),
        ({"max_completion_tokens": -1}, ("max_completion_tokens",)),
        ({"stop": ["a", "b", "c", "d", "e"]}, ("stop", "stop[list]")),
        ({"stop": 5}, ("stop",)),
        ({"audio": {"voice": "Chelsie", "format": "mp3"}}, ("audio", "format")),
        ({"messages": []}, ("messages",)),
        ({"messages": [{"role": "function", "content": "x"}]}, ("messages", 0, "role")),
        ({"messages": [{"role": "user", "content": 5}]}, ("messages", 0, "content")),
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": {}}]}]}, ("messages", 0, "content", "content[parts]", 0)),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "aac"}}]}]},
            ("messages", 0, "content", "content[parts]", 0, "part[input_audio]", "input_audio", "format"),
        ),
    ],
)
def test_invalid_requests_raise(extra: dict[str, Any], loc: tuple[Any, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(minimal(**extra))
    assert loc in error_locs(info.value)


def test_validator_messages_are_specific() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(minimal(n=3))
    assert info.value.errors()[0]["msg"] == "only n=1 is supported"
    # audio output without audio options is valid (the graph's default voice, as vLLM-Omni's clients expect)
    assert ChatCompletionRequest.model_validate(minimal(modalities=["text", "audio"])).audio is None


def test_missing_required_fields() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert ("model",) in error_locs(info.value)


# ----------------------------------------------------------------------------- responses and SSE


def test_response_dump_omits_none_and_has_openai_constants() -> None:
    resp = ChatCompletionResponse(
        model="m", choices=[ChatCompletionChoice(message=ChatCompletionMessage(content="ok"), finish_reason="length")]
    )
    body = resp.model_dump(exclude_none=True)
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}]
    assert "usage" not in body

    chunk = ChatCompletionChunk(model="m", choices=[ChatCompletionChunkChoice(delta=ChatCompletionDelta(content="a"))])
    dumped = chunk.model_dump(exclude_none=True)
    assert dumped["object"] == "chat.completion.chunk"
    assert dumped["choices"] == [{"index": 0, "delta": {"content": "a"}}]

    models = ModelList(data=[ModelCard(id="qwen2.5-omni", created=1)]).model_dump()
    assert models == {"object": "list", "data": [{"id": "qwen2.5-omni", "object": "model", "created": 1, "owned_by": "omni_serve"}]}


def test_finish_reason_is_restricted() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionChoice(message=ChatCompletionMessage(content="x"), finish_reason="content_filter")  # type: ignore[arg-type]


def test_sse_framing() -> None:
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChatCompletionChunkChoice(delta=ChatCompletionDelta(content="line1\nline2"))])
    event = sse_event(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    payload = event[len("data: ") : -2]
    assert "\n" not in payload  # newlines inside content are JSON-escaped
    assert json.loads(payload) == {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "line1\nline2"}}],
    }
    assert sse_event({"a": "é", "b": None}) == 'data: {"a":"é","b":null}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


def test_sse_error_carries_openai_body() -> None:
    err: OpenAIError = bad_request("audio too long", param="messages[0].content[0].input_audio.data")
    event = sse_error(err)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:]) == err.body()
    assert json.loads(event[6:])["error"]["param"] == "messages[0].content[0].input_audio.data"


def test_sse_failure_sends_openai_errors_as_they_are_and_hides_the_rest(caplog) -> None:
    """A stream's failure after its first line: an OpenAIError goes out as it is, anything else as an internal error
    naming the request (logged with its traceback); the request's clock records the error type either way."""
    import logging
    from types import SimpleNamespace

    log, clock = logging.getLogger("test.sse"), SimpleNamespace(error=None)
    err = bad_request("bad", param="x")
    assert sse_failure(err, "req-1", clock, log) == sse_error(err) and clock.error == "invalid_request_error"
    with caplog.at_level(logging.ERROR, logger="test.sse"):
        event = json.loads(sse_failure(RuntimeError("secret detail"), "req-2", clock, log)[6:])
    assert "req-2" in event["error"]["message"] and "secret" not in event["error"]["message"]
    assert clock.error == event["error"]["type"] and "secret detail" in caplog.text


def test_every_field_has_a_description() -> None:
    import omni_serve.api.protocol as protocol

    models = [
        obj
        for obj in vars(protocol).values()
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == protocol.__name__
    ]
    assert len(models) >= 20
    missing = [f"{m.__name__}.{name}" for m in models for name, field in m.model_fields.items() if not field.description]
    assert missing == []


@pytest.mark.parametrize("field", ["true_cfg_scale", "guidance_scale"])
@pytest.mark.parametrize("text", ["Infinity", "-Infinity", "NaN", "1e6"])
def test_guidance_scales_are_finite_and_bounded(field: str, text: str) -> None:
    """JSON's Infinity and NaN (which Python's parser accepts) and absurd scales are refused, naming the field."""
    from omni_serve.api.images import MAX_GUIDANCE_SCALE, ImageGenerationRequest

    body = json.loads(f'{{"prompt": "x", "{field}": {text}}}')
    with pytest.raises(ValidationError) as err:
        ImageGenerationRequest.model_validate(body)
    assert err.value.errors()[0]["loc"] == (field,)
    assert getattr(ImageGenerationRequest(prompt="x", **{field: MAX_GUIDANCE_SCALE}), field) == MAX_GUIDANCE_SCALE
