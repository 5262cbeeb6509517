"""Stage runners of the diffusion stages (hosted by ``omni_serve.deployments.stage.StageDeployment``).

Each stage runs a ``BatchEngine`` (see ``programs``) on the adapter its declaration names (``graph.GRAPH``).
Per request a runner builds the program from the stage's call (small metadata: text, sizes, seeds, settings)
and the edges declared for the stage carry the tensors (``text_encoder_dit``: prompt embeddings, ``dit_vae``:
final latents).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from omni_serve.kits.diffusion.messages import (
    CacheSettings, DecodeCall, DenoiseCall, ImagesEncoded, TextEncodeCall, VideoDecodeCall, VideosEncoded,
)
from omni_serve.kits.diffusion.replica import programs as P
from omni_serve.graph.runner import StageRunner


class TextEncoderRunner(StageRunner):
    def batch_compute(self):
        return self.model.encode

    async def run(self, engine, call: TextEncodeCall) -> AsyncIterator:
        texts = [call.prompt] + ([call.negative_prompt] if call.negative_prompt is not None else [])
        program = P.TextEncodeProgram(texts, [self.model.token_count(t) for t in texts])
        async for out in self.drive(engine, call.request_id, program):
            yield out


class DiTRunner(StageRunner):
    work_unit = "diffusion_steps"

    def adapter_options(self):
        p = self.stage_spec.params
        return {"packed_linear": p.packed_linear, "packed_forward": p.packed_forward}

    def load(self):
        model = super().load()
        cache = self.stage_spec.params.cache
        self.cache = None
        if cache.mode != "off" or cache.allow_request_override:
            from omni_serve.kits.diffusion.replica.cache import DiTCache

            self.cache = DiTCache(model, cache.settings())
        return model

    def batch_compute(self):
        return self.split_rows(P.DenoiseCompute(self.model))

    def cache_session(self, settings: CacheSettings | None, num_images: int):
        if settings is None or settings.mode == "off":
            return None
        if self.cache is None:
            raise ValueError("cache acceleration is off on this stage")
        return self.cache.session(settings, num_images)

    async def run(self, engine, call: DenoiseCall) -> AsyncIterator:
        program = P.DenoiseProgram(self.model, call, self.cache_session(call.cache, call.n))
        async for out in self.drive(engine, call.request_id, program):
            yield out


class VAERunner(StageRunner):
    def adapter_options(self):
        p = self.stage_spec.params
        return {"tile_min_pixels": p.tile_min_pixels, "tile_stride_pixels": p.tile_stride_pixels}

    def batch_compute(self):
        return P.DecodeCompute(self.model)

    async def run(self, engine, call: DecodeCall) -> AsyncIterator:
        program = P.DecodeProgram(call.height, call.width)
        async for out in self.drive(engine, call.request_id, program):
            # Encoding (zlib, GIL released) runs in a worker thread so the VAE engine keeps decoding.
            images = await asyncio.to_thread(P.encode_images, out.pixels, call.output_format)
            latents, shape = P.encode_latents(program.latents) if call.return_latents else ([], [])
            yield ImagesEncoded(images=images, latents=latents, latent_shape=shape)


class VideoDiTRunner(DiTRunner):
    """The DiT of a video graph: the kit's denoising programs (step-level batching across requests of one latent
    shape) on a video denoiser; no cache acceleration yet."""

    def adapter_options(self):
        return {}

    def load(self):
        model = StageRunner.load(self)
        self.cache = None
        return model


class VideoVAERunner(VAERunner):
    """The VAE of a video graph: each request's videos decoded (batched with others of one latent shape), then
    encoded off the engine thread as MP4 files (H.264) and a PNG of each first frame."""

    async def run(self, engine, call: VideoDecodeCall) -> AsyncIterator:
        from omni_serve.api.video_out import encode_mp4, thumbnail_png

        program = P.DecodeProgram(0, 0)  # the size is the latents' own
        async for out in self.drive(engine, call.request_id, program):
            def encode(frames=out.pixels, latents=program.latents):
                files = ([encode_mp4(v, call.fps) for v in frames] if call.output_format == "mp4" else
                         [P.encode_npz(frames=v, latents=x) for v, x in zip(frames, latents)])
                return files, [thumbnail_png(v) for v in frames]
            videos, thumbnails = await asyncio.to_thread(encode)
            latents, shape = P.encode_latents(program.latents) if call.return_latents else ([], [])
            yield VideosEncoded(videos=videos, thumbnails=thumbnails, num_frames=int(out.pixels.shape[1]),
                                latents=latents, latent_shape=shape)
