"""OpenAI chat-completions protocol models (pydantic v2).

Contract:

* Request models accept exactly what the official ``openai`` Python client sends
  for chat completions with text, ``input_audio`` and ``image_url`` content parts;
  unknown fields are accepted and ignored.
* Invalid requests raise ``pydantic.ValidationError`` (FastAPI turns it into
  ``RequestValidationError``, rendered as a 400 by ``omni_serve.api.errors``).
  Cross-field rules report the offending field as ``loc``: ``modalities`` and ``n`` (only 1).
* Response models use ``None`` for absent optional fields, so serialize them
  with ``model_dump(exclude_none=True)`` / ``model_dump_json(exclude_none=True)``.
* Media payloads stay base64 strings here; decoding lives in ``omni_serve.api.media``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError

from omni_serve.api.tools import MAX_TOOLS, ChatTool, DeltaToolCall, NamedToolChoice, ToolCall, ToolChoice

__all__ = [
    "TextPart",
    "InputAudio",
    "InputAudioPart",
    "ImageURL",
    "ImageURLPart",
    "VideoURL",
    "VideoURLPart",
    "ContentPart",
    "ChatMessage",
    "AudioOutputOptions",
    "MMProcessorKwargs",
    "StreamOptions",
    "ChatCompletionRequest",
    "UsageInfo",
    "ChatCompletionAudio",
    "ChatCompletionMessage",
    "ChatCompletionChoice",
    "ChatCompletionResponse",
    "DeltaAudio",
    "ChatCompletionDelta",
    "ChatCompletionChunkChoice",
    "ChatCompletionChunk",
    "ModelCard",
    "ModelList",
]


class _Lenient(BaseModel):
    """Request-side base: extra fields sent by clients are accepted and dropped."""

    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------- content parts


class TextPart(_Lenient):
    type: Literal["text"] = Field(description="Content part kind: plain text.")
    text: str = Field(description="The text of this part.")


class InputAudio(_Lenient):
    data: str = Field(description="Base64-encoded audio bytes (a data: URL prefix is tolerated).")
    format: Literal["wav", "mp3", "flac", "ogg", "pcm16"] = Field(
        default="wav",
        description="Container/codec of `data`; 'pcm16' is raw little-endian int16 mono at 24 kHz.",
    )


class InputAudioPart(_Lenient):
    type: Literal["input_audio"] = Field(description="Content part kind: audio input.")
    input_audio: InputAudio = Field(description="The audio payload.")


class ImageURL(_Lenient):
    url: str = Field(description="Image as a data:image/...;base64 URL (remote URLs are rejected).")
    detail: str | None = Field(default=None, description="OpenAI detail hint; accepted and ignored.")


class ImageURLPart(_Lenient):
    type: Literal["image_url"] = Field(description="Content part kind: image input.")
    image_url: ImageURL = Field(description="The image reference.")


class VideoURL(_Lenient):
    url: str = Field(description="Video as a data:video/...;base64 URL (remote URLs are rejected).")


class VideoURLPart(_Lenient):
    type: Literal["video_url"] = Field(description=(
        "Content part kind: video input (the vLLM / Qwen-Omni extension of OpenAI's content parts)."))
    video_url: VideoURL = Field(description="The video reference.")


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"part[{kind}]" if kind in ("text", "input_audio", "image_url", "video_url") else None


# Tags contain "[" so the error renderer leaves them out of ``param`` paths.
ContentPart = Annotated[
    Union[
        Annotated[TextPart, Tag("part[text]")],
        Annotated[InputAudioPart, Tag("part[input_audio]")],
        Annotated[ImageURLPart, Tag("part[image_url]")],
        Annotated[VideoURLPart, Tag("part[video_url]")],
    ],
    Discriminator(
        _part_tag,
        custom_error_type="invalid_content_part",
        custom_error_message="content part 'type' must be 'text', 'input_audio', 'image_url' or 'video_url'",
    ),
]


def _content_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "content[str]"
    if isinstance(value, (list, tuple)):
        return "content[parts]"
    return None


MessageContent = Annotated[
    Union[
        Annotated[str, Tag("content[str]")],
        Annotated[list[ContentPart], Tag("content[parts]")],
    ],
    Discriminator(
        _content_tag,
        custom_error_type="invalid_content",
        custom_error_message="content must be a string, a list of content parts, or null",
    ),
]


StopSequences = Annotated[
    Union[
        Annotated[str, Tag("stop[str]")],
        Annotated[list[str], Field(max_length=4), Tag("stop[list]")],
    ],
    Discriminator(
        lambda v: "stop[str]" if isinstance(v, str) else "stop[list]" if isinstance(v, (list, tuple)) else None,
        custom_error_type="invalid_stop",
        custom_error_message="stop must be a string or a list of up to 4 strings",
    ),
]


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(
        description="Author of the message ('tool': a tool's result, answering an assistant's call)."
    )
    content: MessageContent | None = Field(
        default=None, description="A string, a list of content parts, or null."
    )
    name: str | None = Field(default=None, description="Optional participant name.")
    tool_calls: list[ToolCall] | None = Field(default=None, description=(
        "An assistant message's tool calls (as a reply returned them), rendered after its text."))
    tool_call_id: str | None = Field(default=None, description=(
        "A tool message's answer to this call id (accepted; the chat template matches results to calls by order)."))


# --------------------------------------------------------------------------- request


class AudioOutputOptions(_Lenient):
    voice: str | None = Field(default=None, description=(
        "Speaker/voice name for generated audio (e.g. 'Chelsie'); none: the graph's default_voice (vLLM-Omni's "
        "clients send only a format)."))
    format: Literal["wav", "pcm16"] = Field(
        default="wav", description="Encoding of returned audio: a WAV file or raw int16 PCM."
    )


class StreamOptions(_Lenient):
    include_usage: bool = Field(
        default=False, description="Send a final chunk with usage and no choices."
    )
    continuous_usage_stats: bool = Field(default=False, description=(
        "vLLM's extension: every text chunk carries the usage so far (read in the vLLM-Omni stream shape)."))


class MMProcessorKwargs(_Lenient):
    use_audio_in_video: bool | None = Field(default=None, description=(
        "Qwen-Omni: also hear the audio track of every video part (its tokens interleaved with the video's in "
        "time). None: the graph's default (video.use_audio_in_video). True fails for a video without audio."))


class JSONSchemaFormat(_Lenient):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The schema's name (a-z, 0-9, _ -).")
    description: str | None = Field(default=None, description="What the format is for (not shown to the model).")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description=(
        "The JSON schema the reply must satisfy (None: any JSON value)."))
    strict: bool | None = Field(default=None, description=(
        "Accepted; the reply always follows the schema (constrained decoding), strict or not."))


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = Field(description="The reply's format.")
    json_schema: JSONSchemaFormat | None = Field(default=None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing_json_schema", "type json_schema needs json_schema")
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the reply is constrained to, as JSON text; None: unconstrained (text)."""
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.type == "json_schema":
            return json.dumps(self.json_schema.schema_ if self.json_schema.schema_ is not None else {})
        return None


