"""Stage runners of the Qwen2.5-Omni graph (hosted by ``omni_serve.deployments.stage.StageDeployment``).

Each runner loads its own component, and per request builds the program from the ingress' metadata
(``request``: plain ids and settings, no tensors), reads its upstream edge and writes its downstream edge.
Edges: ``ingress.encoder`` (media features), ``encoder.thinker``, ``thinker.talker``, ``talker.code2wav``.
In the disaggregated thinker layout the thinker is two stages, ``ThinkerPrefillRunner`` (reads
``encoder.thinker``, writes the prompt hand-off on ``thinker_prefill.thinker_decode``) and
``ThinkerDecodeRunner`` (reads that hand-off, writes ``thinker.talker`` and yields the text).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import numpy as np

from omni_serve.engines.ar import AREngine
from omni_serve.engines.batch import BatchEngine
from omni_serve.engines.sampling import SamplingParams
from omni_serve.graphs.qwen2_5_omni import programs as P
from omni_serve.graphs.qwen2_5_omni.code2wav import Code2WavCompute, Code2WavRequest, Code2WavStream, check_chunking
from omni_serve.graphs.qwen2_5_omni.spec import OmniGraphSpec
from omni_serve.graphs.runner import StageRunner
from omni_serve.models.qwen2_5_omni import OmniCode2Wav, OmniEncoder, OmniTalker, OmniThinker
from omni_serve.transport.base import chunk_key, observed_get

EDGE_INGRESS_ENCODER = "ingress.encoder"
EDGE_ENCODER_THINKER = "encoder.thinker"
EDGE_THINKER_TALKER = "thinker.talker"
EDGE_TALKER_CODE2WAV = "talker.code2wav"
EDGE_PREFILL_DECODE = "thinker_prefill.thinker_decode"


class _OmniRunner(StageRunner):
    adapter: Any = None

    def __init__(self, stage: str, graph_spec: dict[str, Any]):
        self.stage = stage
        self.spec = OmniGraphSpec.model_validate(graph_spec)
        self.stage_spec = getattr(self.spec.stages, stage)
        self.engine_spec = self.stage_spec.engine
        self.model = self.adapter(self.spec.checkpoint, dtype=self.engine_spec.torch_dtype(),
                                  device=self.engine_spec.device)

    def modules(self) -> dict[str, Any]:
        return self.model.modules

    def edge_field(self, edge: str) -> str:
        # The ingress->encoder edge rides the same backend as encoder->thinker.
        return super().edge_field(EDGE_ENCODER_THINKER if edge == EDGE_INGRESS_ENCODER else edge)


def _sampling(values: dict[str, Any]) -> SamplingParams:
    values = dict(values)
    values["stop_token_ids"] = tuple(values.get("stop_token_ids", ()))
    return SamplingParams(**values)


class _ARRunner(_OmniRunner):
    def make_engine(self) -> AREngine:
        s = self.engine_spec
        return AREngine(self.stage, self.model, s.ar, max_active=s.max_active_requests, torch_threads=s.torch_threads)


class EncoderRunner(_OmniRunner):
    adapter = OmniEncoder

    async def run(self, engine, request) -> AsyncIterator[dict[str, Any]]:
        program = P.EncoderProgram(self.model)
        async for out in self.drive(engine, request["request_id"], program,
                                    source=self.source(EDGE_INGRESS_ENCODER), sink=self.sink(EDGE_ENCODER_THINKER)):
            yield out
        yield {"done": True}


class ThinkerRunner(_ARRunner):
    """The thinker in the aggregated layout; its subclasses are the two halves of the disaggregated one."""

    adapter = OmniThinker
    role = P.ThinkerRole.AGGREGATED

    def __init__(self, stage, graph_spec):
        super().__init__(stage, graph_spec)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.checkpoint)
        cfg = self.model.config
        self.media_token_ids = (cfg.audio_token_index, cfg.image_token_index, cfg.video_token_index)

    def thinker_request(self, request: dict[str, Any]) -> P.ThinkerRequest:
        edge = self.spec.edges.thinker_talker
        return P.ThinkerRequest(
            input_ids=request["input_ids"], max_new_tokens=request["max_new_tokens"],
            sampling=_sampling(request["sampling"]), stop_token_ids=tuple(request["stop_token_ids"]),
            stop=tuple(request.get("stop") or ()), image_grid_thw=request.get("image_grid_thw"),
            audio_seqlens=request.get("audio_seqlens"), expects_media=request.get("expects_media", False),
            talker_voice_token=request.get("voice_token"), talker_tokens=tuple(request.get("talker_tokens", (0, 0))),
            chunk_size=edge.chunk_size, first_chunk_size=edge.first_chunk_size,
            media_token_ids=self.media_token_ids, block_size=self.engine_spec.ar.block_size,
        )

    async def _feed_once(self, program: P.ThinkerSequence, request_id: str, edge: str) -> None:
        """Feed the program the single payload of ``edge`` (media embeddings, or the prompt hand-off)."""
        conn, edge_name, timeout = self.source(edge)
        key = chunk_key(request_id, edge_name, 0)
        payload = await observed_get(conn, key, timeout)
        await conn.free(key)
        program.feed(payload)

    async def run(self, engine, request) -> AsyncIterator[dict[str, Any]]:
        req = self.thinker_request(request)
        program = P.ThinkerSequence(self.model, self.tokenizer, req, role=self.role)
        rid = request["request_id"]
        if self.role is P.ThinkerRole.DECODE:
            await self._feed_once(program, rid, EDGE_PREFILL_DECODE)
        elif req.expects_media:
            await self._feed_once(program, rid, EDGE_ENCODER_THINKER)
        if self.role is P.ThinkerRole.PREFILL:
            sink = self.sink(EDGE_PREFILL_DECODE)
        else:
            sink = self.sink(EDGE_THINKER_TALKER) if req.talker_voice_token is not None else None
        async for out in self.drive(engine, rid, program, sink=sink):
            yield out
        if self.role is P.ThinkerRole.PREFILL:
            yield {"done": True, "prompt_tokens": program.prompt_len}


class ThinkerPrefillRunner(ThinkerRunner):
    """Disaggregated layout, first half: the prompt's KV, handed to ``thinker_decode``."""

    role = P.ThinkerRole.PREFILL


