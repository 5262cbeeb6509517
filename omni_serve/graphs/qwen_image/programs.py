"""Per-request programs of the Qwen-Image stages and the batched computations that serve them.

All three stages run on ``omni_serve.engines.batch.BatchEngine``: each tick, every ready program hands
over one unit of work with a grouping key, and equal keys are computed in one call.

- ``TextEncodeProgram`` (key: token count) -> the prompt's (and negative prompt's) embeddings downstream.
- ``DenoiseProgram`` (key: latent grid): one denoising step per unit. Its rows (one per image, plus one
  uncond row per image under true CFG) join the rows of every other request on the same grid in ONE
  transformer forward (``DenoiseCompute``), whatever their timestep or step count: step-level continuous
  batching. Requests join and leave between steps; an aborted request is simply not asked for work again.
  Noise comes from the request's seed, the schedule from a per-request diffusers scheduler, so a request's
  result does not depend on what it was batched with (up to float rounding of the batched matmuls).
  With cache acceleration (``cache``), the step goes through the request's own cache-dit context instead.
- ``DecodeProgram`` (key: image size) -> pixels to the caller, which encodes them off the engine thread.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from omni_serve.engines.batch import BatchProgram
from omni_serve.models.qwen_image import DenoiseRow, QwenImageDecoder, QwenImageDenoiser, combine_cfg


# -- text encoder --------------------------------------------------------------------------------------------
class TextEncodeProgram(BatchProgram):
    """Encodes ``texts`` (prompt, then the negative prompt if any), one per unit of work."""

    def __init__(self, texts: list[str], token_counts: list[int]):
        self.texts, self.counts = texts, token_counts
        self.embeds: list[torch.Tensor] = []

    def ready(self) -> bool:
        return not self.done

    def work(self):
        i = len(self.embeds)
        return ("text", self.counts[i]), self.texts[i]

    def complete(self, result: torch.Tensor) -> list[Any]:
        self.embeds.append(result)
        if len(self.embeds) < len(self.texts):
            return []
        self.done = True
        payload = {"prompt_embeds": self.embeds[0], "end": True}
        if len(self.embeds) > 1:
            payload["negative_embeds"] = self.embeds[1]
        return [{"downstream": payload, "prompt_tokens": self.embeds[0].shape[0]}]


# -- DiT -----------------------------------------------------------------------------------------------------
@dataclass
class DenoiseRequest:
    num_images: int
    height: int
    width: int
    num_steps: int
    seed: int
    true_cfg_scale: float = 1.0  # CFG runs when > 1 and negative embeddings arrive
    guidance_scale: float | None = None  # guidance-distilled transformers only


@dataclass
class DenoiseWork:
    program: "DenoiseProgram"
    rows: list[DenoiseRow]
    grid: tuple[int, int]
    cached: bool = False  # runs through the request's own cache context (not batched with others)


class DenoiseProgram(BatchProgram):
    def __init__(self, model: QwenImageDenoiser, request: DenoiseRequest, cache_session=None):
        self.model, self.req = model, request
        self.grid = model.latent_grid(request.height, request.width)
        self.latents = model.initial_latents(request.num_images, request.height, request.width, request.seed)
        self.scheduler = model.new_scheduler(request.num_steps, self.latents.shape[1])
        self.timesteps = self.scheduler.timesteps
        self.step_index = 0
        self.prompt: torch.Tensor | None = None
        self.negative: torch.Tensor | None = None
        self.cache_session = cache_session  # omni_serve.graphs.qwen_image.cache.CacheSession or None

    @property
    def true_cfg(self) -> bool:
        return self.negative is not None and self.req.true_cfg_scale > 1

    def feed(self, item: dict[str, Any]) -> None:
        self.prompt = item["prompt_embeds"].to(self.model.device, self.model.dtype)
        if item.get("negative_embeds") is not None:
            self.negative = item["negative_embeds"].to(self.model.device, self.model.dtype)

    def ready(self) -> bool:
        return self.prompt is not None and not self.done

    def work(self):
        t = self.timesteps[self.step_index]
        texts = [self.prompt] * self.req.num_images
        if self.true_cfg:
            texts += [self.negative] * self.req.num_images
        latents = list(self.latents) * (2 if self.true_cfg else 1)
        rows = [DenoiseRow(x, t, text, self.req.guidance_scale) for x, text in zip(latents, texts)]
        if self.cache_session is not None:
            # Cache decisions are per request (cache-dit's state is per context): never share a forward.
            return ("cached", id(self)), DenoiseWork(self, rows, self.grid, cached=True)
        return ("grid", *self.grid), DenoiseWork(self, rows, self.grid)

    def work_left(self) -> float:
        """Denoising steps this request still runs (times its images, true CFG doubling the rows)."""
        rows = self.req.num_images * (2 if self.true_cfg else 1)
        return float((len(self.timesteps) - self.step_index) * rows)

    def complete(self, prediction: torch.Tensor) -> list[Any]:
        n = self.req.num_images
        noise = prediction[:n]
        if self.true_cfg:
            noise = combine_cfg(noise, prediction[n:], self.req.true_cfg_scale)
        t = self.timesteps[self.step_index]
        self.latents = self.scheduler.step(noise, t, self.latents, return_dict=False)[0]
        self.step_index += 1
        if self.step_index < len(self.timesteps):
            return []
        self.done = True
        counts = None
        if self.cache_session is not None:
            counts = self.cache_session.counts()
            self.cache_session.close()
        steps = len(self.timesteps)
        return [{"downstream": {"latents": self.latents, "end": True},
                 "num_steps": steps, "true_cfg": self.true_cfg,
                 "cached_steps": counts.cached if counts else 0,
                 "computed_steps": counts.computed if counts else steps}]

    def release(self) -> None:
        if self.cache_session is not None:
            self.cache_session.close()


class DenoiseCompute:
    """The DiT stage's batched computation: one forward for every uncached request's rows on a grid."""

    def __init__(self, model: QwenImageDenoiser):
        self.model = model

    def __call__(self, works: list[DenoiseWork]) -> list[torch.Tensor]:
        if works[0].cached:
            return [w.program.cache_session.predict(w.rows, w.grid) for w in works]
        rows = [row for w in works for row in w.rows]
        prediction = self.model.predict(rows, works[0].grid)
        out, start = [], 0
        for w in works:
            out.append(prediction[start:start + len(w.rows)])
            start += len(w.rows)
        return out


# -- VAE -----------------------------------------------------------------------------------------------------
class DecodeProgram(BatchProgram):
    """Outputs ``{"pixels": uint8 [n, H, W, 3]}``; the caller encodes them (off the engine thread)."""

    def __init__(self, height: int, width: int):
        self.height, self.width = height, width
        self.latents: torch.Tensor | None = None

    def feed(self, item: dict[str, Any]) -> None:
        self.latents = item["latents"]

    def ready(self) -> bool:
        return self.latents is not None and not self.done

    def work(self):
        return (self.height, self.width), (self.latents, self.height, self.width)

    def complete(self, pixels: np.ndarray) -> list[Any]:
        self.done = True
        return [{"pixels": pixels}]


class DecodeCompute:
    def __init__(self, model: QwenImageDecoder):
        self.model = model

    def __call__(self, items: list[tuple[torch.Tensor, int, int]]) -> list[np.ndarray]:
        _, height, width = items[0]
        pixels = self.model.decode(torch.cat([latents for latents, _, _ in items]), height, width)
        out, start = [], 0
        for latents, _, _ in items:
            out.append(pixels[start:start + latents.shape[0]])
            start += latents.shape[0]
        return out


def encode_images(pixels: np.ndarray, image_format: str = "png") -> list[bytes]:
    return [encode_image(p, image_format) for p in pixels]


def encode_image(pixels: np.ndarray, image_format: str = "png") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format={"jpeg": "JPEG", "webp": "WEBP"}.get(image_format, "PNG"))
    return buf.getvalue()
