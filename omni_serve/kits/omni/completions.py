"""OpenAI's legacy text completions (``POST /v1/completions``) on the Qwen-Omni graphs' thinker.

Contract: ``CompletionEndpoints`` is mixed into the Omni frontend (``OmniFrontend``) and answers the route with the
frontend's own stage calls and cancellation. Each prompt is used as given (a string is tokenized without a chat
template or special tokens; token ids are taken as they are), and each of its ``n`` choices is one thinker request
(text only: no encoder, no talker), every one in flight at once: choice ``j`` of a prompt samples with ``seed + j``,
so a choice equals the single request with that seed. Non-streamed, the reply waits for every choice; streamed,
chunks of the choices interleave as they come (each chunk names its choice's ``index``), a choice's last chunk
carries its ``finish_reason``, and with ``stream_options.include_usage`` a final chunk carries the usage. Whatever
ends the request (reply, error, client gone) cancels every choice's stage calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator

from omni_serve.api import protocol as P
from omni_serve.api.protocol import stop_sequences
from omni_serve.api.completions_protocol import (
    CompletionChoice, CompletionRequest, CompletionResponse, completion_logprobs,
)
from omni_serve.api.errors import bad_request
from omni_serve.api.limits import check_prompt_chars
from omni_serve.api.sse import SSE_DONE, sse_event, sse_failure
from omni_serve.graph.frontend import EventStream, RequestContext
from omni_serve.kits.omni.messages import TextDelta
from omni_serve.request_ids import new_request_id

_INT64 = 2**63
log = logging.getLogger(__name__)


def _media_tokens(thinker_cfg) -> set[int]:
    """The thinker's audio, image and video placeholder ids (Qwen2.5-Omni names them ``*_token_index``, Qwen3-Omni
    ``*_token_id``)."""
    names = [f"{m}_token_{s}" for m in ("audio", "image", "video") for s in ("index", "id")]
    return {v for v in (getattr(thinker_cfg, n, None) for n in names) if isinstance(v, int)}


def _choice_seed(seed: int | None, j: int) -> int | None:
    """``seed + j``, wrapped into int64 (None: each choice draws its own)."""
    return None if seed is None else (seed + j + _INT64) % (2 * _INT64) - _INT64


class _Choice:
    """What one choice has produced so far."""

    def __init__(self, index: int, prepared, echo: str):
        self.index, self.p, self.echo = index, prepared, echo
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish: str | None = None
        self.entries: list[P.ChatCompletionTokenLogprob] = []  # logprobs not sent yet (streamed) or all of them
        self.offset = len(echo)  # where the next token's text starts (text_offset)

    def logprobs(self, want: bool):
        """The legacy logprobs object of the entries gathered since the last call (None when not asked)."""
        if not want:
            return None
        out = completion_logprobs(self.entries, self.offset)
        self.offset += sum(len(t) for t in out.tokens)
        self.entries = []
        return out


class CompletionEndpoints:
    """``/v1/completions`` of a Qwen-Omni frontend (see the module doc). Uses the frontend's ``spec``, ``inputs``,
    ``thinker_cfg``, ``_check_model``, ``_check_in_vocabulary``, ``_checked_logit_bias``, ``_preprocessed``,
    ``_prepared``, ``_events`` and ``_logprobs``."""

    async def completions(self, req: CompletionRequest, ctx: RequestContext) -> CompletionResponse | EventStream:
        self._check_model(req.model)
        check_prompt_chars({"prompt": "".join(p for p in req.prompts() if isinstance(p, str))}, self.spec.limits)
        rid = new_request_id("cmpl")
        params = self.spec.thinker_params()
        temperature = req.temperature if req.temperature is not None else params.default_temperature
        sampling = dict(temperature=temperature, top_p=req.top_p or 1.0, min_new_tokens=req.min_tokens,
                        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                        logprobs=req.logprobs, logit_bias=self._checked_logit_bias(req.logit_bias))
        choices, prompt_tokens = [], 0
        for i, prompt in enumerate(req.prompts()):
            inputs, text = await self._preprocessed(rid, self._completion_prompt, prompt, i)
            prompt_tokens += int(inputs.input_ids.shape[1])
            for j in range(req.n):
                k = i * req.n + j
                p = self._prepared(req, f"{rid}.{k}", inputs, [], [], max_new=req.max_tokens, sampling=sampling,
                                   seed=_choice_seed(req.seed, j), stop=stop_sequences(req.stop), param="prompt")
                p.clock, p.timeout_s = ctx.clock, ctx.timeout_s
                choices.append(_Choice(k, p, text if req.echo else ""))
        if req.stream:
            return EventStream(self._completion_chunks(req, rid, choices, prompt_tokens))
        async with aclosing(self._choice_events(choices)) as events:
            async for choice, out in events:
                if out is not None:
                    self._absorb(choice, out)
        completion = sum(len(c.token_ids) for c in choices)
        return CompletionResponse(
            id=rid, model=self.spec.model_name,
            choices=[CompletionChoice(index=c.index, text=c.echo + "".join(c.text), finish_reason=c.finish,
                                      logprobs=c.logprobs(req.logprobs is not None),
                                      token_ids=c.token_ids if req.return_token_ids else None) for c in choices],
            usage=P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                              total_tokens=prompt_tokens + completion))

    def _completion_prompt(self, prompt: str | list[int], i: int):
        """(the thinker's inputs, the prompt's text) for a prompt string or token ids; a 400 for an id outside the
        vocabulary."""
        from omni_serve.models.qwen2_5_omni_inputs import OmniInputs
        import torch

        tokenizer = self.inputs.tokenizer
        if isinstance(prompt, str):
            ids, text = tokenizer.encode(prompt, add_special_tokens=False), prompt
        else:
            self._check_in_vocabulary(prompt, "prompt", f"prompt[{i}]")
            ids, text = list(prompt), tokenizer.decode(prompt)
        media = _media_tokens(self.thinker_cfg)
        placeholder = next((t for t in ids if t in media), None)
        if placeholder is not None:  # a media slot with no media: the thinker would read an embedding of nothing
            raise bad_request(f"prompt[{i}]: token {placeholder} ({tokenizer.decode([placeholder])}) is a media "
                              "placeholder; send media through /v1/chat/completions.", param="prompt",
                              code="invalid_value")
        return OmniInputs(input_ids=torch.tensor([ids], dtype=torch.long)), text

    def _absorb(self, c: _Choice, out) -> bool:
        """Take a choice's stage output; True when it added text."""
        if not isinstance(out, TextDelta):
            return False
        c.token_ids.extend(out.token_ids)
        c.finish = out.finish_reason or c.finish
        c.entries.extend(self._logprobs(out))
        if out.text:
            c.p.clock.text()
            c.text.append(out.text)
        return bool(out.text)

    async def _choice_events(self, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, object]]:
        """Every choice's stage outputs as they arrive, then ``(choice, None)`` when its calls end. The first error
        ends every choice's calls and is raised; so does closing this iterator."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice):
            try:
                async for _, out in self._events(c.p):
                    await queue.put((c, out))
                await queue.put((c, None))
            except Exception as exc:  # noqa: BLE001 - raised to the request below
                await queue.put((c, exc))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        live = len(choices)
        try:
            while live:
                c, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    live -= 1
                yield c, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _completion_chunks(self, req: CompletionRequest, rid: str, choices: list[_Choice],
                                 prompt_tokens: int) -> AsyncIterator[str]:
        want = req.logprobs is not None
        created = int(time.time())  # one creation time for every chunk of the stream, as OpenAI's

        def chunk(c: _Choice, text: str, finish=None) -> str:
            return sse_event(CompletionResponse(id=rid, created=created, model=self.spec.model_name, choices=[
                CompletionChoice(index=c.index, text=text, finish_reason=finish, logprobs=c.logprobs(want))]))

        try:
            for c in choices:
                if c.echo:
                    yield chunk(c, c.echo)
            # closed at once when the client leaves mid-stream (every choice's stage calls cancelled then)
            async with aclosing(self._choice_events(choices)) as events:
                async for c, out in events:
                    if out is None:
                        yield chunk(c, "", finish=c.finish or "stop")
                    elif self._absorb(c, out):
                        yield chunk(c, c.text[-1])
        except Exception as exc:  # noqa: BLE001 - the response has started (see sse_failure)
            yield sse_failure(exc, rid, choices[0].p.clock, log)
            yield SSE_DONE
            return
        opts = req.stream_options
        if opts is not None and opts.include_usage:
            completion = sum(len(c.token_ids) for c in choices)
            usage = P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                total_tokens=prompt_tokens + completion)
            yield sse_event(CompletionResponse(id=rid, created=created, model=self.spec.model_name, choices=[],
                                               usage=usage))
        yield SSE_DONE

