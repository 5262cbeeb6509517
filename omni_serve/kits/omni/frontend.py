"""Ingress side of the Omni graphs: OpenAI chat request -> stage calls -> OpenAI response.

Contract: ``OmniFrontend(spec, stages)`` (subclassed by each Omni family for its checkpoint and talker) serves ``POST /v1/chat/completions`` (``chat_completions``):
``prepare(request)`` validates and preprocesses (400s are raised here, before any stage is called) and returns a
``Prepared`` request; then ``complete(p)`` returns a ``ChatCompletionResponse``, or ``stream(p)`` yields SSE lines
(an ``EventStream``). Per request the frontend opens one streaming call per stage it needs (encoder if media, the
thinker stages of the spec's layout — ``thinker``, or ``thinker_prefill`` and ``thinker_decode`` with the same
call — and talker + code2wav for audio) at once: stages find their inputs on the data plane by key, so the talker
starts on the thinker's first chunk. The text is the ``TextDelta``s of ``spec.text_stage()``. Whatever ends the request
(completion, error, client gone), ``StageCalls.stream`` cancels every open stage call and frees the request's
data-plane payloads.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np

from omni_serve.api import protocol as P
from omni_serve.api.audio_protocol import SpeechRequest, TranscriptionRequest
from omni_serve.api.completions_protocol import CompletionRequest
from omni_serve.api.errors import OpenAIError, bad_request
from omni_serve.api.limits import check_request_size
from omni_serve.api.logprobs import LogprobWriter
from omni_serve.api.media import decode_image_bytes, decode_input_audio, encode_audio, image_url_bytes, probe_image
from omni_serve.api.video import decode_videos, video_url_bytes
from omni_serve.api.sse import SSE_DONE, sse_event, sse_failure
from omni_serve.api.tools import DeltaFunctionCall, DeltaToolCall, ToolCallStream, parse_tool_calls
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.frontend import EventStream, Frontend, RequestContext, Route
from omni_serve.graph.messages import Message
from omni_serve.kits.omni.audio_endpoints import AudioEndpoints
from omni_serve.kits.omni.completions import CompletionEndpoints
from omni_serve.kits.omni.realtime import RealtimeEndpoints
from omni_serve.kits.omni.tool_use import ToolPlan, history_calls, tool_plan
from omni_serve.kits.omni.messages import (
    AudioDelta, Code2WavCall, EncoderCall, MediaInputs, MediaLayout, RawMedia, SamplingSettings, TalkerPrompt,
    TextDelta, ThinkerCall,
)
from omni_serve.kits.omni.vllm_omni_stream import FORMATS as STREAM_FORMATS
from omni_serve.kits.omni.vllm_omni_stream import HEADER as STREAM_FORMAT_HEADER
from omni_serve.kits.omni.vllm_omni_stream import vllm_omni_chunks
from omni_serve.metrics import RequestClock
from omni_serve.models.qwen2_5_omni_layout import SAMPLE_RATE
from omni_serve.realtime_admission import RealtimeAdmission
from omni_serve.request_ids import new_request_id

AUDIO_TTL_S = 3600
MAX_ASPECT_RATIO = 200  # the Qwen2-VL image processor's limit (it raises beyond it)
log = logging.getLogger(__name__)


@dataclass
class Prepared:
    request: Any  # the route's request model (a chat completion, a speech or transcription request)
    request_id: str
    prompt_len: int
    thinker: ThinkerCall
    media: MediaInputs | RawMedia | None  # the encoder's inputs; the decoded media when vLLM runs the thinker
    voice: str | None  # set when speech is requested
    audio_format: str | None
    seed: int
    return_token_ids: bool = False  # the talker also returns its codec ids
    tool_calls: bool = False  # the reply's tool calls are parsed out of its text (a chat request with tools)
    plays: bool = False  # its client plays the audio as it arrives (streamed): the talker paces it (talker_lead_s)
    created: int = field(default_factory=lambda: int(time.time()))
    clock: RequestClock = field(default_factory=RequestClock)  # the ingress sets its own (from arrival)
    timeout_s: float | None = None  # the request's deadline (the ingress sets it; None: the spec's)


class OmniFrontend(RealtimeEndpoints, AudioEndpoints, CompletionEndpoints, Frontend):
    """The Omni chat frontend; a family subclasses it through ``_load_checkpoint``, ``_talker_prompt``,
    ``_talker_call``, ``_codec_ids`` and ``default_system_prompt``. The audio routes are ``AudioEndpoints``', text
    completions ``CompletionEndpoints``'.
    ``spec`` is the family's graph spec (``omni_serve.kits.omni.spec``'s sections mixed in)."""

    routes = (Route("/v1/chat/completions", "chat", "chat_completions", P.ChatCompletionRequest,
                    summary="Chat completion with text and speech output (OpenAI chat.completions)."),
              Route("/v1/completions", "completions", "completions", CompletionRequest,
                    summary="Text completion of a raw prompt on the thinker (OpenAI's legacy completions)."),
              Route("/v1/audio/speech", "speech", "audio_speech", SpeechRequest,
                    summary="Speak a text with one of the model's voices (OpenAI audio.speech)."),
              Route("/v1/audio/transcriptions", "transcriptions", "audio_transcriptions", TranscriptionRequest,
                    form=True, summary="Transcribe an audio file (OpenAI audio.transcriptions)."))
    default_system_prompt: str  # the system prompt the model needs to answer with speech
    sample_rate = SAMPLE_RATE

    def __init__(self, spec, stages: StageCalls):
        super().__init__(spec, stages)
        self._load_checkpoint(spec.checkpoint)
        if {v.lower() for v in self.voices}.isdisjoint({spec.default_voice.lower()}):
            raise ValueError(f"default_voice {spec.default_voice!r} not in the checkpoint's voices {sorted(self.voices)}")
        tparams = spec.thinker_params()
        self.max_model_len = tparams.max_model_len or self.thinker_cfg.text_config.max_position_embeddings
        self.raw_media = spec.thinker_backend() == "vllm"  # vLLM preprocesses and encodes media itself
        # Tokens one request may hold in a native thinker's paged KV cache (vLLM checks its own at start-up).
        self.kv_capacity = None if self.raw_media else min(
            spec.stage_spec(s).engine.ar.num_kv_blocks * spec.stage_spec(s).engine.ar.block_size
            for s in spec.thinker_stages())
        self.realtime = RealtimeAdmission(spec.playback.admission, spec.playback.client_buffer_s,
                                          spec.playback.target_ttfp_s)
        eos = self.inputs.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_token_ids = [eos]
        self.logprob_writer = LogprobWriter(self.inputs.tokenizer)
        self.renders_tools = self.inputs.renders_tools  # whether the checkpoint's chat template shows tools
        self._grammars = None  # GrammarCompiler (engines.constraints), made on the first JSON response_format
        self._grammars_lock = threading.Lock()

    async def admit_audio(self, p: "Prepared", ctx: RequestContext) -> None:
        """Hold a request that asked for audio until the graph's real-time capacity takes it (or raise its 429),
        before any stage is called; its place is given back when the request ends."""
        if p.voice is not None:
            await self.admit_stream(p.request_id, ctx, p.clock)

    async def admit_stream(self, request_id: str, ctx: RequestContext, clock, max_wait_s: float | None = None,
                           since: float | None = None):
        """``admit_audio`` for a stream known to speak before its request is prepared (a realtime answer: a refused
        one is not prepared for nothing); ``clock`` (its ``RequestClock``) reports its chunks to admission;
        ``max_wait_s`` and ``since`` as ``RealtimeAdmission.enter`` takes them. Returns the ``StreamTicket``
        (released when the request ends, or before by the caller)."""
        ticket = await self.realtime.enter(request_id, max_wait_s, since)
        ctx.on_end.append(ticket.release)
        clock.on_audio = ticket.audio
        return ticket

    def _load_checkpoint(self, checkpoint: str) -> None:
        """Set ``inputs`` (the input processor), ``thinker_cfg`` and ``voices`` (name -> what the talker needs)."""
        raise NotImplementedError

    def _talker_prompt(self, voice: str) -> TalkerPrompt:
        """The thinker token ids the talker's prompt is built from."""
        raise NotImplementedError

    def _talker_call(self, p: "Prepared") -> Message:
        """The talker stage's call for a request that asked for speech."""
        raise NotImplementedError

    @staticmethod
    def _codec_ids(out: Message) -> list[int] | None:
        """The codec ids a talker output carries (``return_token_ids``), or None if it is not one."""
        raise NotImplementedError

    async def chat_completions(self, body: P.ChatCompletionRequest,
                               ctx: RequestContext) -> P.ChatCompletionResponse | EventStream:
        shape = ctx.headers.get(STREAM_FORMAT_HEADER, self.spec.chat_stream_format)
        if shape not in STREAM_FORMATS:
            raise bad_request(f"{STREAM_FORMAT_HEADER}: {shape!r} is not a stream format; use one of "
                              f"{', '.join(STREAM_FORMATS)}.", param=STREAM_FORMAT_HEADER)
        if body.stream and shape == "vllm_omni" and body.logprobs:
            raise bad_request("logprobs are streamed in OpenAI's stream shape only, not vLLM-Omni's.",
                              param="logprobs")
        if body.stream and shape == "vllm_omni" and body.tool_mode() is not None:
            raise bad_request("Tool calls are streamed in OpenAI's stream shape only, not vLLM-Omni's.",
                              param="tools")
        if shape == "vllm_omni" and not body.transcript_in_content:  # vLLM-Omni's reply: text in content
            body = body.model_copy(update={"transcript_in_content": True})
        p = await self.prepare(body)
        p.clock, p.timeout_s, p.plays = ctx.clock, ctx.timeout_s, bool(body.stream)
        await self.admit_audio(p, ctx)
        if body.stream and shape == "vllm_omni":
            return EventStream(vllm_omni_chunks(p, self._events(p), self.spec.model_name, self.sample_rate))
        if body.stream:
            return EventStream(self.stream(p))
        return await self.complete(p)

    # -- validation and preprocessing ---------------------------------------------------------------------
    async def prepare(self, req: P.ChatCompletionRequest) -> Prepared:
        self._check_model(req.model)
        voice = None
        if req.wants_audio():  # without audio options: the graph's default voice, as a WAV
            asked = req.audio.voice if req.audio else None
            voice = self._voice(asked or self.spec.default_voice, "audio.voice")
        check_request_size(req.messages, self.spec.limits)
        rid = new_request_id("chatcmpl")
        plan = tool_plan(req, self.renders_tools)
        schema = await asyncio.to_thread(self._checked_schema, req)  # compiling a grammar is CPU work
        if plan is not None and plan.grammar is not None:
            await asyncio.to_thread(self._check_grammar, plan.grammar, "tool_choice",
                                    "The tools' parameters cannot be used to constrain the call")
        inputs, audios, images = await self._preprocessed(rid, self._preprocess, req, plan)
        temperature = req.temperature if req.temperature is not None else \
            self.spec.thinker_params().default_temperature
        return self._prepared(
            req, rid, inputs, audios, images, max_new=req.max_new_tokens(self.spec.thinker_params().default_max_tokens),
            sampling=dict(temperature=temperature, top_p=req.top_p or 1.0, min_new_tokens=req.min_tokens,
                          presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                          logprobs=req.logprobs_wanted(), json_schema=schema,
                          grammar=plan.grammar if plan is not None else None,
                          logit_bias=self._checked_logit_bias(req.logit_bias)),
            seed=req.seed, stop=P.stop_sequences(req.stop) + list(plan.stop if plan is not None else ()),
            voice=voice, audio_format=(req.audio.format if req.audio else "wav") if voice else None,
            return_token_ids=req.return_token_ids, tool_calls=plan is not None)

    def _checked_logit_bias(self, logit_bias: dict[str, float] | None) -> list[tuple[int, float]]:
        """``logit_bias`` as (token id, bias) pairs by id; a 400 for an id outside the thinker's vocabulary."""
        bias = P.logit_bias_ids(logit_bias)
        self._check_in_vocabulary(bias, "logit_bias", "logit_bias")
        return sorted(bias.items())

    def _check_in_vocabulary(self, token_ids, param: str, where: str) -> None:
        """A 400 naming ``param`` when a token id is outside the thinker's vocabulary."""
        vocab = self.thinker_cfg.text_config.vocab_size
        outside = next((t for t in token_ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise bad_request(f"{where}: token id {outside} is outside the vocabulary (0-{vocab - 1}).",
                              param=param, code="invalid_value")

    def _checked_schema(self, req: P.ChatCompletionRequest) -> str | None:
        """The JSON schema the reply is constrained to (``response_format``), checked by the grammar engine the
        thinkers use: a schema it cannot use is a 400 here, before any stage is called."""
        schema = req.response_format.schema_text() if req.response_format is not None else None
        if schema is None:
            return None
        param = "response_format.json_schema.schema" if req.response_format.type == "json_schema" else "response_format"
        if req.min_tokens:
            raise bad_request("min_tokens cannot be combined with a JSON response_format (the grammar may end the "
                              "reply first).", param="min_tokens")
        from omni_serve.engines.constraints import GrammarCompiler, GrammarError

        try:
            grammar = GrammarCompiler.json_grammar(schema)
        except GrammarError as exc:
            raise bad_request(f"The JSON schema cannot be used to constrain the reply: {exc}", param=param,
                              code="invalid_value") from None
        self._check_grammar(grammar, param, "The JSON schema cannot be used to constrain the reply")
        return schema

    def _check_grammar(self, grammar: str, param: str, what: str) -> None:
        """A 400 naming ``param`` (``what``: the problem's lead) when the thinkers' grammar engine cannot constrain a
        reply with ``grammar``; runs in worker threads (compiling is CPU work)."""
        from omni_serve.engines.constraints import GrammarCompiler, GrammarError

        with self._grammars_lock:  # called in worker threads (prepare), maybe several at once
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.inputs.tokenizer, self.thinker_cfg.text_config.vocab_size,
                                                 self.stop_token_ids[0])
        try:
            problem = self._grammars.check(grammar)
        except GrammarError as exc:
            problem = str(exc)
        if problem:
            raise bad_request(f"{what}: {problem}", param=param, code="invalid_value")

    def _check_model(self, model: str) -> None:
        if model != self.spec.model_name:
            raise bad_request(f"The model {model!r} does not exist; this server serves {self.spec.model_name!r}.",
                              param="model", code="model_not_found")

    def _voice(self, asked: str, param: str) -> str:
        """The checkpoint's spelling of voice ``asked`` (matched case-insensitively), or a 400 listing them."""
        voice = {v.lower(): v for v in self.voices}.get(asked.lower())
        if voice is None:
            raise bad_request(f"Unknown voice {asked!r}; available voices: {', '.join(sorted(self.voices))}.",
                              param=param, code="invalid_value")
        return voice

    async def _preprocessed(self, rid: str, preprocess, *args):
        """``preprocess(*args)`` in a thread (decoding, preprocessing and tokenizing are CPU work); a processor
        failure on media that passed our checks is a 400 pointing at the server log."""
        try:
            return await asyncio.to_thread(preprocess, *args)
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - the processor failed on media we decoded and checked
            log.warning("request %s: preprocessing failed", rid, exc_info=exc)
            raise bad_request(f"Could not process the request's media (request {rid}); the details are in the "
                              "server log.", param="messages") from None

    def _prepared(self, request, rid: str, inputs, audios, images, *, max_new: int, sampling: dict, seed: int | None,
                  stop: list[str] = (), voice: str | None = None, audio_format: str | None = None,
                  forced_reply: list[int] | None = None, return_token_ids: bool = False,
                  param: str = "messages", tool_calls: bool = False) -> Prepared:
        """The thinker call (and what the other stages need) for preprocessed ``inputs``; a 400 when the prompt
        and ``max_new`` tokens exceed the context."""
        prompt_len = int(inputs.input_ids.shape[1])
        if prompt_len + max_new > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} in the completion).",
                param=param, code="context_length_exceeded")
        if self.kv_capacity is not None and prompt_len + max_new > self.kv_capacity:
            raise bad_request(
                f"This server's KV cache holds {self.kv_capacity} tokens per request (the thinker's "
                f"engine.ar.num_kv_blocks x block_size). However, you requested {prompt_len + max_new} tokens "
                f"({prompt_len} in the prompt, {max_new} in the completion).", param=param,
                code="context_length_exceeded")
        seed = seed if seed is not None else random.randrange(2**31)
        media = raw_media(audios, images) if self.raw_media and (audios or images) else MediaInputs.of(inputs)
        thinker = ThinkerCall(
            request_id=rid, input_ids=inputs.input_ids[0].tolist(), max_new_tokens=max_new,
            sampling=SamplingSettings(seed=seed, **sampling), stop_token_ids=self.stop_token_ids, stop=list(stop),
            media_layout=MediaLayout.of(inputs), expects_media=media is not None,
            talker=None if voice is None else self._talker_prompt(voice), forced_reply=forced_reply)
        return Prepared(request, rid, prompt_len, thinker, media, voice, audio_format, seed,
                        return_token_ids=return_token_ids, tool_calls=tool_calls)

    def _preprocess(self, req: P.ChatCompletionRequest, plan: ToolPlan | None = None):
        """(model inputs, decoded audio clips, decoded images). The inputs' expanded prompt ids are what either
        thinker backend computes on (vLLM expands the same placeholders itself: the vLLM runner checks it)."""
        converted, audios, encoded, encoded_videos = self._convert_messages(req.messages)
        if encoded_videos and self.raw_media:
            raise bad_request("Video input is not supported with the vLLM thinker backend yet; use the native "
                              "backend (stages.thinker.engine.backend: native).", param=encoded_videos[0][1])
        images = [self._checked_image(raw, param) for raw, param in encoded]
        asked = req.mm_processor_kwargs.use_audio_in_video if req.mm_processor_kwargs is not None else None
        hear = self.spec.video.use_audio_in_video if asked is None else asked
        videos = decode_videos(encoded_videos, limits=self.spec.video, sample=self.inputs.sample_frames,
                               audio_rate=self.inputs.sampling_rate if hear else None) if encoded_videos else []
        silent = [param for (_, param), video in zip(encoded_videos, videos) if hear and video.audio is None]
        if silent and asked:
            raise bad_request(f"{silent[0]}: the video has no audio track, but mm_processor_kwargs.use_audio_in_video "
                              "asks to hear it.", param=silent[0])
        hear = hear and bool(videos) and not silent  # one setting for the whole prompt (the M-RoPE index's)
        return self.inputs(converted, audios, images, videos, use_audio_in_video=hear,
                           tools=plan.tools if plan is not None else None), audios, images

    def _checked_image(self, raw: bytes, param: str):
        image = decode_image_bytes(raw, max_pixels=self.spec.max_image_pixels, param=param,
                                   formats=self.spec.limits.image_formats)
        if max(image.size) / min(image.size) > MAX_ASPECT_RATIO:
            raise bad_request(f"{param}: image is {image.width}x{image.height}; its aspect ratio must be at most "
                              f"{MAX_ASPECT_RATIO}.", param=param)
        return image

    def _convert_messages(self, messages: list[P.ChatMessage]):
        """(chat-template messages, decoded audio clips, images and videos as (encoded bytes, param)); the images'
        pixels are counted from their headers, all together, before any is decoded."""
        out, audios, images, videos = [], [], [], []
        limits, pixels = self.spec.limits, 0
        if not any(m.role in ("system", "developer") for m in messages):
            out.append({"role": "system", "content": [{"type": "text",
                                                        "text": self.spec.system_prompt or self.default_system_prompt}]})
        for i, msg in enumerate(messages):
            role = "system" if msg.role == "developer" else msg.role
            content = msg.content
            calls = {"tool_calls": history_calls(msg, i)} if msg.tool_calls else {}
            if content is None or (calls and not content):  # an empty text before calls is no text
                content = []
            if isinstance(content, str):
                out.append({"role": role, "content": [{"type": "text", "text": content}], **calls})
                continue
            parts = []
            for j, part in enumerate(content):
                param = f"messages[{i}].content[{j}]"
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                elif part.type == "input_audio":
                    audios.append(decode_input_audio(
                        part.input_audio.data, part.input_audio.format, target_sr=self.inputs.sampling_rate,
                        max_seconds=self.spec.max_audio_seconds, param=f"{param}.input_audio.data",
                        max_sample_rate=limits.max_audio_sample_rate, max_channels=limits.max_audio_channels))
                    parts.append({"type": "audio"})
                elif part.type == "image_url":
                    param = f"{param}.image_url.url"
                    raw = image_url_bytes(part.image_url.url, max_bytes=self.spec.ingress.max_body_bytes, param=param)
                    width, height = probe_image(raw, max_pixels=self.spec.max_image_pixels, param=param,
                                                formats=limits.image_formats)
                    pixels += width * height
                    if pixels > limits.max_total_image_pixels:
                        raise bad_request(f"The request's images have more than {limits.max_total_image_pixels} "
                                          "pixels in all.", param=param)
                    images.append((raw, param))
                    parts.append({"type": "image"})
                elif part.type == "video_url":
                    param = f"{param}.video_url.url"
                    videos.append((video_url_bytes(part.video_url.url, max_bytes=self.spec.ingress.max_body_bytes,
                                                   param=param), param))
                    parts.append({"type": "video"})
            if role != "user" and (len(parts) != sum(p["type"] == "text" for p in parts)):
                raise bad_request(f"Only user messages may contain audio, images or video (message {i} is "
                                  f"{msg.role}).", param=f"messages[{i}].content")
            out.append({"role": role, "content": parts, **calls})
        return out, audios, images, videos

    # -- running ------------------------------------------------------------------------------------------
    def _stage_calls(self, p: Prepared) -> dict[str, Message]:
        calls: dict[str, Message] = {}
        if isinstance(p.media, MediaInputs):
            calls["encoder"] = EncoderCall(request_id=p.request_id)
        for stage in self.spec.thinker_stages():
            calls[stage] = p.thinker
        if p.voice is not None:
            calls["talker"] = self._talker_call(p)
            calls["code2wav"] = Code2WavCall(request_id=p.request_id, voice=p.voice, seed=p.seed)
        return calls

    async def _events(self, p: Prepared) -> AsyncIterator[tuple[str, Message]]:
        """Merged (stage, output) events of every stage call of the request, as they arrive."""
        edge = "ingress_thinker" if isinstance(p.media, RawMedia) else "ingress_encoder"
        inputs = {edge: p.media} if p.media is not None else None
        async for event in self.stages.stream(p.request_id, self._stage_calls(p),
                                              p.timeout_s or self.spec.ingress.request_timeout_s, inputs=inputs):
            yield event

    async def complete(self, p: Prepared) -> P.ChatCompletionResponse:
        text, tokens, codes, pcm, finish, logprobs = [], [], [], [], None, []
        async for stage, out in self._events(p):
            if isinstance(out, TextDelta):
                if out.text:
                    p.clock.text()
                text.append(out.text)
                tokens.extend(out.token_ids)
                finish = out.finish_reason or finish
                logprobs.extend(self._logprobs(out))
            elif self._codec_ids(out) is not None:
                codes.extend(self._codec_ids(out))
            elif isinstance(out, AudioDelta):
                chunk = _pcm16(out)
                p.clock.audio(_pcm_seconds(chunk))
                pcm.append(chunk)
        transcript = "".join(text)
        calls = None
        if p.tool_calls:  # the calls are parsed out of the text (vLLM's rule: any call makes it a tool_calls reply)
            transcript, calls = parse_tool_calls(transcript)
            finish = "tool_calls" if calls else finish
        audio = None
        if p.voice is not None:
            samples = np.frombuffer(b"".join(pcm), dtype="<i2").astype(np.float32) / 32767.0
            data = encode_audio(samples, self.sample_rate, p.audio_format)
            audio = P.ChatCompletionAudio(id=f"audio_{p.request_id}", data=base64.b64encode(data).decode(),
                                          transcript=transcript, expires_at=int(time.time()) + AUDIO_TTL_S)
        want_ids = p.request.return_token_ids
        # OpenAI's shape: with audio, the text is the audio's transcript and content is null
        content = transcript if audio is None or p.request.transcript_in_content else None
        choice = P.ChatCompletionChoice(
            message=P.ChatCompletionMessage(content=content, audio=audio, tool_calls=calls or None),
            finish_reason=finish,
            logprobs=P.ChoiceLogprobs(content=logprobs) if p.request.logprobs else None,
            token_ids=tokens if want_ids else None, codec_ids=codes if want_ids and p.voice else None)
        usage = P.UsageInfo(prompt_tokens=p.prompt_len, completion_tokens=len(tokens),
                            total_tokens=p.prompt_len + len(tokens))
        return P.ChatCompletionResponse(id=p.request_id, created=p.created, model=self.spec.model_name,
                                        choices=[choice], usage=usage)

    async def stream(self, p: Prepared) -> AsyncIterator[str]:
        held: list[P.ChatCompletionTokenLogprob] = []  # logprobs of tokens whose text has not been sent yet

        def chunk(delta: P.ChatCompletionDelta, finish=None, text: bool = False) -> P.ChatCompletionChunk:
            logprobs = None
            if (text or finish) and held:  # a token's logprob goes out with its text (or with the last chunk)
                logprobs = P.ChoiceLogprobs(content=list(held))
                held.clear()
            return P.ChatCompletionChunk(id=p.request_id, created=p.created, model=self.spec.model_name,
                                         choices=[P.ChatCompletionChunkChoice(delta=delta, finish_reason=finish,
                                                                              logprobs=logprobs)])

        # OpenAI's stream: with audio, each piece of text comes once, as delta.audio.transcript, and content is
        # null; transcript_in_content moves the pieces to delta.content (never both).
        transcript_deltas = p.voice is not None and not p.request.transcript_in_content
        audio_id = f"audio_{p.request_id}"
        if transcript_deltas:
            yield sse_event(_with_null_content(chunk(P.ChatCompletionDelta(role="assistant"))))
        else:
            yield sse_event(chunk(P.ChatCompletionDelta(role="assistant", content="")))
        tokens, finish = 0, None
        calls = ToolCallStream() if p.tool_calls else None
        try:
            async for stage, out in self._events(p):
                if isinstance(out, TextDelta):
                    tokens += len(out.token_ids)
                    finish = out.finish_reason or finish
                    held.extend(self._logprobs(out))
                    if out.text and calls is not None:  # text that may open a call is held until it is known
                        p.clock.text()
                        for piece in calls.feed(out.text):
                            yield sse_event(chunk(_tool_delta(piece, calls), text=True))
                    elif out.text:
                        p.clock.text()
                        yield sse_event(chunk(
                            P.ChatCompletionDelta(audio=P.DeltaAudio(id=audio_id, transcript=out.text))
                            if transcript_deltas else P.ChatCompletionDelta(content=out.text), text=True))
                elif isinstance(out, AudioDelta) and out.samples:
                    pcm = _pcm16(out)
                    p.clock.audio(_pcm_seconds(pcm))
                    # Streamed audio is always raw pcm16 (24 kHz mono), as OpenAI streams it.
                    yield sse_event(chunk(P.ChatCompletionDelta(audio=P.DeltaAudio(
                        id=audio_id, data=base64.b64encode(pcm).decode(), expires_at=int(time.time()) + AUDIO_TTL_S))))
        except Exception as exc:  # noqa: BLE001 - the response has started (see sse_failure)
            yield sse_failure(exc, p.request_id, p.clock, log)
            yield SSE_DONE
            return
        if calls is not None:
            for piece in calls.finish():
                yield sse_event(chunk(_tool_delta(piece, calls), text=True))
            finish = "tool_calls" if calls.calls else finish
        yield sse_event(chunk(P.ChatCompletionDelta(), finish=finish or "stop"))
        opts = p.request.stream_options
        if opts is not None and opts.include_usage:
            yield sse_event(P.ChatCompletionChunk(
                id=p.request_id, created=p.created, model=self.spec.model_name, choices=[],
                usage=P.UsageInfo(prompt_tokens=p.prompt_len, completion_tokens=tokens,
                                  total_tokens=p.prompt_len + tokens)))
        yield SSE_DONE

    def _logprobs(self, out: TextDelta) -> list[P.ChatCompletionTokenLogprob]:
        """OpenAI's logprob entries of a text delta's tokens (none when the request asked for none)."""
        if out.logprobs is None:
            return []
        return self.logprob_writer.entries(out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs])


