"""Ingress side of the VibeVoice graph: ``POST /v1/audio/speech`` -> the lm stage -> the audio file, streamed.

Contract: ``VibeVoiceFrontend(spec, stages)`` serves OpenAI's speech route (``omni_serve.api.audio_protocol``):
- ``input`` is the script: plain text (one speaker), or ``Speaker <id>: ...`` lines (up to ``max_speakers``).
- The voice: ``voice`` names a preset (a file of ``voices_dir``, matched case-insensitively; else
  ``default_voice``, else a 400 listing them); the extension ``voice_reference`` (base64 of an audio file, at most
  ``max_voice_bytes`` and ``max_voice_seconds``) clones the speaker of an uploaded clip instead; a multi-speaker
  script names each speaker's preset in ``speaker_voices`` (speaker id -> name). Presets are read once, when the
  frontend starts.
- The prompt (the checkpoint's template, each speaker's voice placeholder expanded to its clip's frames) is built
  here from the processor alone (``omni_serve.models.vibevoice_prompt``); the clips go to the lm stage over the data
  plane (``ingress_lm``). The seed (``seed``, else a random one) seeds the request's noise as
  ``torch.manual_seed(seed)`` before ``generate`` would. Speech lasts at most ``max_speech_seconds``.
- The audio comes back one speech token (3200 samples at 24 kHz) at a time and is encoded as it arrives
  (``omni_serve.api.speech_audio``: ``stream_format`` ``audio`` streams the file's bytes, held back until the first
  exist so that an error before any audio is an ordinary error response; FLAC is sent once complete; ``sse`` sends
  ``speech.audio.delta`` events then ``speech.audio.done`` with the usage: prompt tokens in, speech tokens out).
  ``temperature`` above 0 is refused (the model picks its tokens greedily); ``instructions`` are ignored (no style
  input).
Registered voices (an extension; ``voices.enabled``): ``POST /v1/audio/voices`` (a form: ``name``, ``file``) checks a
reference clip as ``voice_reference`` is checked and keeps it in the voice database (``voices.py``: every ingress
replica sees it, and it outlives them); ``voice`` and ``speaker_voices`` then name it (the caller's registered
voices first, then the presets). ``GET /v1/audio/voices`` lists the presets and the caller's voices, ``DELETE
/v1/audio/voices/{name}`` deletes one of the caller's. A voice belongs to the API key that registered it.
Whatever ends a request, its stage call is cancelled and its payloads freed (``StageCalls.stream``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
import os
import random
from typing import AsyncIterator

import numpy as np

from omni_serve.api.audio_protocol import (
    SpeechRequest, SpeechUsage, Voice, VoiceCreateForm, VoiceDeleted, VoiceList,
    VoicePage, VoiceRef,
)
from omni_serve.api.errors import OpenAIError, bad_request, not_found
from omni_serve.api.guards import owner_of
from omni_serve.api.media import decode_audio_bytes, read_upload
from omni_serve.api.speech_audio import MEDIA_TYPES, SpeechEncoder, writable_formats
from omni_serve.api.speech_stream import resumed, speech_events
from omni_serve.families.vibevoice.messages import SpeakCall, SpeechAudio, SpeechFinished, VoiceClips
from omni_serve.families.vibevoice.spec import VibeVoiceGraphSpec
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.frontend import ByteStream, EventStream, Frontend, RequestContext, Route
from omni_serve.models.vibevoice_prompt import parse_script, prompt_ids, speakers_of, voice_frames
from omni_serve.request_ids import new_request_id

log = logging.getLogger(__name__)
SAMPLE_RATE = 24000
HOP = 3200  # samples per speech token (7.5 a second)
AUDIO_FILES = (".wav", ".flac", ".mp3", ".ogg")


SPEECH = Route("/v1/audio/speech", "speech", "audio_speech", SpeechRequest,
               summary="Speak a script in preset, registered or cloned voices (OpenAI audio.speech.create).")
VOICE_ROUTES = (
    Route("/v1/audio/voices", "voices_create", "voices_create", VoiceCreateForm, form=True,
          summary="Register a reference voice under a name (omni_serve extension)."),
    Route("/v1/audio/voices", "voices_list", "voices_list", VoicePage, method="GET",
          summary="List the preset voices and the caller's registered ones."),
    Route("/v1/audio/voices/{name}", "voices_delete", "voices_delete", VoiceRef, method="DELETE",
          summary="Delete a registered voice."),
)


class VibeVoiceFrontend(Frontend):
    routes = (SPEECH, *VOICE_ROUTES)

    def __init__(self, spec: VibeVoiceGraphSpec, stages: StageCalls):
        from transformers import AutoProcessor

        super().__init__(spec, stages)
        self.processor = AutoProcessor.from_pretrained(spec.checkpoint)
        self.voices_dir = spec.voices_dir or os.path.join(spec.checkpoint, "voices")
        self.presets = self._read_presets()
        if spec.default_voice is not None and spec.default_voice.lower() not in self.presets:
            raise ValueError(f"default_voice {spec.default_voice!r} is not a preset ({self._names()})")
        if not spec.voices.enabled:
            self.routes = (SPEECH,)
        self.store = None  # VoiceStore, opened when the replica starts

    async def start(self) -> None:
        if self.spec.voices.enabled and self.store is None:
            from omni_serve.families.vibevoice.voices import VoiceStore

            self.store = await asyncio.to_thread(VoiceStore, self.spec.voices.resolved_url())

    async def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()

    # -- voices ---------------------------------------------------------------------------------------------------
    def _read_presets(self) -> dict[str, tuple[str, np.ndarray]]:
        """name (lower case) -> (name, its clip at 24 kHz)."""
        out = {}
        if not os.path.isdir(self.voices_dir):
            if self.spec.voices_dir is not None:
                raise ValueError(f"voices_dir {self.voices_dir!r} is not a directory")
            return out
        for entry in sorted(os.listdir(self.voices_dir)):
            name, ext = os.path.splitext(entry)
            if ext.lower() not in AUDIO_FILES:
                continue
            with open(os.path.join(self.voices_dir, entry), "rb") as f:
                out[name.lower()] = (name, self._clip(f.read(), f"preset voice {entry}"))
        return out

    def _names(self) -> str:
        return ", ".join(name for name, _ in self.presets.values()) or "none"

    def _clip(self, raw: bytes, param: str) -> np.ndarray:
        s = self.spec
        if len(raw) > s.max_voice_bytes:
            raise bad_request(f"{param} is larger than {s.max_voice_bytes} bytes.", param=param)
        clip = decode_audio_bytes(raw, "wav, mp3, flac or ogg", target_sr=SAMPLE_RATE, max_seconds=s.max_voice_seconds,
                                  param=param, max_sample_rate=s.limits.max_audio_sample_rate,
                                  max_channels=s.limits.max_audio_channels)
        if not np.abs(clip).max(initial=0.0) > 0:
            raise bad_request(f"{param} holds no sound.", param=param)
        return clip

    def _named(self, name: str | None, param: str, owner: str) -> np.ndarray:
        """The clip of a voice name: the owner's registered voice, else a preset, else ``default_voice``."""
        key = (name or "").lower()
        if self.store is not None:
            clip = self.store.get(owner, key)
            if clip is not None:
                return clip
        found = self.presets.get(key)
        if found is None and self.spec.default_voice is not None and param == "voice":
            found = self.presets[self.spec.default_voice.lower()]
        if found is None:
            raise bad_request(f"Unknown voice {name!r}; preset voices: {self._names()}; register one with POST "
                              "/v1/audio/voices, or clone one with voice_reference.", param=param, code="invalid_value")
        return found[1]

    def _voices(self, req: SpeechRequest, speakers: list[str], owner: str) -> dict[str, np.ndarray]:
        if req.voice_reference is not None:
            if len(speakers) > 1:
                raise bad_request("voice_reference clones one voice; a script with several speakers names each one's "
                                  "preset in speaker_voices.", param="voice_reference")
            try:
                raw = base64.b64decode(req.voice_reference, validate=True)
            except (binascii.Error, ValueError):
                raise bad_request("voice_reference must be base64 of an audio file.",
                                  param="voice_reference") from None
            return {speakers[0]: self._clip(raw, "voice_reference")}
        if req.speaker_voices is not None:
            given = {str(k): v for k, v in req.speaker_voices.items()}
            if set(given) != set(speakers):
                raise bad_request(f"speaker_voices must name the script's speakers {speakers}, got {sorted(given)}.",
                                  param="speaker_voices")
            return {s: self._named(given[s], "speaker_voices", owner) for s in speakers}
        if len(speakers) > 1:
            raise bad_request(f"The script has {len(speakers)} speakers: name each one's voice in speaker_voices.",
                              param="speaker_voices")
        return {speakers[0]: self._named(req.voice, "voice", owner)}

    # -- the route ------------------------------------------------------------------------------------------------
    def _prepared(self, req: SpeechRequest, owner: str) -> tuple[SpeakCall, VoiceClips]:
        """The lm stage's call and the clips; CPU work (decoding, the template)."""
        import torch

        turns = parse_script(req.input)
        speakers = speakers_of(turns)
        if len(speakers) > self.spec.max_speakers:
            raise bad_request(f"The script has {len(speakers)} speakers; at most {self.spec.max_speakers}.",
                              param="input")
        voices = self._voices(req, speakers, owner)
        try:
            ids = prompt_ids(self.processor, turns, {s: voice_frames(c.size, HOP) for s, c in voices.items()})
        except ValueError as exc:
            raise bad_request(f"input: {exc}.", param="input") from None
        call = SpeakCall(request_id=new_request_id("speech"), input_ids=ids, speakers=speakers,
                         seed=req.seed if req.seed is not None else random.randrange(2**31),
                         max_new_tokens=math.ceil(self.spec.max_speech_seconds * SAMPLE_RATE / HOP))
        return call, VoiceClips(clips=[torch.from_numpy(voices[s]) for s in speakers])

    async def audio_speech(self, req: SpeechRequest, ctx: RequestContext) -> ByteStream | EventStream:
        if req.model != self.spec.model_name:
            raise bad_request(f"The model {req.model!r} does not exist; this server serves {self.spec.model_name!r}.",
                              param="model", code="model_not_found")
        if req.response_format not in writable_formats():
            raise bad_request(f"response_format {req.response_format!r} cannot be written by this server's codecs; "
                              f"use one of {', '.join(writable_formats())}.", param="response_format",
                              code="invalid_value")
        if req.temperature:  # 0 asks for what the model does anyway
            raise bad_request("temperature is not supported by this model: it picks its tokens greedily (seed "
                              "varies the speech).", param="temperature")
        call, clips = await asyncio.to_thread(self._prepared, req, owner_of(ctx.headers))
        encoder = SpeechEncoder(req.response_format, SAMPLE_RATE, req.speed, streaming=req.response_format != "flac")
        counts: dict = {}
        chunks = self._speech_bytes(call, clips, encoder, ctx, counts)
        def failed(err: OpenAIError) -> None:
            ctx.clock.error = err.type
            log.warning("request %s: speech stream failed: %s", call.request_id, err)

        if req.stream_format == "sse":
            n = len(call.input_ids)
            return EventStream(speech_events(chunks, failed, lambda: SpeechUsage(
                input_tokens=n, output_tokens=counts["speech"], total_tokens=n + counts["speech"])))
        first = await anext(chunks, b"")  # errors before the first audio are plain error responses
        return ByteStream(resumed(first, chunks, failed), MEDIA_TYPES[req.response_format])

    # -- registered voices ------------------------------------------------------------------------------------------
    async def voices_create(self, form: VoiceCreateForm, ctx: RequestContext) -> Voice:
        from omni_serve.families.vibevoice.voices import TooManyVoices, VoiceExists

        name = form.name.lower()
        if name in self.presets:
            raise bad_request(f"{form.name!r} is a preset voice; choose another name.", param="name")
        raw = await read_upload(form.file, self.spec.max_voice_bytes, "file")
        clip = await asyncio.to_thread(self._clip, raw, "file")
        try:
            info = await asyncio.to_thread(self.store.add, owner_of(ctx.headers), name, clip,
                                           self.spec.voices.max_voices_per_key)
        except VoiceExists:
            raise bad_request(f"A voice named {form.name!r} exists; delete it first.", param="name",
                              code="voice_exists") from None
        except TooManyVoices:
            raise bad_request(f"At most {self.spec.voices.max_voices_per_key} voices per key; delete one first.",
                              param="name", code="too_many_voices") from None
        return Voice(id=info.name, created_at=info.created_at, seconds=round(info.seconds, 3), preset=False)

    async def voices_list(self, _: VoicePage, ctx: RequestContext) -> VoiceList:
        mine = await asyncio.to_thread(self.store.list, owner_of(ctx.headers))
        presets = [Voice(id=name, seconds=round(clip.size / SAMPLE_RATE, 3), preset=True)
                   for name, clip in self.presets.values()]
        return VoiceList(data=presets + [Voice(id=v.name, created_at=v.created_at, seconds=round(v.seconds, 3),
                                               preset=False) for v in mine])

    async def voices_delete(self, ref: VoiceRef, ctx: RequestContext) -> VoiceDeleted:
        name = ref.name.lower()
        if name in self.presets:
            raise bad_request(f"{ref.name!r} is a preset voice: it cannot be deleted.", param="name")
        if not await asyncio.to_thread(self.store.delete, owner_of(ctx.headers), name):
            raise not_found(f"No voice named {ref.name!r}.")
        return VoiceDeleted(id=name)

    # -- streaming ------------------------------------------------------------------------------------------------
    async def _speech_bytes(self, call: SpeakCall, clips: VoiceClips, encoder: SpeechEncoder, ctx: RequestContext,
                            counts: dict) -> AsyncIterator[bytes]:
        """The encoded file's bytes as the speech arrives (never an empty chunk); ``counts["speech"]``: speech
        tokens so far."""
        counts["speech"] = 0
        async for _, out in self.stages.stream(call.request_id, {"lm": call}, ctx.timeout_s,
                                               inputs={"ingress_lm": clips}):
            if isinstance(out, SpeechAudio):
                samples = np.frombuffer(out.samples, dtype="<f4")
                ctx.clock.audio(samples.size / SAMPLE_RATE)
                counts["speech"] += 1
                data = encoder.feed(samples)
                if data:
                    yield data
            elif isinstance(out, SpeechFinished):
                counts["finished"] = out
        tail = encoder.close()
        if tail:
            yield tail