MAX_LOGIT_BIAS = 300  # tokens per request, as OpenAI's limit
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only (str.isdigit also takes "²", which int() refuses)


def _check_logit_bias(value: dict[str, float]) -> dict[str, float]:
    if len(value) > MAX_LOGIT_BIAS:
        raise PydanticCustomError("invalid_logit_bias", "at most {limit} tokens", {"limit": MAX_LOGIT_BIAS})
    for key, bias in value.items():
        if not _TOKEN_ID.fullmatch(key):
            raise PydanticCustomError("invalid_logit_bias", "keys must be token ids (digits), not '{key}'",
                                      {"key": key})
        if not -100 <= bias <= 100:
            raise PydanticCustomError("invalid_logit_bias", "values must be from -100 to 100 (token {key}: {bias})",
                                      {"key": key, "bias": bias})
    return value


# OpenAI's logit_bias: token id (a string of digits) -> bias from -100 to 100, at most MAX_LOGIT_BIAS entries
LogitBias = Annotated[dict[str, float], AfterValidator(_check_logit_bias)]


def logit_bias_ids(value: dict[str, float] | None) -> dict[int, float]:
    """A request's ``logit_bias`` keyed by token id (empty when none)."""
    return {int(k): float(v) for k, v in (value or {}).items()}


