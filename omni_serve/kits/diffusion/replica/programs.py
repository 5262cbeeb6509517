"""Per-request programs of the diffusion stages (text encoder, DiT, VAE) and the batched computations that serve
them.

All three stages run on ``omni_serve.engines.batch.BatchEngine``: each tick, every ready program hands
over one unit of work with a grouping key, and equal keys are computed in one call.

- ``TextEncodeProgram`` (key: token count) -> ``PromptEmbeds`` downstream (prompt, and negative prompt).
- ``DenoiseProgram`` (key: latent grid): one denoising step per unit. Its rows (one per image, plus one
  uncond row per image under true CFG) join the rows of every other request on the same grid in ONE
  transformer forward (``DenoiseCompute``), whatever their timestep or step count: step-level continuous
  batching. Requests join and leave between steps; an aborted request is simply not asked for work again.
  Noise comes from the request's seed, the schedule from a per-request diffusers scheduler, so a request's
  result does not depend on what it was batched with (up to float rounding of the batched matmuls).
  Requests with cache acceleration (``cache``) share the forward too: their rows skip the middle blocks on the
  steps their own cache-dit context decides to cache (``cache.RowCache``); cached requests whose Fn/Bn block split
  differ get one forward each. Only where the packed forward does not cover the transformer does a cached request
  run its step alone, through cache-dit's patched forward.
  Image-conditioned pipelines set ``condition`` (image latents every row carries: Qwen-Image-Edit's packed ones,
  appended on ``condition_grid``, part of the key; Wan's first-frame latents, of the noise's shape) and
  ``image_embeds`` (image tokens every row attends to: Wan's CLIP tokens); text-to-image leaves them None.
- ``DecodeProgram`` (key: image size) -> ``DecodedPixels`` to the runner, which encodes them off the engine thread
  (and, for ``return_latents``, the latents the program decoded: ``encode_latents``).

The DiT's model adapter (``QwenImageDenoiser``, ``WanDenoiser``) gives ``DenoiseProgram`` what differs between
pipelines: ``prepare(call) -> (grid, initial latents, scheduler)`` (the grid is the batching key: rows on one grid
share a forward), ``combine_cfg(cond, uncond, scale)`` (the pipeline's guidance), ``predict(rows, grid,
condition_grid=, row_cache=)`` (one forward over ``DenoiseRow``s), ``device``, ``dtype`` and ``packed`` (the packed
forward that row-batched caching needs, or None). The VAE's adapter gives ``decode(latents, height, width)``.

Programs take their stage's call message and edge payloads (``omni_serve.kits.diffusion.messages``) and
emit edge payloads (written downstream by the runner) and stage outputs (sent to the ingress).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omni_serve.engines.batch import BatchProgram
from omni_serve.kits.diffusion.messages import (
    DenoiseCall, DenoiseDone, DenoiseProgress, FinalLatents, PromptEmbeds, PromptEncoded,
)
from omni_serve.models.diffusion_rows import DenoiseRow


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

    def complete(self, result: torch.Tensor) -> list[PromptEmbeds | PromptEncoded]:
        self.embeds.append(result)
        if len(self.embeds) < len(self.texts):
            return []
        self.done = True
        negative = self.embeds[1] if len(self.embeds) > 1 else None
        return [PromptEmbeds(prompt_embeds=self.embeds[0], negative_embeds=negative),
                PromptEncoded(prompt_tokens=self.embeds[0].shape[0])]


# -- DiT -----------------------------------------------------------------------------------------------------
@dataclass
class DenoiseWork:
    program: "DenoiseProgram"
    rows: list[DenoiseRow]
    grid: tuple[int, int]
    alone: bool = False  # a cached request whose step runs through cache-dit's patched forward, by itself
    condition_grid: tuple[int, int] | None = None  # the rows' conditioning latents' grid (image-conditioned)

    @property
    def cache_session(self):
        return self.program.cache_session


class DenoiseProgram(BatchProgram):
    def __init__(self, model, request: DenoiseCall, cache_session=None):
        self.model, self.req = model, request
        self.grid, self.latents, self.scheduler = model.prepare(request)
        self.timesteps = self.scheduler.timesteps
        self.step_index = 0
        self.prompt: torch.Tensor | None = None
        self.negative: torch.Tensor | None = None
        # image-conditioned pipelines: packed image latents [n, S_c, C] appended to every row, on their grid
        self.condition: torch.Tensor | None = None
        self.condition_grid: tuple[int, int] | None = None
        self.image_embeds: torch.Tensor | None = None  # image tokens every row attends to (Wan image-to-video)
        self.cache_session = cache_session  # omni_serve.kits.diffusion.replica.cache.CacheSession or None

    @property
    def true_cfg(self) -> bool:
        return self.negative is not None and self.req.true_cfg_scale > 1

    def feed(self, item: PromptEmbeds) -> None:
        self.prompt = item.prompt_embeds.to(self.model.device, self.model.dtype)
        if item.negative_embeds is not None:
            self.negative = item.negative_embeds.to(self.model.device, self.model.dtype)

    def ready(self) -> bool:
        return self.prompt is not None and not self.done

    def work(self):
        t = self.timesteps[self.step_index]
        texts = [self.prompt] * self.req.n
        if self.true_cfg:
            texts += [self.negative] * self.req.n
        copies = 2 if self.true_cfg else 1
        latents = list(self.latents) * copies
        conditions = list(self.condition) * copies if self.condition is not None else [None] * len(latents)
        rows = [DenoiseRow(x, t, text, self.req.guidance_scale, c, self.image_embeds)
                for x, text, c in zip(latents, texts, conditions)]
        if self.cache_session is not None and self.model.packed is None:
            # cache-dit's own forward decides once per forward for the whole batch: this request alone
            return ("cached", id(self)), DenoiseWork(self, rows, self.grid, alone=True,
                                                     condition_grid=self.condition_grid)
        key = ("grid", *self.grid, *(self.condition_grid or ()))
        return key, DenoiseWork(self, rows, self.grid, condition_grid=self.condition_grid)

    def after_step(self) -> None:
        """Called after each scheduler step, ``step_index`` already advanced: pipelines that constrain the latents
        between steps (inpainting keeps the unmasked area) do it here."""

    def work_left(self) -> float:
        """Denoising steps this request still runs (times its images, true CFG doubling the rows)."""
        rows = self.req.n * (2 if self.true_cfg else 1)
        return float((len(self.timesteps) - self.step_index) * rows)

    def complete(self, prediction: torch.Tensor) -> list[FinalLatents | DenoiseDone]:
        n = self.req.n
        noise = prediction[:n]
        if self.true_cfg:
            noise = self.model.combine_cfg(noise, prediction[n:], self.req.true_cfg_scale)
        t = self.timesteps[self.step_index]
        self.latents = self.scheduler.step(noise, t, self.latents, return_dict=False)[0]
        self.step_index += 1
        self.after_step()
        if self.step_index < len(self.timesteps):
            if getattr(self.req, "report_progress", False):
                return [DenoiseProgress(step=self.step_index, num_steps=len(self.timesteps))]
            return []
        self.done = True
        counts = None
        if self.cache_session is not None:
            counts = self.cache_session.counts()
            self.cache_session.close()
        steps = len(self.timesteps)
        return [FinalLatents(latents=self.latents),
                DenoiseDone(num_steps=steps, true_cfg=self.true_cfg, cached_steps=counts.cached if counts else 0,
                            computed_steps=counts.computed if counts else steps)]

    def release(self) -> None:
        if self.cache_session is not None:
            self.cache_session.close()


class DenoiseCompute:
    """The DiT stage's batched computation: one forward for every request's rows on a grid (cached ones included,
    one forward per Fn/Bn block split among them)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, works: list[DenoiseWork]) -> list[torch.Tensor]:
        if works[0].alone:
            return [w.cache_session.predict(w.rows, w.grid, w.condition_grid) for w in works]
        splits: dict[tuple[int, int] | None, list[int]] = {}
        for i, w in enumerate(works):
            s = w.cache_session.settings if w.cache_session is not None else None
            splits.setdefault(None if s is None else (s.fn_compute_blocks, s.bn_compute_blocks), []).append(i)
        batches = [members for key, members in splits.items() if key is not None]
        if batches:  # the uncached rows join the first cached forward
            batches[0] = sorted(batches[0] + splits.get(None, []))
        else:
            batches = [splits[None]]
        out: list[torch.Tensor | None] = [None] * len(works)
        for members in batches:
            for i, prediction in zip(members, self._forward([works[i] for i in members])):
                out[i] = prediction
        return out

    def _forward(self, works: list[DenoiseWork]) -> list[torch.Tensor]:
        from omni_serve.kits.diffusion.replica.cache import RowCache

        rows, sessions = [], []
        with contextlib.ExitStack() as held:
            for w in works:
                # a session closed by an abort (its result is dropped) computes like an uncached request
                if w.cache_session is not None and held.enter_context(w.cache_session.use()):
                    sessions.append((w.cache_session, len(rows), len(w.rows)))
                rows += w.rows
            prediction = self.model.predict(rows, works[0].grid, condition_grid=works[0].condition_grid,
                                            row_cache=RowCache(sessions) if sessions else None)
        out, start = [], 0
        for w in works:
            out.append(prediction[start:start + len(w.rows)])
            start += len(w.rows)
        return out


