"""vLLM-Omni's chat stream shape, for its clients and its ``bench serve --omni`` backend (compatibility mode).

Contract: ``vllm_omni_chunks(p, events, model, sample_rate)`` turns a request's stage outputs into the SSE lines
vLLM-Omni's OpenAI server writes (``vllm_omni/entrypoints/openai/serving_chat.py``):
- every chunk is a ``chat.completion.chunk`` with a top-level ``modality`` (``"text"`` or ``"audio"``);
- text chunks carry the text in ``delta.content`` (the first one ``{"role": "assistant", "content": ""}``), with
  the running ``usage`` when ``stream_options.continuous_usage_stats`` is set (its benchmark counts tokens so);
- audio chunks carry, in ``delta.content``, a complete WAV file (base64) of that chunk's samples, with
  ``role`` and a ``usage`` whose ``completion_tokens`` is 0, as vLLM-Omni sends them;
- the stream ends with ``{"delta": {}, "finish_reason": ...}`` (vLLM-Omni's fallback closing chunk, no
  modality), the usage chunk when ``stream_options.include_usage`` is set, and ``data: [DONE]``.
Errors after the first line are one OpenAI error event, then ``[DONE]``, as in the OpenAI shape.
Chosen per graph (``chat_stream_format: vllm_omni``) or per request (header ``X-Omni-Stream-Format: vllm_omni``);
documented beside the OpenAI shape in the README ("vLLM-Omni's stream shape").
"""

from __future__ import annotations

import base64
from typing import AsyncIterator

import numpy as np

from omni_serve.api.errors import OpenAIError
from omni_serve.api.media import encode_wav
from omni_serve.api.sse import SSE_DONE, sse_error, sse_event
from omni_serve.kits.omni.messages import AudioDelta, TextDelta

HEADER = "x-omni-stream-format"
FORMATS = ("openai", "vllm_omni")


async def vllm_omni_chunks(p, events: AsyncIterator, model: str, sample_rate: int) -> AsyncIterator[str]:
    opts = p.request.stream_options
    running = opts is not None and opts.continuous_usage_stats

    def chunk(delta: dict, modality: str | None, finish=None, completion_tokens: int | None = None) -> str:
        body = {"id": p.request_id, "object": "chat.completion.chunk", "created": p.created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if completion_tokens is not None:
            body["usage"] = {"prompt_tokens": p.prompt_len, "completion_tokens": completion_tokens,
                             "total_tokens": p.prompt_len + completion_tokens}
        if modality is not None:
            body["modality"] = modality
        return sse_event(body)

    yield chunk({"role": "assistant", "content": ""}, "text", completion_tokens=0 if running else None)
    tokens, finish = 0, None
    try:
        async for _, out in events:
            if isinstance(out, TextDelta):
                tokens += len(out.token_ids)
                finish = out.finish_reason or finish
                if out.text:
                    p.clock.text()
                    yield chunk({"content": out.text}, "text", completion_tokens=tokens if running else None)
            elif isinstance(out, AudioDelta) and out.samples:
                samples = np.frombuffer(out.samples, dtype="<f4")
                p.clock.audio(samples.size / sample_rate)
                wav = base64.b64encode(encode_wav(samples, sample_rate)).decode()
                yield chunk({"role": "assistant", "content": wav}, "audio", completion_tokens=0)
    except OpenAIError as err:
        p.clock.error = err.type
        yield sse_error(err)
        yield SSE_DONE
        return
    yield chunk({}, None, finish=finish or "stop")
    if opts is not None and opts.include_usage:
        yield sse_event({"id": p.request_id, "object": "chat.completion.chunk", "created": p.created, "model": model,
                         "choices": [], "usage": {"prompt_tokens": p.prompt_len, "completion_tokens": tokens,
                                                  "total_tokens": p.prompt_len + tokens}})
    yield SSE_DONE
