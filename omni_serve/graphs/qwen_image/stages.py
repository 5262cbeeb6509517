"""Stage runners of the Qwen-Image graph (hosted by ``omni_serve.deployments.stage.StageDeployment``).

Edges: ``text_encoder.dit`` (prompt and negative-prompt embeddings), ``dit.vae`` (final packed latents).
Handles carry only the ingress' small metadata (text, sizes, seeds, settings); tensors go by key through
the connector named for the edge in the spec. Every stage runs a ``BatchEngine`` (see ``programs``).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from omni_serve.engines.batch import BatchEngine
from omni_serve.graphs.qwen_image import programs as P
from omni_serve.graphs.qwen_image.spec import QwenImageGraphSpec
from omni_serve.graphs.runner import StageRunner
from omni_serve.models.qwen_image import QwenImageDecoder, QwenImageDenoiser, QwenImageTextEncoder

EDGE_TEXT_DIT = "text_encoder.dit"
EDGE_DIT_VAE = "dit.vae"

class _ImageRunner(StageRunner):
    def __init__(self, stage: str, graph_spec: dict[str, Any]):
        self.stage = stage
        self.spec = QwenImageGraphSpec.model_validate(graph_spec)
        self.stage_spec = getattr(self.spec.stages, stage)
        self.engine_spec = self.stage_spec.engine
        self.dtype = self.engine_spec.torch_dtype()
        self.model = self.load()

    def load(self):
        raise NotImplementedError

    def modules(self) -> dict[str, Any]:
        return self.model.modules

    def batch_engine(self, compute, work_unit: str | None = None) -> BatchEngine:
        s = self.engine_spec
        return BatchEngine(self.stage, compute, max_batch=self.stage_spec.params.max_batch,
                           max_active=s.max_active_requests, torch_threads=s.torch_threads, work_unit=work_unit)


class TextEncoderRunner(_ImageRunner):
    def load(self):
        return QwenImageTextEncoder(self.spec.checkpoint, dtype=self.dtype, device=self.engine_spec.device)

    def make_engine(self) -> BatchEngine:
        return self.batch_engine(self.model.encode)

    async def run(self, engine, request) -> AsyncIterator[dict[str, Any]]:
        texts = [request["prompt"]]
        if request.get("negative_prompt") is not None:
            texts.append(request["negative_prompt"])
        program = P.TextEncodeProgram(texts, [self.model.token_count(t) for t in texts])
        async for out in self.drive(engine, request["request_id"], program, sink=self.sink(EDGE_TEXT_DIT)):
            yield out


class DiTRunner(_ImageRunner):
    def load(self):
        model = QwenImageDenoiser(self.spec.checkpoint, dtype=self.dtype, device=self.engine_spec.device)
        cache = self.stage_spec.params.cache
        self.cache = None
        if cache.mode != "off" or cache.allow_request_override:
            from omni_serve.graphs.qwen_image.cache import DiTCache

            self.cache = DiTCache(model, cache.settings())
        return model

    def make_engine(self) -> BatchEngine:
        return self.batch_engine(P.DenoiseCompute(self.model), work_unit="diffusion_steps")

    def cache_session(self, settings: dict[str, Any] | None, num_images: int):
        if not settings or settings.get("mode", "off") == "off":
            return None
        if self.cache is None:
            raise ValueError("cache acceleration is off on this stage")
        return self.cache.session(settings, num_images)

    async def run(self, engine, request) -> AsyncIterator[dict[str, Any]]:
        req = P.DenoiseRequest(
            num_images=request["n"], height=request["height"], width=request["width"],
            num_steps=request["num_steps"], seed=request["seed"], true_cfg_scale=request["true_cfg_scale"],
            guidance_scale=request.get("guidance_scale"))
        program = P.DenoiseProgram(self.model, req, self.cache_session(request.get("cache"), req.num_images))
        async for out in self.drive(engine, request["request_id"], program,
                                    source=self.source(EDGE_TEXT_DIT), sink=self.sink(EDGE_DIT_VAE)):
            yield out


class VAERunner(_ImageRunner):
    def load(self):
        p = self.stage_spec.params
        return QwenImageDecoder(self.spec.checkpoint, dtype=self.dtype, device=self.engine_spec.device,
                                tile_min_pixels=p.tile_min_pixels, tile_stride_pixels=p.tile_stride_pixels)

    def make_engine(self) -> BatchEngine:
        return self.batch_engine(P.DecodeCompute(self.model))

    async def run(self, engine, request) -> AsyncIterator[dict[str, Any]]:
        program = P.DecodeProgram(request["height"], request["width"])
        fmt = request.get("output_format") or "png"
        async for out in self.drive(engine, request["request_id"], program, source=self.source(EDGE_DIT_VAE)):
            # Encoding (zlib, GIL released) runs in a worker thread so the VAE engine keeps decoding.
            yield {"images": await asyncio.to_thread(P.encode_images, out["pixels"], fmt)}
