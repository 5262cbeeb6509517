"""Ingress side of the Qwen3-ASR graph: ``POST /v1/audio/transcriptions`` -> windows -> stage calls -> OpenAI reply.

Contract: ``Qwen3ASRFrontend(spec, stages)`` serves one route with OpenAI's request and reply shapes
(``omni_serve.api.audio_protocol``). The upload is checked (size, format, rate, channels, duration: 400s naming
``file``) and decoded to 16 kHz mono; audio longer than ``window_seconds`` is split into windows
(``prompting.split_windows``). Each window is one request on the stages, under its own id ``<request>-w<i>``: its
features go to the encoder over the data plane, its prompt to the LLM, and every window of the upload runs at
once (they share the encoder's calls and the LLM's steps with each other and with other uploads). Texts come back
in window order: ``json`` and ``text`` give the joined transcript, ``verbose_json`` one segment per window (its
start and end in the audio: the model itself gives no timestamps, so ``srt``/``vtt`` are a 400), ``stream=true``
``transcript.text.delta`` events (window 0's as they come, a later window's once those before it ended) then
``transcript.text.done``. ``language`` (a name or an ISO-639-1 code the model knows, else a 400) is forced as the
model's own prefix; unset, the model names the language and ``verbose_json`` reports it. ``prompt`` is the
model's context (its system turn). ``temperature`` 0 (the default) decodes greedily, as ``generate`` does.
Translation is not a task of this model: ``/v1/audio/translations`` is not served (404).
``/v1/realtime?intent=transcription`` (WebSocket) is OpenAI's realtime transcription session: audio streamed in,
each committed turn transcribed through the same windows and stages (``realtime.py``).

Whatever ends a request, every window's stage calls are cancelled and its payloads freed (``StageCalls.stream``).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from omni_serve.api.audio_protocol import (
    Transcription, TranscriptionRequest, TranscriptionSegment, TranscriptionUsage, TranscriptionVerbose,
    TranscriptTextDelta, TranscriptTextDone,
)
from omni_serve.api.errors import OpenAIError, bad_request
from omni_serve.api.media import decode_audio_bytes, read_upload
from omni_serve.api.sse import sse_error, sse_event
from omni_serve.api.video import read_audio_container
from omni_serve.families.qwen3_asr.messages import (
    AudioFeatures, EncodeCall, TranscribeCall, TranscribeDone, TranscriptTokens,
)
from omni_serve.families.qwen3_asr.prompting import WindowPrompts, join, joiner, split_windows
from omni_serve.families.qwen3_asr.spec import Qwen3ASRGraphSpec
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.frontend import EventStream, Frontend, RawReply, RequestContext, Route, WebSocketRoute
from omni_serve.request_ids import new_request_id


@dataclass
class Window:
    """One window of an upload: where it lies, its prompt and features, and what the stages answered."""

    request_id: str
    start_s: float
    end_s: float
    input_ids: list[int]
    features: object  # torch.Tensor [128, T]
    frames: int
    text: object = None  # prompting.TranscriptText
    token_ids: list[int] = field(default_factory=list)
    done: TranscribeDone | None = None


class Qwen3ASRFrontend(Frontend):
    routes = (Route("/v1/audio/transcriptions", "transcriptions", "audio_transcriptions", TranscriptionRequest,
                    form=True, summary="Transcribe audio (OpenAI audio.transcriptions.create)."),)
    websocket_routes = (WebSocketRoute("/v1/realtime", "realtime", "realtime_session", intent="transcription"),)

    def __init__(self, spec: Qwen3ASRGraphSpec, stages: StageCalls):
        super().__init__(spec, stages)
        self.prompts = WindowPrompts(spec.checkpoint)

    async def realtime_session(self, websocket, ctx: RequestContext) -> None:
        """``/v1/realtime?intent=transcription``: a realtime transcription session (``realtime.py``)."""
        from omni_serve.families.qwen3_asr.realtime import TranscriptionSession

        await TranscriptionSession(self, websocket, ctx).run()

    # -- request preparation ------------------------------------------------------------------------------
    def _check(self, req: TranscriptionRequest) -> None:
        if req.model != self.spec.model_name:
            raise bad_request(f"The model {req.model!r} does not exist; this server serves {self.spec.model_name!r}.",
                              param="model", code="model_not_found")
        if req.response_format in ("srt", "vtt"):
            raise bad_request(f"response_format {req.response_format!r} needs timestamps, which this model does not "
                              "produce; use json, text or verbose_json.", param="response_format",
                              code="invalid_value")
        try:
            self.prompts.check_language(req.language)
        except ValueError:
            raise bad_request(f"language {req.language!r} is not one this model knows (give a language name or "
                              "ISO-639-1 code it supports, or leave it out to have the model detect it).",
                              param="language", code="invalid_value") from None

    def _windows(self, req: TranscriptionRequest, raw: bytes, rid: str) -> tuple[list[Window], float]:
        """The upload's windows (prompts and features built) and its duration in seconds; CPU work."""
        limits, rate = self.spec.limits, self.prompts.sampling_rate
        checks = dict(max_seconds=self.spec.max_audio_seconds, param="file",
                      max_sample_rate=limits.max_audio_sample_rate, max_channels=limits.max_audio_channels)
        audio = decode_audio_bytes(  # soundfile (wav, mp3, flac, ogg), else FFmpeg (m4a, mp4, webm, ...)
            raw, "wav, mp3, flac or ogg", target_sr=rate, **checks,
            other_reader=lambda data: read_audio_container(data, rate=rate, **checks))
        if audio.size == 0:
            raise bad_request("file holds no audio.", param="file")
        return self.windows_of(audio, req.language, req.prompt, rid), audio.size / rate

    def windows_of(self, audio: np.ndarray, language: str | None, prompt: str | None, rid: str) -> list[Window]:
        """The windows of ``audio`` (16 kHz mono float32), their prompts and features built; CPU work."""
        s, rate = self.spec, self.prompts.sampling_rate
        windows = []
        for i, (a, b) in enumerate(split_windows(audio.size, rate, s.window_seconds, s.window_search_seconds, audio)):
            ids, feats, frames = self.prompts.window(audio[a:b], language, prompt)
            windows.append(Window(f"{rid}-w{i}", a / rate, b / rate, ids, feats, frames,
                                  text=self.prompts.decoder(forced=bool(language))))
        return windows

    def _calls(self, w: Window, temperature: float, stream: bool) -> dict:
        seed = random.randrange(2**31)
        return {"encoder": EncodeCall(request_id=w.request_id),
                "llm": TranscribeCall(request_id=w.request_id, input_ids=w.input_ids, max_tokens=self.spec.max_tokens,
                                      temperature=temperature, seed=seed, stream=stream)}

    # -- running windows ----------------------------------------------------------------------------------
    async def window_outputs(self, windows: list[Window], temperature: float, timeout_s: float,
                             stream: bool = True) -> AsyncIterator[tuple[int, object]]:
        """``(window index, stage output)`` of every window, all running at once, yielded in window order (a later
        window's outputs wait until the windows before it ended). A window's failure is raised at once; leaving early
        cancels every window. ``stream``: the LLM sends tokens as they come (else each window's at its end)."""
        queues = [asyncio.Queue() for _ in windows]
        end = object()

        async def run(i: int, w: Window) -> None:
            try:
                inputs = {"ingress_encoder": AudioFeatures(features=w.features, frames=w.frames)}
                calls = self._calls(w, temperature, stream)
                async for _, out in self.stages.stream(w.request_id, calls, timeout_s, inputs=inputs):
                    queues[i].put_nowait(out)
                queues[i].put_nowait(end)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which stops at once
                for q in queues:
                    q.put_nowait(exc)
                raise

        tasks = [asyncio.create_task(run(i, w)) for i, w in enumerate(windows)]
        try:
            for i, q in enumerate(queues):
                while (item := await q.get()) is not end:
                    if isinstance(item, BaseException):
                        raise item
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _prepare(self, req: TranscriptionRequest) -> tuple[list[Window], float]:
        self._check(req)
        raw = await read_upload(req.file, self.spec.max_file_bytes, "file")
        return await asyncio.to_thread(self._windows, req, raw, new_request_id("transcription"))

    # -- the route ----------------------------------------------------------------------------------------
    async def audio_transcriptions(
            self, req: TranscriptionRequest, ctx: RequestContext,
    ) -> Transcription | TranscriptionVerbose | RawReply | EventStream:
        windows, duration = await self._prepare(req)
        if req.stream:
            return EventStream(self._events(windows, req, ctx))
        async for i, out in self.window_outputs(windows, req.temperature, ctx.timeout_s, stream=False):
            self._take(windows[i], out, ctx)
        parts = [w.text.final() for w in windows]
        texts = [p["transcription"] for p in parts]
        text = join(texts)
        usage = usage_of(windows)
        if req.response_format == "text":
            return RawReply(text, "text/plain; charset=utf-8")
        if req.response_format == "verbose_json":
            language = req.language or next((p["language"] for p in parts if p["language"]), None) or "unknown"
            segments = [TranscriptionSegment(id=i, seek=round(w.start_s * 100), start=round(w.start_s, 3),
                                             end=round(w.end_s, 3), text=t, tokens=w.token_ids,
                                             temperature=req.temperature)
                        for i, (w, t) in enumerate(zip(windows, texts))]
            return TranscriptionVerbose(language=language, duration=round(duration, 3), text=text, segments=segments,
                                        usage=usage.model_dump())
        return Transcription(text=text, usage=usage)

    @staticmethod
    def _take(w: Window, out, ctx: RequestContext) -> str:
        """Record one stage output of window ``w``; the transcript's new text, if any."""
        delta = take_output(w, out)
        if delta:
            ctx.clock.text()
        return delta

    async def _events(self, windows: list[Window], req: TranscriptionRequest,
                      ctx: RequestContext) -> AsyncIterator[str]:
        sent = ""  # the text streamed so far (the windows' texts, joined)
        started = [False] * len(windows)
        try:
            async for i, out in self.window_outputs(windows, req.temperature, ctx.timeout_s):
                delta = self._take(windows[i], out, ctx)
                if delta:
                    if not started[i]:  # the window's first text: what separates it from the text before
                        started[i] = True
                        delta = joiner(sent, delta) + delta
                    sent += delta
                    yield sse_event(TranscriptTextDelta(delta=delta))
        except OpenAIError as err:
            ctx.clock.error = err.type
            yield sse_error(err)
            return
        text = join([w.text.final()["transcription"] for w in windows])
        yield sse_event(TranscriptTextDone(text=text, usage=usage_of(windows)))


def take_output(w: Window, out) -> str:
    """Record one stage output of window ``w``; the transcript's new text, if any."""
    if isinstance(out, TranscriptTokens):
        w.token_ids.extend(out.token_ids)
        return w.text.add(out.token_ids)
    if isinstance(out, TranscribeDone):
        w.done = out
        return w.text.flush()
    return ""


def usage_of(windows: list[Window]) -> TranscriptionUsage:
    prompt = sum(len(w.input_ids) for w in windows)
    generated = sum(w.done.generated_tokens if w.done else len(w.token_ids) for w in windows)
    return TranscriptionUsage(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)
