"""The Wan adapters (``omni_serve.models.wan``) under the diffusion kit's programs on real batch engines, in
process (no Ray), equal diffusers' ``WanPipeline`` on the tiny checkpoint: prompts encoded in groups of equal token
count, denoising steps of requests on one latent shape sharing transformer forwards (conditional and unconditional
rows, requests at different steps and timesteps, several videos per prompt), a scheduler per request, and the VAE
decoding same-shape videos together. Final latents within ``LATENT_ATOL`` and frames within one level of the
pipeline's, alone and four in flight; the same request with its prompt or seed swapped misses by more than
``SWAP_MARGIN`` times the tolerance. A prompt over 512 tokens is truncated as the pipeline truncates it, and sizes
the pipeline would round are refused."""

from __future__ import annotations

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


class InProcessVideo:
    """The three stages as the served graph runs them, in process: the diffusion kit's programs on real batch
    engines over the Wan adapters, queues standing in for the data plane."""

    def __init__(self, models):
        from omni_serve.engines.batch import BatchEngine
        from omni_serve.kits.diffusion.replica import programs as P

        self.te, self.dn, self.de = models
        self.text = BatchEngine("text_encoder", self.te.encode, max_batch=8)
        self.dit = BatchEngine("dit", P.DenoiseCompute(self.dn), max_batch=16)
        self.vae = BatchEngine("vae", P.DecodeCompute(self.de), max_batch=8)

    async def close(self):
        for engine in (self.text, self.dit, self.vae):
            await engine.cleanup()

    async def encode(self, rid: str, case: dict):
        from omni_serve.kits.diffusion.messages import PromptEmbeds
        from omni_serve.kits.diffusion.replica import programs as P

        cfg = case["guidance_scale"] > 1  # the pipeline's rule; its negative prompt then defaults to ""
        texts = [case["prompt"]] + ([case.get("negative_prompt") or ""] if cfg else [])
        program = P.TextEncodeProgram(texts, [self.te.token_count(t) for t in texts])
        return [out async for out in self.text.generate(rid, program) if isinstance(out, PromptEmbeds)][0]

    async def denoise(self, rid: str, case: dict, embeds):
        from omni_serve.kits.diffusion.messages import FinalLatents, VideoDenoiseCall
        from omni_serve.kits.diffusion.replica import programs as P

        width, height = case["size"]
        call = VideoDenoiseCall(request_id=rid, n=case.get("n", 1), height=height, width=width,
                                num_frames=case["num_frames"], num_steps=case["steps"], seed=case["seed"],
                                true_cfg_scale=case["guidance_scale"])
        outs = [out async for out in self.dit.generate(rid, P.DenoiseProgram(self.dn, call), _one(embeds))]
        return [out for out in outs if isinstance(out, FinalLatents)][0]

    async def decode(self, rid: str, case: dict, latents) -> Result:
        from omni_serve.kits.diffusion.replica import programs as P

        width, height = case["size"]
        frames = [out.pixels async for out in self.vae.generate(rid, P.DecodeProgram(height, width), _one(latents))]
        return Result(latents.latents, frames[0])


async def _one(item):
    yield item


def served(models, cases: list[dict]) -> tuple[list[Result], dict]:
    """``cases`` in flight together, as the stages batch them (every request's DiT program starts once all prompts
    are encoded, so their steps overlap); and the DiT engine's counters."""
    import asyncio

    async def go():
        engines = InProcessVideo(models)
        ids = [f"r{i}" for i in range(len(cases))]
        try:
            embeds = await asyncio.gather(*(engines.encode(r, c) for r, c in zip(ids, cases)))
            latents = await asyncio.gather(*(engines.denoise(r, c, e) for r, c, e in zip(ids, cases, embeds)))
            results = await asyncio.gather(*(engines.decode(r, c, x) for r, c, x in zip(ids, cases, latents)))
            return results, dict(engines.dit.counters)
        finally:
            await engines.close()
    return asyncio.run(go())


def test_the_token_count_is_the_pipelines(models, pipe):
    encoder = models[0]
    for text in ("a red cat", "  a   red cat  ", "", "dog, dog and dog!"):
        ids = pipe.tokenizer(text.strip(), max_length=512, padding="max_length", return_tensors="pt").attention_mask
        assert encoder.token_count(text) == int(ids.sum())
    with pytest.raises(ValueError, match="one token count"):
        encoder.encode(["dog", "a red cat"])


def test_one_request_alone_equals_the_pipeline_and_a_swap_fails(models, pipe):
    case = CASES[0]
    got = served(models, [case])[0][0]
    positive = assert_matches(got, reference(pipe, case), "alone")
    assert got.pixels.shape == (1, 5, 16, 32, 3)
    swapped = {"prompt": reference(pipe, {**case, "prompt": CASES[3]["prompt"]}),
               "seed": reference(pipe, {**case, "seed": 9})}
    assert_swaps_fail(got, swapped, positive, "wan " + case["prompt"])


def test_four_in_flight_with_different_shapes_steps_and_guidance_equal_the_pipeline(models, pipe):
    results, dit = served(models, CASES)
    for case, got in zip(CASES, results):
        assert_matches(got, reference(pipe, case), case["prompt"])
    assert dit["items"] > dit["calls"], dit  # requests shared forwards (at different steps and timesteps)


def test_a_prompt_over_512_tokens_is_truncated_as_the_pipeline_does(models, pipe):
    case = {"prompt": "a red cat on a green tree by the sea " * 80, "size": (32, 16), "num_frames": 5, "steps": 2,
            "guidance_scale": 1.0, "seed": 5}
    assert len(pipe.tokenizer(case["prompt"]).input_ids) > 600
    assert models[0].token_count(case["prompt"]) == 512
    assert_matches(served(models, [case])[0][0], reference(pipe, case), "a long prompt")


@pytest.mark.parametrize("frames, height, width, words", [
    (5, 24, 32, "multiples of 16"), (5, 0, 32, "multiples of 16"), (6, 16, 16, "4k \\+ 1"), (0, 16, 16, "4k")])
def test_sizes_and_frame_counts_the_pipeline_would_round_are_refused(models, frames, height, width, words):
    with pytest.raises(ValueError, match=words):
        models[1].check_size(frames, height, width)


def test_a_tiled_decode_is_diffusers_tiled_decode(wan_tiny_dir, pipe):
    from omni_serve.models.wan import WanDecoder

    latents = torch.randn(1, 16, 2, 12, 12, generator=torch.Generator().manual_seed(0))  # 96x96, 5 frames
    tiled = WanDecoder(wan_tiny_dir, tile_min_pixels=64).decode(latents)
    pipe.vae.enable_tiling(64, 64, 48, 48)
    try:
        cfg = pipe.vae.config
        x = latents * torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1) + torch.tensor(cfg.latents_mean).view(
            1, -1, 1, 1, 1)
        with torch.inference_mode():
            video = pipe.vae.decode(x, return_dict=False)[0]
        video = pipe.video_processor.postprocess_video(video, output_type="np")
    finally:
        pipe.vae.disable_tiling()
    assert tiled.shape == (1, 5, 96, 96, 3)
    assert (tiled != WanDecoder(wan_tiny_dir).decode(latents)).any()  # it did tile: the seams are blended
    assert np.abs(tiled.astype(int) - (video * 255).round().astype(int)).max() <= 1