class ChatCompletionRequest(_Lenient):
    model: str = Field(description="Served model name.")
    messages: list[ChatMessage] = Field(min_length=1, description="Conversation so far (>= 1).")
    modalities: list[Literal["text", "audio"]] | None = Field(
        default=None,
        description="Output modalities; must include 'text'. None means ['text'].",
    )
    audio: AudioOutputOptions | None = Field(
        default=None,
        description=("Audio output options. Without them, audio output uses the graph's default_voice and WAV (as "
                     "vLLM-Omni's clients expect; OpenAI requires them)."),
    )
    max_tokens: int | None = Field(default=None, ge=1, description="Legacy cap on generated tokens.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Cap on generated tokens (preferred over max_tokens)."
    )
    temperature: float | None = Field(default=None, ge=0, le=2, description="Sampling temperature.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63, description="Sampling seed for reproducibility (int64).")
    stop: StopSequences | None = Field(
        default=None, description="Up to 4 stop sequences."
    )
    stream: bool = Field(default=False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(
        default=None, description="Streaming options (only used when stream=true)."
    )
    n: int = Field(default=1, description="Number of choices; only 1 is supported.")
    user: str | None = Field(default=None, description="End-user identifier; accepted and ignored.")
    return_token_ids: bool = Field(
        default=False,
        description="omni_serve extension: also return generated text token ids and codec token ids.",
    )
    transcript_in_content: bool = Field(
        default=False,
        description=("omni_serve extension, for clients that read only `content`: with audio output, the reply's "
                     "text goes in `content` (streamed: `delta.content` pieces) instead of OpenAI's "
                     "`audio.transcript` (streamed: `delta.audio.transcript` pieces, `content` null)."),
    )
    mm_processor_kwargs: MMProcessorKwargs | None = Field(default=None, description=(
        "Extension (as vLLM's): multimodal processor settings for this request; only use_audio_in_video is read."))
    min_tokens: int = Field(
        default=0, ge=0,
        description=("omni_serve extension (as vLLM's): generate at least this many text tokens before a stop "
                     "token may end the text (benchmarks use it to fix output lengths)."),
    )
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description=(
        "Subtracted from the logit of every token already generated (OpenAI's; the prompt does not count)."))
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description=(
        "Subtracted from a token's logit once per time it was already generated (OpenAI's)."))
    logprobs: bool | None = Field(default=None, description=(
        "Return the log-probability of each generated text token (choices[].logprobs.content), under the model's "
        "distribution before temperature, top-p and penalties (as vLLM's default raw_logprobs; with a JSON "
        "response_format, after its grammar's mask)."))
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description=(
        "With logprobs: also this many most likely tokens at each position (0-20)."))
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS, description=(
        "Functions the model may call (up to 128), rendered by the checkpoint's chat template; the reply's calls "
        "come back in message.tool_calls (streamed: delta.tool_calls, each call whole). Text output only."))
    tool_choice: ToolChoice | None = Field(default=None, description=(
        "'auto' (default with tools): the model may call; 'none': the tools are not shown and no call is parsed; "
        "'required' or {'type': 'function', 'function': {'name': ...}}: the reply is constrained to calls (of any "
        "tool, or the named one) whose arguments follow the tool's parameters schema."))
    parallel_tool_calls: bool | None = Field(default=None, description=(
        "False: at most one call per reply (a forced call is one call; with 'auto' the reply ends after the first "
        "call). Default true."))
    response_format: ResponseFormat | None = Field(default=None, description=(
        "text (default), json_object or json_schema: the reply is constrained to JSON (any object, or one that "
        "the schema accepts), compact (no whitespace between tokens)."))
    logit_bias: LogitBias | None = Field(default=None, description=(
        "Token id (as a string) -> a value from -100 to 100 added to that token's logit before sampling (OpenAI's; "
        "up to 300 tokens). The ids must be inside the thinker's vocabulary."))

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if value in ("required",) or isinstance(value, NamedToolChoice):
            if not tools:
                raise PydanticCustomError("invalid_tool_choice", "tool_choice {choice} needs tools",
                                          {"choice": json.dumps(value if isinstance(value, str) else "function")})
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise PydanticCustomError("invalid_tool_choice", "tool_choice names {name}, which is not in tools",
                                      {"name": json.dumps(value.function.name)})
        return value

    def tool_mode(self) -> str | NamedToolChoice | None:
        """How the reply may use tools: None (no tools, or tool_choice 'none'), 'auto', 'required', or the named
        function."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tool_choice or "auto"

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value:
            raise PydanticCustomError("invalid_modalities", "modalities must not be empty")
        if len(set(value)) != len(value):
            raise PydanticCustomError("invalid_modalities", "modalities must not contain duplicates")
        if "text" not in value:
            raise PydanticCustomError(
                "invalid_modalities", "modalities must include 'text' (audio-only output is not supported)"
            )
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int) -> int:
        if value != 1:
            raise PydanticCustomError("unsupported_n", "only n=1 is supported")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_top_logprobs", "top_logprobs needs logprobs: true")
        return value

    def logprobs_wanted(self) -> int | None:
        """How many top alternatives each token's log-probability comes with; None: no logprobs asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_modalities(self) -> list[str]:
        """Requested output modalities; ``["text"]`` when not given."""
        return list(self.modalities) if self.modalities else ["text"]

    def wants_audio(self) -> bool:
        """Whether spoken audio output was requested."""
        return "audio" in self.output_modalities()

    @model_validator(mode="after")
    def _check_min_tokens(self):
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None and self.min_tokens > limit:
            raise PydanticCustomError("invalid_min_tokens", "min_tokens must not exceed max_tokens")
        return self

    def max_new_tokens(self, default: int) -> int:
        """``max_completion_tokens``, else ``max_tokens``, else ``default``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return default


# --------------------------------------------------------------------------- responses


def stop_sequences(stop: str | list[str] | None) -> list[str]:
    """A request's ``stop`` field as a list (OpenAI takes one string or up to four)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _now() -> int:
    return int(time.time())


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int = Field(default=0, description="Tokens in the prompt.")
    completion_tokens: int = Field(default=0, description="Tokens generated.")
    total_tokens: int = Field(default=0, description="prompt_tokens + completion_tokens.")


