"""Per-request programs of the GLM-Image stages that are its own (the glyph encoder and the VAE run the diffusion kit's).

- ``PriorSequence`` (AR engine): the prompt's rows, then one visual token per step, sampled with the request's
  seeded sampler (or greedily) and fed back at the position transformers' ``generate`` gives it. When the target
  grid is complete it emits ``PriorTokens`` (to the DiT, over the data plane) and ``PriorDone`` and ends; the
  preview grid the model writes first is generated (the target depends on it) but not sent. Its prompt's full
  blocks are offered for prefix sharing (prompts that differ only in their end reuse the common blocks).
- ``GlmDenoiseProgram`` (batch engine, key: latent size): one denoising step per unit of work. Its rows (one per
  image, plus one unconditional row per image under CFG) join those of every other request of the same size in
  ``GlmDenoiseCompute``, which runs one transformer forward per glyph length among the step's rows (rows are never
  padded: see ``omni_serve.models.glm_image``). Each request keeps its own scheduler and noise, so its result does
  not depend on what it was batched with (up to float rounding of the batched matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_serve.engines.ar.kv_cache import block_hashes
from omni_serve.engines.ar.sequence import ARSequence
from omni_serve.engines.batch import BatchProgram
from omni_serve.engines.sampling import Sampler, SamplingParams
from omni_serve.families.glm_image.messages import (
    DenoiseDone, FinalLatents, GlmDenoiseCall, PriorDone, PriorTokens, PromptEmbeds,
)
from omni_serve.models.glm_image import ARPrompt, GlmDenoiseRow, GlmImageAR, GlmImageDenoiser, combine_cfg


# -- AR ------------------------------------------------------------------------------------------------------
class PriorSequence(ARSequence):
    def __init__(self, model: GlmImageAR, prompt: ARPrompt, sampling: SamplingParams, block_size: int):
        super().__init__(model.row_size, model.position_rows, model.dtype)
        self.model, self.prompt = model, prompt
        self.sampler = Sampler(sampling)
        self.prompt_len = len(prompt.input_ids)
        self.max_rows = self.prompt_len + prompt.num_tokens
        self.generated: list[int] = []
        # token ids are the content of every prompt row (no media): whole blocks can be shared
        self.prefix_hashes = block_hashes(prompt.input_ids[:self.prompt_len - 1], block_size)

    def ready(self) -> bool:
        return not self.done and (self.num_rows == 0 or self.num_pending() > 0)

    def poll(self) -> None:
        if self.num_rows == 0:  # the prompt's rows are built on the engine's thread, with its torch threads
            self.append(self.model.embed(torch.tensor(self.prompt.input_ids)), self.prompt.positions)

    def on_computed(self, start, end, hidden, logits) -> list[PriorTokens | PriorDone]:
        if logits is None:
            return []
        token = self.sampler.select(logits, self.generated)
        self.generated.append(token)
        j = len(self.generated)
        if j < self.prompt.num_tokens:
            self.append(self.model.embed(torch.tensor([token])), self.prompt.decode_positions[:, j - 1:j])
            return []
        self.done = True
        return [PriorTokens(tokens=self.model.prior_tokens(self.prompt, self.generated)),
                PriorDone(prompt_tokens=self.prompt_len, generated_tokens=j)]


# -- DiT -----------------------------------------------------------------------------------------------------
@dataclass
class GlmDenoiseWork:
    program: "GlmDenoiseProgram"
    rows: list[GlmDenoiseRow]
    size: tuple[int, int]  # (height, width) in pixels


class GlmDenoiseProgram(BatchProgram):
    def __init__(self, model: GlmImageDenoiser, request: GlmDenoiseCall):
        self.model, self.req = model, request
        self.latents = model.initial_latents(request.n, request.height, request.width, request.seed)
        self.scheduler = model.new_scheduler(request.num_steps, request.height, request.width)
        self.timesteps = self.scheduler.timesteps
        self.step_index = 0
        self.glyphs: torch.Tensor | None = None
        self.negative: torch.Tensor | None = None
        self.prior: torch.Tensor | None = None

    @property
    def cfg(self) -> bool:
        return self.req.guidance_scale > 1

    def feed(self, item: PromptEmbeds | PriorTokens) -> None:
        if isinstance(item, PriorTokens):
            self.prior = item.tokens.to(self.model.device)
            return
        self.glyphs = item.prompt_embeds.to(self.model.device, self.model.dtype)
        if self.cfg:
            if item.negative_embeds is None:
                raise ValueError("CFG needs the unconditional glyph embeddings")
            self.negative = item.negative_embeds.to(self.model.device, self.model.dtype)

    def ready(self) -> bool:
        return self.glyphs is not None and self.prior is not None and not self.done

    def work(self):
        t = self.timesteps[self.step_index]
        rows = [GlmDenoiseRow(x, t, self.glyphs, self.prior, False) for x in self.latents]
        if self.cfg:
            rows += [GlmDenoiseRow(x, t, self.negative, self.prior, True) for x in self.latents]
        size = (self.req.height, self.req.width)
        return ("size", *size), GlmDenoiseWork(self, rows, size)

    def work_left(self) -> float:
        """Denoising steps this request still runs (times its images, CFG doubling the rows)."""
        return float((len(self.timesteps) - self.step_index) * self.req.n * (2 if self.cfg else 1))

    def complete(self, prediction: torch.Tensor) -> list[FinalLatents | DenoiseDone]:
        n = self.req.n
        noise = prediction[:n]
        if self.cfg:
            noise = combine_cfg(noise, prediction[n:], self.req.guidance_scale)
        t = self.timesteps[self.step_index]
        self.latents = self.scheduler.step(noise, t, self.latents, return_dict=False)[0]
        self.step_index += 1
        if self.step_index < len(self.timesteps):
            return []
        self.done = True
        steps = len(self.timesteps)
        return [FinalLatents(latents=self.latents),
                DenoiseDone(num_steps=steps, true_cfg=self.cfg, cached_steps=0, computed_steps=steps)]


class GlmDenoiseCompute:
    """The DiT stage's batched computation: the step's rows of every request of one size, one forward per glyph
    length among them."""

    def __init__(self, model: GlmImageDenoiser):
        self.model = model

    def __call__(self, works: list[GlmDenoiseWork]) -> list[torch.Tensor]:
        rows = [row for w in works for row in w.rows]
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_length.setdefault(row.glyphs.shape[0], []).append(i)
        prediction: list[torch.Tensor | None] = [None] * len(rows)
        for members in by_length.values():
            out = self.model.predict([rows[i] for i in members], *works[0].size)
            for i, p in zip(members, out):
                prediction[i] = p
        results, start = [], 0
        for w in works:
            results.append(torch.stack(prediction[start:start + len(w.rows)]))
            start += len(w.rows)
        return results
