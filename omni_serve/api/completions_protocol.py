"""OpenAI's legacy text completions (``POST /v1/completions``): request, response and stream chunk models.

Contract: ``CompletionRequest`` validates what the official client's ``completions.create`` sends. A prompt is a
string, a list of token ids, or a list of either (one choice set per prompt); every prompt gets ``n`` choices,
indexed ``prompt * n + j`` as OpenAI orders them. Fields that ask for what this server does not do (``suffix``,
``best_of`` other than ``n``, ``echo`` with ``logprobs``) are a 400 naming the field, never ignored. ``logprobs`` is the
legacy form: an integer, the number of alternatives per token (0-5), answered as ``CompletionLogprobs``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from omni_serve.api.protocol import LogitBias, StopSequences, StreamOptions, UsageInfo, _Lenient, _now

MAX_PROMPTS = 16  # prompts per request (each is a thinker request, all in flight at once)
MAX_CHOICES = 16  # prompts x n

Prompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_Lenient):
    model: str = Field(description="Served model name.")
    prompt: Prompt = Field(description=(
        "A string, a list of token ids, or a list of either (up to 16 prompts; each gets n choices). Used as "
        "given: no chat template is applied."))
    max_tokens: int = Field(default=16, ge=1, description="Cap on generated tokens per choice (OpenAI's default 16).")
    temperature: float | None = Field(default=None, ge=0, le=2, description=(
        "Sampling temperature. None: the graph's default_temperature."))
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    n: int = Field(default=1, ge=1, description="Choices per prompt (prompts x n at most 16).")
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63, description=(
        "Sampling seed; choice j of a prompt samples with seed + j."))
    stop: StopSequences | None = Field(default=None, description="Up to 4 stop sequences.")
    stream: bool = Field(default=False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(default=None, description=(
        "Streaming options (only used when stream=true): include_usage adds a final usage chunk."))
    logprobs: int | None = Field(default=None, ge=0, le=5, description=(
        "Return each generated token's log-probability (raw: before temperature, top-p and penalties) with this "
        "many most likely alternatives (0-5)."))
    echo: bool = Field(default=False, description="Put the prompt's text before each choice's completion.")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description=(
        "Subtracted from the logit of every token already generated (the prompt does not count)."))
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description=(
        "Subtracted from a token's logit once per time it was already generated."))
    user: str | None = Field(default=None, description="End-user identifier; accepted and ignored.")
    min_tokens: int = Field(default=0, ge=0, description=(
        "omni_serve extension (as vLLM's): generate at least this many tokens before the end token may stop."))
    return_token_ids: bool = Field(default=False, description=(
        "omni_serve extension: also return each choice's generated token ids (choices[].token_ids)."))
    # OpenAI's fields not served: their do-nothing values are accepted, anything else is a 400 naming the field.
    suffix: str | None = Field(default=None, description="Not served (no insertion mode): a non-empty suffix is a 400.")
    best_of: int | None = Field(default=None, ge=1, description="Not served: only best_of equal to n is accepted.")
    logit_bias: LogitBias | None = Field(default=None, description=(
        "Token id (as a string) -> a value from -100 to 100 added to that token's logit before sampling (up to 300)."))

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        """One message for every malformed prompt (instead of one per branch of the union)."""
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(value, str) or ids(value) or (isinstance(value, list) and (
                all(isinstance(x, str) for x in value) or all(ids(x) for x in value))):
            return value
        raise PydanticCustomError("invalid_prompt", "prompt must be a string, a list of token ids, a list of strings "
                                  "or a list of token-id lists")

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Prompt) -> Prompt:
        prompts = cls.prompts_of(value)
        if not prompts:
            raise PydanticCustomError("invalid_prompt", "prompt must not be an empty list")
        if len(prompts) > MAX_PROMPTS:
            raise PydanticCustomError("invalid_prompt", "at most {limit} prompts per request", {"limit": MAX_PROMPTS})
        if any(len(p) == 0 for p in prompts):
            raise PydanticCustomError("invalid_prompt", "a prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, value: str | None) -> str | None:
        if value:
            raise PydanticCustomError("unsupported_parameter", "not supported by this server (no insertion mode); "
                                      "send the request without it")
        return value

    @field_validator("best_of")
    @classmethod
    def _refuse_best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise PydanticCustomError("unsupported_parameter", "only best_of equal to n ({n}) is served", {"n": n})
        return value

    @model_validator(mode="after")
    def _check_counts(self) -> "CompletionRequest":
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise PydanticCustomError("invalid_n", "prompts x n must be at most {limit}", {"limit": MAX_CHOICES})
        if self.min_tokens > self.max_tokens:
            raise PydanticCustomError("invalid_min_tokens", "min_tokens must not exceed max_tokens")
        if self.echo and self.logprobs is not None:
            raise PydanticCustomError("unsupported_parameter", "echo with logprobs (the prompt's logprobs) is not "
                                      "served; send one of them")
        return self

    @staticmethod
    def prompts_of(value: Prompt) -> list[str | list[int]]:
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(t, int) for t in value):
            return [list(value)]
        return list(value)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        return self.prompts_of(self.prompt)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list, description="Each generated token's text (its own decode).")
    token_logprobs: list[float] = Field(default_factory=list, description="Each token's log-probability.")
    top_logprobs: list[dict[str, float]] = Field(default_factory=list, description=(
        "Per token, its most likely alternatives and the sampled token (text -> log-probability)."))
    text_offset: list[int] = Field(default_factory=list, description=(
        "Where each token's text starts in the choice's text (after the echoed prompt, if any)."))


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt index x n + choice number.")
    text: str = Field(description="The generated text (after the prompt's, with echo).")
    logprobs: CompletionLogprobs | None = Field(default=None, description=(
        "With logprobs: the tokens' log-probabilities."))
    finish_reason: Literal["stop", "length"] | None = Field(default=None, description="Why generation ended.")
    token_ids: list[int] | None = Field(default=None, description=(
        "omni_serve extension: the generated token ids (return_token_ids), the end token included."))


class CompletionResponse(BaseModel):
    id: str = Field(description="Completion id ('cmpl-...').")
    object: Literal["text_completion"] = Field(default="text_completion", description="Object type.")
    created: int = Field(default_factory=_now, description="Unix creation time (seconds).")
    model: str = Field(description="Model that produced the completion.")
    choices: list[CompletionChoice] = Field(description="The choices (streamed: those this chunk adds to).")
    usage: UsageInfo | None = Field(default=None, description="Token accounting (streamed: the final chunk, if asked).")
    system_fingerprint: str | None = Field(default=None, description="Always null.")


def completion_logprobs(entries: list[Any], offset: int) -> CompletionLogprobs:
    """The legacy logprobs object from chat-style entries (``ChatCompletionTokenLogprob``), text offsets counted
    from ``offset``."""
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        top = {t.token: t.logprob for t in e.top_logprobs}
        top.setdefault(e.token, e.logprob)  # the sampled token always, as OpenAI's (up to logprobs + 1 entries)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(e.token)
    return out