def raw_media(audios: list[np.ndarray], images: list) -> RawMedia:
    """Decoded clips (16 kHz float32) and images (as RGB pixels), each list concatenated, in prompt order."""
    import torch

    media = RawMedia()
    if audios:
        media.audio = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.float32) for a in audios]))
        media.audio_lengths = [len(a) for a in audios]
    if images:
        pixels = [np.asarray(im.convert("RGB"), dtype=np.uint8) for im in images]
        media.images = torch.from_numpy(np.concatenate([p.reshape(-1) for p in pixels]))
        media.image_sizes = [[p.shape[0], p.shape[1]] for p in pixels]
    return media


def _tool_delta(piece, calls: ToolCallStream) -> P.ChatCompletionDelta:
    """A delta with a piece of a tools reply: its text, or one whole call (its index: its place among the calls)."""
    if isinstance(piece, str):
        return P.ChatCompletionDelta(content=piece)
    index = next(i for i, c in enumerate(calls.calls) if c is piece)
    return P.ChatCompletionDelta(tool_calls=[DeltaToolCall(
        index=index, id=piece.id, type="function",
        function=DeltaFunctionCall(name=piece.function.name, arguments=piece.function.arguments))])


def _with_null_content(chunk: P.ChatCompletionChunk) -> dict:
    """The chunk as JSON with its delta's ``content`` an explicit null (OpenAI's first chunk of an audio reply)."""
    body = chunk.model_dump(exclude_none=True)
    body["choices"][0]["delta"]["content"] = None
    return body


def _pcm16(delta: AudioDelta) -> bytes:
    """The chunk's samples as little-endian int16 (clipped to [-1, 1], scaled by 32767)."""
    return (np.clip(np.frombuffer(delta.samples, dtype="<f4"), -1, 1) * 32767).astype("<i2").tobytes()


def _pcm_seconds(pcm16: bytes) -> float:
    return len(pcm16) / 2 / SAMPLE_RATE
