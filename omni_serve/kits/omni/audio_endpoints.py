"""OpenAI's audio endpoints on the Qwen-Omni graphs: ``/v1/audio/speech`` and ``/v1/audio/transcriptions``.

Contract: ``AudioEndpoints`` is mixed into the Qwen-Omni frontend (``OmniFrontend``, hence Qwen3-Omni's too) and
answers both routes with the frontend's own preprocessing, stage calls and cancellation:
- speech: the prompt is the system turn (``speech.system_prompt``) and a user turn holding the text; the text's
  tokens and the end-of-turn token are the thinker's *forced* reply (``ThinkerCall.forced_reply``): one prefill
  computes every state the talker reads, nothing is sampled, and talker and code2wav stream as for a chat reply.
  The audio is encoded as it arrives (``omni_serve.api.speech_audio``; FLAC alone is sent once complete, its header
  holding the length); the reply is held back until its first bytes exist, so a failure before any audio is an
  ordinary error response.
- transcriptions: the uploaded file is the user turn's audio, followed by ``transcription.instruction`` (plus the
  request's language and prompt); the thinker answers with no talker. ``stream=true`` streams the text deltas.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import numpy as np

from omni_serve.api.audio_protocol import (
    SpeechRequest, SpeechUsage, Transcription, TranscriptionRequest,
    TranscriptionSegment, TranscriptionUsage, TranscriptionVerbose, TranscriptTextDelta, TranscriptTextDone,
)
from omni_serve.api.errors import OpenAIError, bad_request
from omni_serve.api.media import decode_audio_bytes, read_upload
from omni_serve.api.speech_audio import MEDIA_TYPES, SpeechEncoder, writable_formats
from omni_serve.api.speech_stream import resumed, speech_events
from omni_serve.api.video import read_audio_container
from omni_serve.api.sse import sse_error, sse_event
from omni_serve.graph.frontend import ByteStream, EventStream, RawReply, RequestContext
from omni_serve.kits.omni.messages import AudioDelta, TextDelta
from omni_serve.request_ids import new_request_id

log = logging.getLogger(__name__)


def _text_turn(role: str, text: str) -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}]}


class AudioEndpoints:
    """The audio routes of a Qwen-Omni frontend (see the module doc). Uses the frontend's ``spec``, ``inputs``,
    ``sample_rate``, ``stop_token_ids``, ``_check_model``, ``_voice``, ``_preprocessed``, ``_prepared``,
    ``admit_audio`` and ``_events``."""

    # -- /v1/audio/speech ---------------------------------------------------------------------------------
    async def audio_speech(self, req: SpeechRequest, ctx: RequestContext) -> ByteStream | EventStream:
        self._check_model(req.model)
        for field in ("voice_reference", "speaker_voices"):
            if getattr(req, field) is not None:
                raise bad_request(f"{field} is not supported by this model: it speaks with its own voices.",
                                  param=field)
        voice = self._voice(req.voice, "voice")
        if req.response_format not in writable_formats():
            raise bad_request(f"response_format {req.response_format!r} cannot be written by this server's codecs; "
                              f"use one of {', '.join(writable_formats())}.", param="response_format",
                              code="invalid_value")
        rid = new_request_id("speech")
        inputs, forced = await self._preprocessed(rid, self._speech_prompt, req.input)
        p = self._prepared(req, rid, inputs, [], [], max_new=len(forced), seed=req.seed, voice=voice,
                           audio_format=req.response_format, forced_reply=forced, param="input",
                           sampling=dict(temperature=1.0 if req.temperature is None else req.temperature))
        p.clock, p.timeout_s = ctx.clock, ctx.timeout_s
        # every format but FLAC streams as the audio comes (below); a client playing it faster than the talker's
        # codes' rate would outrun the talker's pace, so only speed <= 1 is paced
        p.plays = req.response_format != "flac" and req.speed <= 1
        await self.admit_audio(p, ctx)
        # A FLAC's header holds its length: it is sent whole, once complete (a streamed FLAC, whose header says
        # "unknown length", is valid but many readers, libsndfile among them, refuse it). Every other format streams.
        encoder = SpeechEncoder(req.response_format, self.sample_rate, req.speed,
                                streaming=req.response_format != "flac")
        def failed(err: OpenAIError) -> None:
            p.clock.error = err.type
            log.warning("request %s: speech stream failed: %s", p.request_id, err)

        counts: dict = {}
        chunks = self._speech_bytes(p, encoder, counts)
        if req.stream_format == "sse":
            n = len(forced)
            return EventStream(speech_events(chunks, failed, lambda: SpeechUsage(
                input_tokens=n, output_tokens=counts.get("codes", 0), total_tokens=n + counts.get("codes", 0))))
        first = await anext(chunks, b"")  # errors before the first audio are plain error responses
        return ByteStream(resumed(first, chunks, failed), MEDIA_TYPES[req.response_format])

    def _speech_prompt(self, text: str):
        """(the prompt's inputs, the forced reply: the text's tokens and the end-of-turn token)."""
        system = self.spec.speech.system_prompt or self.spec.system_prompt or self.default_system_prompt
        inputs = self.inputs([_text_turn("system", system), _text_turn("user", text)], [], [], [],
                             use_audio_in_video=False)
        forced = self.inputs.tokenizer.encode(text, add_special_tokens=False) + self.stop_token_ids[:1]
        return inputs, forced

    async def _speech_bytes(self, p, encoder: SpeechEncoder, counts: dict) -> AsyncIterator[bytes]:
        """The encoded file's bytes as the audio arrives (never an empty chunk); ``counts["codes"]``: codec
        tokens spoken so far."""
        counts["codes"] = 0
        async for _, out in self._events(p):
            if isinstance(out, AudioDelta) and out.samples:
                samples = np.frombuffer(out.samples, dtype="<f4")
                p.clock.audio(samples.size / self.sample_rate)
                counts["codes"] += out.num_codes
                data = encoder.feed(samples)
                if data:
                    yield data
        tail = encoder.close()
        if tail:
            yield tail

    # -- /v1/audio/transcriptions -------------------------------------------------------------------------
    async def audio_transcriptions(
            self, req: TranscriptionRequest, ctx: RequestContext,
    ) -> Transcription | TranscriptionVerbose | RawReply | EventStream:
        self._check_model(req.model)
        if req.response_format in ("srt", "vtt"):
            raise bad_request(f"response_format {req.response_format!r} needs timestamps, which this model does not "
                              "produce; use json, text or verbose_json.", param="response_format",
                              code="invalid_value")
        t = self.spec.transcription
        raw = await read_upload(req.file, t.max_file_bytes, "file")
        rid = new_request_id("transcription")
        inputs, audio = await self._preprocessed(rid, self._transcription_prompt, req, raw)
        max_new = min(t.max_tokens, self.max_model_len - int(inputs.input_ids.shape[1]))
        p = self._prepared(req, rid, inputs, [audio], [], max_new=max(max_new, 1), seed=None, param="file",
                           sampling=dict(temperature=req.temperature))
        p.clock, p.timeout_s = ctx.clock, ctx.timeout_s
        if req.stream:
            return EventStream(self._transcript_events(p))
        text, tokens = [], []
        async for _, out in self._events(p):
            if isinstance(out, TextDelta):
                if out.text:
                    p.clock.text()
                text.append(out.text)
                tokens.extend(out.token_ids)
        text = "".join(text)
        usage = TranscriptionUsage(input_tokens=p.prompt_len, output_tokens=len(tokens),
                                   total_tokens=p.prompt_len + len(tokens))
        if req.response_format == "text":
            return RawReply(text, "text/plain; charset=utf-8")
        if req.response_format == "verbose_json":
            duration = round(audio.size / self.inputs.sampling_rate, 3)
            return TranscriptionVerbose(
                language=req.language or "unknown", duration=duration, text=text, usage=usage.model_dump(),
                segments=[TranscriptionSegment(start=0.0, end=duration, text=text, tokens=tokens,
                                               temperature=req.temperature)])
        return Transcription(text=text, usage=usage)

    def _transcription_prompt(self, req: TranscriptionRequest, raw: bytes):
        """(the prompt's inputs, the decoded audio) for an uploaded file."""
        limits = self.spec.limits
        checks = dict(max_seconds=self.spec.max_audio_seconds, param="file",
                      max_sample_rate=limits.max_audio_sample_rate, max_channels=limits.max_audio_channels)
        audio = decode_audio_bytes(  # soundfile (wav, mp3, flac, ogg), else FFmpeg (m4a, mp4, webm, ...)
            raw, "wav, mp3, flac or ogg", target_sr=self.inputs.sampling_rate, **checks,
            other_reader=lambda data: read_audio_container(data, rate=self.inputs.sampling_rate, **checks))
        t = self.spec.transcription
        ask = t.instruction
        if req.language:
            ask += f" The audio is in {req.language}."
        if req.prompt:
            ask += f" Context: {req.prompt}"
        user = {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": ask}]}
        return self.inputs([_text_turn("system", t.system_prompt), user], [audio], [], [],
                           use_audio_in_video=False), audio

    async def _transcript_events(self, p) -> AsyncIterator[str]:
        text, tokens = [], 0
        try:
            async for _, out in self._events(p):
                if isinstance(out, TextDelta):
                    tokens += len(out.token_ids)
                    if out.text:
                        p.clock.text()
                        text.append(out.text)
                        yield sse_event(TranscriptTextDelta(delta=out.text))
        except OpenAIError as err:
            p.clock.error = err.type
            yield sse_error(err)
            return
        yield sse_event(TranscriptTextDone(text="".join(text), usage=TranscriptionUsage(
            input_tokens=p.prompt_len, output_tokens=tokens, total_tokens=p.prompt_len + tokens)))