class ChatCompletionAudio(BaseModel):
    id: str = Field(description="Identifier of the generated audio.")
    data: str = Field(description="Base64-encoded audio in the requested format.")
    transcript: str = Field(description="Text spoken in the audio.")
    expires_at: int = Field(description="Unix time after which the id is no longer usable.")


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = Field(default="assistant", description="Always 'assistant'.")
    content: str | None = Field(default=None, description="Generated text, if any.")
    tool_calls: list[ToolCall] | None = Field(default=None, description="The tools the reply calls, if any.")
    audio: ChatCompletionAudio | None = Field(default=None, description="Generated audio, if requested.")


class TopLogprob(BaseModel):
    token: str = Field(description="The token's text (its own decode; may be a partial UTF-8 character).")
    logprob: float = Field(description="Its log-probability.")
    bytes: list[int] | None = Field(default=None, description="The token text's UTF-8 bytes.")


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list, description=(
        "The most likely tokens at this position, most likely first (top_logprobs of them)."))


class ChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = Field(default=None, description=(
        "One entry per generated text token, the end token included (as vLLM's)."))
    refusal: list[ChatCompletionTokenLogprob] | None = Field(default=None, description="Always null (no refusals).")


class ChatCompletionChoice(BaseModel):
    index: int = Field(default=0, description="Choice index (always 0; n=1).")
    message: ChatCompletionMessage = Field(description="The generated message.")
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = Field(
        default=None, description="Why generation ended ('tool_calls': the reply calls tools)."
    )
    logprobs: ChoiceLogprobs | None = Field(default=None, description="Token log-probabilities (logprobs: true).")
    token_ids: list[int] | None = Field(
        default=None, description="omni_serve extension: generated text token ids (return_token_ids)."
    )
    codec_ids: list[int] | None = Field(
        default=None, description="omni_serve extension: generated codec token ids (return_token_ids)."
    )


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=_completion_id, description="Completion id ('chatcmpl-...').")
    object: Literal["chat.completion"] = Field(default="chat.completion", description="Object type.")
    created: int = Field(default_factory=_now, description="Unix creation time (seconds).")
    model: str = Field(description="Model that produced the completion.")
    choices: list[ChatCompletionChoice] = Field(description="Generated choices.")
    usage: UsageInfo | None = Field(default=None, description="Token accounting.")


