"""The Wan adapters (``omni_serve.models.wan``), driven the way the stages will drive them, equal diffusers'
``WanPipeline`` on the tiny checkpoint: prompts encoded in groups of equal token count, every denoising step of every
request on one latent shape in ONE transformer forward (conditional and unconditional rows, requests at different
steps and timesteps, several videos per prompt), a scheduler per request, and the VAE decoding same-shape videos
together. Final latents within ``LATENT_ATOL`` and frames within one level of the pipeline's, alone and four in
flight; the same request with its prompt or seed swapped misses by more than ``SWAP_MARGIN`` times the tolerance."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from tests.image_oracle import Result, assert_matches, assert_swaps_fail
from tests.unit.test_wan_checkpoint import pipe  # noqa: F401 - the pipeline fixture

CASES = [
    {"prompt": "a red cat", "size": (32, 16), "num_frames": 5, "steps": 3, "guidance_scale": 5.0, "seed": 1},
    {"prompt": "dog", "size": (32, 16), "num_frames": 5, "steps": 2, "guidance_scale": 1.0, "seed": 2, "n": 2},
    {"prompt": "a house by the sea at night", "size": (16, 32), "num_frames": 9, "steps": 4, "guidance_scale": 3.0,
     "negative_prompt": "blurry", "seed": 3},
    {"prompt": "green tree", "size": (32, 16), "num_frames": 5, "steps": 4, "guidance_scale": 4.0,
     "negative_prompt": "people", "seed": 4},
]


@pytest.fixture(scope="module")
def models(wan_tiny_dir):
    from omni_serve.models.wan import WanDecoder, WanDenoiser, WanTextEncoder

    return WanTextEncoder(wan_tiny_dir), WanDenoiser(wan_tiny_dir), WanDecoder(wan_tiny_dir)


def reference(pipe, case: dict) -> Result:
    """The pipeline's final latents (the last ``callback_on_step_end`` hands over) and uint8 frames."""
    final = {}

    def keep(pipeline, step, timestep, tensors):
        final["latents"] = tensors["latents"].clone()
        return {}

    width, height = case["size"]
    frames = pipe(case["prompt"], negative_prompt=case.get("negative_prompt"), height=height, width=width,
                  num_frames=case["num_frames"], num_inference_steps=case["steps"],
                  guidance_scale=case["guidance_scale"], num_videos_per_prompt=case.get("n", 1),
                  generator=torch.Generator().manual_seed(case["seed"]), output_type="np",
                  callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"]).frames
    return Result(final["latents"], (frames * 255).round().astype(np.uint8))


class _Request:
    def __init__(self, denoiser, case: dict):
        width, height = case["size"]
        self.case, self.n = case, case.get("n", 1)
        self.cfg = case["guidance_scale"] > 1  # the pipeline's rule; its negative prompt then defaults to ""
        self.texts = [case["prompt"]] + ([case.get("negative_prompt") or ""] if self.cfg else [])
        self.latents = denoiser.initial_latents(self.n, case["num_frames"], height, width, case["seed"])
        self.scheduler = denoiser.new_scheduler(case["steps"])
        self.step = 0
        self.embeds: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return self.step == len(self.scheduler.timesteps)

    def rows(self):
        from omni_serve.models.wan import WanRow

        t = self.scheduler.timesteps[self.step]
        texts = [self.embeds[0]] * self.n + ([self.embeds[1]] * self.n if self.cfg else [])
        return [WanRow(x, t, text) for x, text in zip(list(self.latents) * (2 if self.cfg else 1), texts)]

    def complete(self, prediction: torch.Tensor) -> None:
        from omni_serve.models.wan import combine_cfg

        noise = prediction[:self.n]
        if self.cfg:
            noise = combine_cfg(noise, prediction[self.n:], self.case["guidance_scale"])
        self.latents = self.scheduler.step(noise, self.scheduler.timesteps[self.step], self.latents,
                                           return_dict=False)[0]
        self.step += 1


def served(models, cases: list[dict]) -> list[Result]:
    """``cases`` in flight together, as the stages batch them."""
    encoder, denoiser, decoder = models
    requests = [_Request(denoiser, c) for c in cases]
    by_count = defaultdict(list)  # the text encoder's key: texts of one token count in one call
    for r in requests:
        for text in r.texts:
            by_count[encoder.token_count(text)].append((r, text))
    embeds = {}
    for group in by_count.values():
        for (r, text), e in zip(group, encoder.encode([text for _, text in group])):
            embeds[id(r), text] = e
    for r in requests:
        r.embeds = [embeds[id(r), text] for text in r.texts]
    forwards = 0
    while not all(r.done for r in requests):
        by_shape = defaultdict(list)  # the DiT's key: one forward per latent shape, whatever the step
        for r in requests:
            if not r.done:
                by_shape[tuple(r.latents.shape[1:])].append(r)
        for group in by_shape.values():
            rows = [r.rows() for r in group]
            out = denoiser.predict([row for rs in rows for row in rs])
            forwards += 1
            for r, rs in zip(group, rows):
                r.complete(out[:len(rs)])
                out = out[len(rs):]
    assert forwards == max(c["steps"] for c in cases if c["num_frames"] == 5) + \
        max([c["steps"] for c in cases if c["num_frames"] != 5], default=0)
    by_shape = defaultdict(list)  # the VAE's key
    for r in requests:
        by_shape[tuple(r.latents.shape[1:])].append(r)
    pixels = {}
    for group in by_shape.values():
        frames = decoder.decode(torch.cat([r.latents for r in group]))
        for r in group:
            pixels[id(r)], frames = frames[:r.n], frames[r.n:]
    return [Result(r.latents, pixels[id(r)]) for r in requests]


def test_the_token_count_is_the_pipelines(models, pipe):
    encoder = models[0]
    for text in ("a red cat", "  a   red cat  ", "", "dog, dog and dog!"):
        ids = pipe.tokenizer(text.strip(), max_length=512, padding="max_length", return_tensors="pt").attention_mask
        assert encoder.token_count(text) == int(ids.sum())
    with pytest.raises(ValueError, match="one token count"):
        encoder.encode(["dog", "a red cat"])


def test_one_request_alone_equals_the_pipeline_and_a_swap_fails(models, pipe):
    case = CASES[0]
    got = served(models, [case])[0]
    positive = assert_matches(got, reference(pipe, case), "alone")
    assert got.pixels.shape == (1, 5, 16, 32, 3)
    swapped = {"prompt": reference(pipe, {**case, "prompt": CASES[3]["prompt"]}),
               "seed": reference(pipe, {**case, "seed": 9})}
    assert_swaps_fail(got, swapped, positive, "wan " + case["prompt"])


def test_four_in_flight_with_different_shapes_steps_and_guidance_equal_the_pipeline(models, pipe):
    for case, got in zip(CASES, served(models, CASES)):
        assert_matches(got, reference(pipe, case), case["prompt"])
