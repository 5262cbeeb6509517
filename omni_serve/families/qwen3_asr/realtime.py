"""OpenAI's Realtime API for transcription (``/v1/realtime?intent=transcription``, WebSocket) on the Qwen3-ASR graph:
the client streams audio, each committed turn is transcribed as it would be uploaded.

Contract: ``TranscriptionSession(frontend, websocket, ctx).run()`` serves one connection until the client leaves.
- It opens with ``session.created`` (a ``transcription`` session: ``audio.input`` with pcm16 at 24 kHz, its
  ``transcription`` settings and its ``turn_detection``, ``server_vad`` by default); ``session.update`` changes what
  it names (``type`` must stay ``transcription``; ``audio.input.transcription.language`` must be one the model knows,
  ``prompt`` is the model's context, ``model`` must be the served one or left out) and answers
  ``session.updated``.
- ``input_audio_buffer.append`` / ``commit`` / ``clear`` work as in a conversation session
  (``omni_serve.api.realtime_input``): with ``server_vad`` a turn is committed when Silero hears its speech stop
  (``input_audio_buffer.speech_started`` / ``speech_stopped`` first). A committed turn is announced
  (``input_audio_buffer.committed``, ``conversation.item.added`` and ``conversation.item.done``: a user message with
  one ``input_audio`` part) and transcribed at once, resampled to 16 kHz and windowed as an upload is, through the
  graph's stages: ``conversation.item.input_audio_transcription.delta`` events as its text is written, then
  ``.completed`` (the transcript and its token usage), or ``.failed`` with the error. Turns are transcribed
  concurrently: the events of two turns may interleave, each names its ``item_id``.
- The session keeps no audio once a turn is committed (its memory is the uncommitted buffer, at most
  ``max_audio_seconds``). Conversation events (``conversation.item.*``, ``response.*``) get an ``error`` event: a
  transcription session has no responses. A bad client event gets an ``error`` event naming it; the connection
  stays open. When the client leaves, every running transcription is cancelled (its stage calls with it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_serve.api import realtime_protocol as R
from omni_serve.api.errors import OpenAIError
from omni_serve.api.realtime_connection import RealtimeConnection
from omni_serve.api.realtime_input import InputAudioBuffer, pcm16
from omni_serve.graph.frontend import RequestContext

log = logging.getLogger(__name__)
TRANSCRIPTION_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                        "input_audio_buffer.clear")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Transcription(_Lenient):
    model: str | None = Field(default=None, description="The served model (None: it).")
    language: str | None = Field(default=None, description="The audio's language (a name or ISO-639-1 code).")
    prompt: str | None = Field(default=None, max_length=4096, description="Context for the model (its system turn).")


class TranscriptionInput(_Lenient):
    format: R.AudioFormat = Field(default_factory=R.AudioFormat, description="Input audio format.")
    transcription: Transcription = Field(default_factory=Transcription, description="How turns are transcribed.")
    noise_reduction: None = Field(default=None, description="Not served (only null is accepted).")
    turn_detection: R.ServerVad | None = Field(default_factory=lambda: R.ServerVad(type="server_vad"), description=(
        "server_vad, or null: the client commits the input buffer itself."))


class TranscriptionAudio(_Lenient):
    input: TranscriptionInput = Field(default_factory=TranscriptionInput, description="Input audio settings.")


class TranscriptionSettings(_Lenient):
    type: Literal["transcription"] = Field(default="transcription", description="A transcription session.")
    audio: TranscriptionAudio = Field(default_factory=TranscriptionAudio, description="Input audio.")
    include: list[str] | None = Field(default=None, description="Accepted; no logprobs are included.")

    def updated(self, changes: dict[str, Any]) -> "TranscriptionSettings":
        return TranscriptionSettings.model_validate(R.merge_settings(self.model_dump(), changes))

    def view(self, session_id: str, model: str) -> dict:
        out = self.model_dump(exclude_none=True)
        out.update(id=session_id, object="realtime.session")
        inp = out["audio"]["input"]
        inp["transcription"].setdefault("model", model)
        vad = self.audio.input.turn_detection
        inp["turn_detection"] = (None if vad is None else
                                 vad.model_dump(exclude_none=True, exclude={"create_response", "interrupt_response"}))
        return out


class TranscriptionSession(RealtimeConnection):
    def __init__(self, frontend, websocket, ctx: RequestContext):
        super().__init__(websocket, ctx, "transcription session")
        self.f = frontend
        self.model_name = frontend.spec.model_name
        self.settings = TranscriptionSettings()
        self.input = InputAudioBuffer(frontend.spec.max_audio_seconds * 1000, self._speech_started,
                                      self._speech_stopped)
        self.last_item: str | None = None
        self.tasks: set[asyncio.Task] = set()

    def refusal(self) -> R.RealtimeProblem | None:
        intent = self.ws.query_params.get("intent")
        if intent not in (None, "", "transcription"):
            return R.RealtimeProblem(f"This server serves transcription sessions only (intent {intent!r}).",
                                     param="intent")
        return super().refusal()

    async def opened(self) -> None:
        await self.input.configure(self.settings.audio.input.turn_detection)
        await self.send(R.server_event("session.created", session=self._view()))

    async def closed(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _view(self) -> dict:
        return self.settings.view(self.id, self.f.spec.model_name)

    # -- client events --------------------------------------------------------------------------------------
    async def handle(self, e) -> None:
        if e.type not in TRANSCRIPTION_EVENTS:
            raise R.RealtimeProblem(f"{e.type} is not served in a transcription session (it has no conversation "
                                    f"or responses); it accepts {', '.join(TRANSCRIPTION_EVENTS)}.",
                                    code="invalid_event_type", param="type", event_id=e.event_id)
        if e.type == "session.update":
            await self._update(e)
        elif e.type == "input_audio_buffer.append":
            await self.input.append(pcm16(e.audio, "audio", e.event_id), e.event_id)
        elif e.type == "input_audio_buffer.commit":
            await self._committed(*self.input.commit(e.event_id))
        else:
            self.input.clear()
            await self.send(R.server_event("input_audio_buffer.cleared"))

    async def _update(self, e: R.SessionUpdate) -> None:
        changes = e.session
        if changes.get("type", "transcription") != "transcription":
            raise R.RealtimeProblem("This server serves transcription sessions only.", param="session.type",
                                    event_id=e.event_id)
        try:
            settings = self.settings.updated(changes)
        except ValidationError as exc:
            raise R.problem_of(exc, e.event_id, "session.") from None
        t = settings.audio.input.transcription
        if t.model not in (None, self.f.spec.model_name):
            raise R.RealtimeProblem(f"The model {t.model!r} does not exist; this server serves "
                                    f"{self.f.spec.model_name!r}.", code="model_not_found",
                                    param="session.audio.input.transcription.model", event_id=e.event_id)
        try:
            self.f.prompts.check_language(t.language)
        except ValueError:
            raise R.RealtimeProblem(f"language {t.language!r} is not one this model knows.",
                                    param="session.audio.input.transcription.language", event_id=e.event_id) from None
        before = self.settings.audio.input.turn_detection
        self.settings = settings
        if settings.audio.input.turn_detection != before:
            await self.input.configure(settings.audio.input.turn_detection)
        await self.send(R.server_event("session.updated", session=self._view()))

    # -- turns ----------------------------------------------------------------------------------------------
    async def _speech_started(self, item_id: str, ms: int) -> None:
        await self.send(R.server_event("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=item_id))

    async def _speech_stopped(self, item_id: str, ms: int, audio: bytes) -> None:
        await self.send(R.server_event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id))
        await self._committed(item_id, audio)

    async def _committed(self, item_id: str, audio: bytes) -> None:
        previous, self.last_item = self.last_item, item_id
        item = {"id": item_id, "type": "message", "object": "realtime.item", "status": "completed", "role": "user",
                "content": [{"type": "input_audio", "transcript": None}]}
        await self.send(R.server_event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id))
        await self.send(R.server_event("conversation.item.added", previous_item_id=previous, item=item))
        await self.send(R.server_event("conversation.item.done", previous_item_id=previous, item=item))
        task = asyncio.create_task(self._transcribe(item_id, audio, self.settings.audio.input.transcription))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _transcribe(self, item_id: str, pcm: bytes, t: Transcription) -> None:
        from omni_serve.families.qwen3_asr.frontend import take_output, usage_of
        from omni_serve.families.qwen3_asr.prompting import join, joiner

        try:
            samples = await asyncio.to_thread(_resampled, pcm, self.f.prompts.sampling_rate)
            if samples.size == 0:  # a turn VAD closed as it opened
                windows = []
            else:
                windows = await asyncio.to_thread(self.f.windows_of, samples, t.language, t.prompt, item_id)
            sent, started = "", [False] * len(windows)
            async for i, out in self.f.window_outputs(windows, 0.0, self.ctx.timeout_s):
                delta = take_output(windows[i], out)
                if delta:
                    if not started[i]:
                        started[i] = True
                        delta = joiner(sent, delta) + delta
                    sent += delta
                    await self.send(R.server_event("conversation.item.input_audio_transcription.delta",
                                                   item_id=item_id, content_index=0, delta=delta))
        except OpenAIError as err:
            await self.send(R.server_event("conversation.item.input_audio_transcription.failed", item_id=item_id,
                                           content_index=0, error={"type": err.type, "code": err.code,
                                                                   "message": err.message}))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one turn's failure is reported on it, the session goes on
            log.error("transcription session %s: item %s failed", self.id, item_id, exc_info=exc)
            await self.send(R.server_event("conversation.item.input_audio_transcription.failed", item_id=item_id,
                                           content_index=0, error={"type": "server_error", "code": "internal_error",
                                                                   "message": "Internal server error."}))
            return
        transcript = join([w.text.final()["transcription"] for w in windows])
        usage = usage_of(windows).model_dump()
        await self.send(R.server_event("conversation.item.input_audio_transcription.completed", item_id=item_id,
                                       content_index=0, transcript=transcript, usage=usage))


def _resampled(pcm: bytes, rate: int) -> np.ndarray:
    """pcm16 at 24 kHz -> float32 at ``rate`` (the model's 16 kHz)."""
    from scipy.signal import resample_poly

    x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    g = np.gcd(rate, R.PCM_RATE)
    return resample_poly(x, rate // g, R.PCM_RATE // g).astype(np.float32)