class ThinkerDecodeRunner(ThinkerRunner):
    """Disaggregated layout, second half: adopts the prefilled prompt and generates."""

    role = P.ThinkerRole.DECODE


class TalkerRunner(_ARRunner):
    adapter = OmniTalker

    async def run(self, engine, request) -> AsyncIterator[dict[str, Any]]:
        p = self.stage_spec.params
        greedy = request.get("greedy", False)
        sampling = SamplingParams(
            temperature=0.0 if greedy else p.temperature, top_k=p.top_k, top_p=p.top_p,
            repetition_penalty=p.repetition_penalty, seed=request.get("seed", 0),
            suppress_tokens=(self.model.codec_bos,))
        edge = self.spec.edges.talker_code2wav
        program = P.TalkerSequence(self.model, P.TalkerRequest(
            max_new_tokens=min(request.get("max_codec_tokens") or p.max_codec_tokens, p.max_codec_tokens),
            sampling=sampling, chunk_size=edge.chunk_size, first_chunk_size=edge.first_chunk_size))
        async for out in self.drive(engine, request["request_id"], program,
                                    source=self.source(EDGE_THINKER_TALKER), sink=self.sink(EDGE_TALKER_CODE2WAV)):
            yield out


class Code2WavRunner(_OmniRunner):
    adapter = OmniCode2Wav

    def __init__(self, stage, graph_spec):
        super().__init__(stage, graph_spec)
        check_chunking(self.model, self._request("Chelsie", 0))

    def _request(self, voice: str, seed: int) -> Code2WavRequest:
        p = self.stage_spec.params
        return Code2WavRequest(
            voice=voice, seed=seed, num_steps=p.num_steps, guidance_scale=p.guidance_scale,
            sway_coefficient=p.sway_coefficient, first_chunk_codes=p.first_chunk_codes, chunk_codes=p.chunk_codes,
            left_context_codes=p.left_context_codes, right_context_codes=p.right_context_codes,
            vocoder_context_frames=p.vocoder_context_frames)

    def make_engine(self) -> BatchEngine:
        s, p = self.engine_spec, self.stage_spec.params
        compute = Code2WavCompute(self.model, p.num_steps, p.guidance_scale, p.sway_coefficient)
        return BatchEngine(self.stage, compute, max_batch=p.max_batch, max_active=s.max_active_requests,
                           torch_threads=s.torch_threads)

    async def run(self, engine, request) -> AsyncIterator[dict[str, Any]]:
        if request["voice"] not in self.model.speakers:
            raise ValueError(f"unknown voice {request['voice']!r}")
        program = Code2WavStream(self.model, self._request(request["voice"], request["seed"]))
        async for out in self.drive(engine, request["request_id"], program,
                                    source=self.source(EDGE_TALKER_CODE2WAV)):
            audio = np.asarray(out["audio"], dtype=np.float32)
            # Audio for the client is the response payload itself (pcm16 bytes), not a handle argument.
            yield {"pcm16": (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes(),
                   "num_samples": int(audio.size), "num_codes": out["num_codes"]}