class DeltaAudio(BaseModel):
    id: str | None = Field(default=None, description="Audio id (sent with the first audio delta).")
    data: str | None = Field(default=None, description="Base64 audio bytes of this chunk.")
    transcript: str | None = Field(default=None, description="Transcript text of this chunk.")
    expires_at: int | None = Field(default=None, description="Unix expiry time of the audio id.")


class ChatCompletionDelta(BaseModel):
    role: str | None = Field(default=None, description="'assistant' on the first chunk only.")
    content: str | None = Field(default=None, description="Incremental text.")
    audio: DeltaAudio | None = Field(default=None, description="Incremental audio.")
    tool_calls: list[DeltaToolCall] | None = Field(default=None, description="Tool calls this chunk adds.")


class ChatCompletionChunkChoice(BaseModel):
    index: int = Field(default=0, description="Choice index (always 0; n=1).")
    delta: ChatCompletionDelta = Field(description="What this chunk adds.")
    logprobs: ChoiceLogprobs | None = Field(default=None, description=(
        "Log-probabilities of the tokens generated since the previous chunk with text (logprobs: true); a token "
        "whose text is held back (a possible stop string, a partial character) comes with the next chunk that has "
        "text, or the last."))
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = Field(
        default=None, description="Set on the last chunk of the choice."
    )


class ChatCompletionChunk(BaseModel):
    id: str = Field(default_factory=_completion_id, description="Completion id, same for all chunks.")
    object: Literal["chat.completion.chunk"] = Field(
        default="chat.completion.chunk", description="Object type."
    )
    created: int = Field(default_factory=_now, description="Unix creation time (seconds).")
    model: str = Field(description="Model that produced the chunk.")
    choices: list[ChatCompletionChunkChoice] = Field(
        default_factory=list, description="Chunk choices; empty on the final usage chunk."
    )
    usage: UsageInfo | None = Field(default=None, description="Usage (final chunk only, if asked).")


class ModelCard(BaseModel):
    id: str = Field(description="Model name as used in requests.")
    object: Literal["model"] = Field(default="model", description="Object type.")
    created: int = Field(default_factory=_now, description="Unix time the model was registered.")
    owned_by: str = Field(default="omni_serve", description="Owner label.")


class ModelList(BaseModel):
    object: Literal["list"] = Field(default="list", description="Object type.")
    data: list[ModelCard] = Field(default_factory=list, description="Served models.")