# -- VAE -----------------------------------------------------------------------------------------------------
@dataclass
class DecodedPixels:
    """The VAE's output for one request, handed to its runner in-process (it encodes them)."""

    pixels: np.ndarray  # uint8 [n, H, W, 3]


class DecodeProgram(BatchProgram):
    """Outputs ``DecodedPixels``; the runner encodes them (off the engine thread)."""

    def __init__(self, height: int, width: int):
        self.height, self.width = height, width
        self.latents: torch.Tensor | None = None

    def feed(self, item: FinalLatents) -> None:
        self.latents = item.latents

    def ready(self) -> bool:
        return self.latents is not None and not self.done

    def work(self):
        # one call decodes latents of one shape (a video's frame count is in its latents' shape)
        return (self.height, self.width, *self.latents.shape[1:]), (self.latents, self.height, self.width)

    def complete(self, pixels: np.ndarray) -> list[DecodedPixels]:
        self.done = True
        return [DecodedPixels(pixels)]


class DecodeCompute:
    def __init__(self, model):
        self.model = model

    def __call__(self, items: list[tuple[torch.Tensor, int, int]]) -> list[np.ndarray]:
        _, height, width = items[0]
        pixels = self.model.decode(torch.cat([latents for latents, _, _ in items]), height, width)
        out, start = [], 0
        for latents, _, _ in items:
            out.append(pixels[start:start + latents.shape[0]])
            start += latents.shape[0]
        return out


def encode_latents(latents: torch.Tensor) -> tuple[list[bytes], list[int]]:
    """(each image's packed latents [S, 4C] as little-endian float32 bytes, their shape [S, 4C]): what a request
    with ``return_latents`` gets back of the latents its images were decoded from."""
    x = latents.detach().to("cpu", torch.float32).contiguous()
    return [row.numpy().astype("<f4", copy=False).tobytes() for row in x], list(x.shape[1:])


def encode_npz(**arrays) -> bytes:
    """A NumPy archive of ``arrays`` (tensors as float32 arrays): a video's exact frames and latents."""
    out = io.BytesIO()
    np.savez(out, **{k: v.detach().to("cpu", torch.float32).numpy() if isinstance(v, torch.Tensor) else v
                     for k, v in arrays.items()})
    return out.getvalue()


def encode_images(pixels: np.ndarray, image_format: str = "png") -> list[bytes]:
    return [encode_image(p, image_format) for p in pixels]


def encode_image(pixels: np.ndarray, image_format: str = "png") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format={"jpeg": "JPEG", "webp": "WEBP"}.get(image_format, "PNG"))
    return buf.getvalue()
