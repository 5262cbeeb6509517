"""GLM-Image against its libraries, without Ray: the checkpoint writer (diffusers loads it), the AR stage's tokens
against transformers' ``generate`` (greedy; batched, and under KV pressure that preempts), and whole served images
against ``GlmImagePipeline`` (same checkpoint and seed; 6 requests in flight of different sizes, steps and CFG),
with negative controls (a swapped prompt, a swapped seed) that must fail the same comparison."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from tests.image_oracle import Result, assert_matches, assert_swaps_fail, response_result

PROMPTS = ["a red house by the river", "two cats on a blue sofa", "a city road in the rain at night",
           "green mountain under the sun", "a bird on a tree, snow", 'a sign that says "hello"']


@pytest.fixture(scope="module")
def pipe(glm_image_tiny_dir):
    from diffusers import GlmImagePipeline

    return GlmImagePipeline.from_pretrained(glm_image_tiny_dir)


def test_checkpoint_is_what_diffusers_loads_and_deterministic(glm_image_tiny_dir, pipe, tmp_path):
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import GlmImageForConditionalGeneration, T5EncoderModel

    from omni_serve.checkpoints.glm_image import make_checkpoint

    assert isinstance(pipe.vision_language_encoder, GlmImageForConditionalGeneration)
    assert isinstance(pipe.transformer, GlmImageTransformer2DModel)
    assert isinstance(pipe.text_encoder, T5EncoderModel) and isinstance(pipe.vae, AutoencoderKL)
    again = make_checkpoint(str(tmp_path / "again"), "tiny")
    for part in ("vision_language_encoder/model.safetensors", "transformer/diffusion_pytorch_model.safetensors"):
        with open(os.path.join(glm_image_tiny_dir, part), "rb") as a, open(os.path.join(again, part), "rb") as b:
            assert a.read() == b.read(), part


# -- AR tokens vs generate -----------------------------------------------------------------------------------
def _generate_reference(pipe, prompt: str, height: int, width: int) -> list[int]:
    """transformers' generate of the AR model, greedy, on the pipeline's inputs (``generate_prior_tokens``)."""
    messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
    inputs = pipe.processor.apply_chat_template(messages, tokenize=True, target_h=height, target_w=width,
                                                return_dict=True, return_tensors="pt")
    max_new, *_ = pipe._compute_generation_params(inputs["image_grid_thw"], is_text_to_image=True)
    out = pipe.vision_language_encoder.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("num_kv_blocks", [512, 48], ids=["batched", "preempted"])
def test_ar_tokens_equal_generate_greedy(glm_image_tiny_dir, pipe, num_kv_blocks):
    from omni_serve.engines.ar import ARConfig, AREngine
    from omni_serve.engines.sampling import SamplingParams
    from omni_serve.families.glm_image.replica.programs import PriorSequence
    from omni_serve.models.glm_image import GlmImageAR

    sizes = [(64, 64), (64, 96), (96, 64), (64, 64)]
    model = GlmImageAR(glm_image_tiny_dir)
    config = ARConfig(num_kv_blocks=num_kv_blocks, block_size=16)

    async def main():
        engine = AREngine("ar", model, config)
        await engine.start()
        programs = [PriorSequence(model, model.prompt(p, h, w), SamplingParams(temperature=0.0), config.block_size)
                    for p, (h, w) in zip(PROMPTS, sizes)]

        async def run(i, program):
            return [out async for out in engine.generate(f"r{i}", program)]

        outputs = await asyncio.gather(*(run(i, p) for i, p in enumerate(programs)))
        stats = engine.stats()
        await engine.cleanup()
        return programs, outputs, stats

    programs, outputs, stats = asyncio.run(main())
    if num_kv_blocks < 512:
        assert stats["preemptions"] > 0, stats
    for prompt, (h, w), program, outs in zip(PROMPTS, sizes, programs, outputs):
        reference = _generate_reference(pipe, prompt, h, w)
        assert program.generated == reference[:len(program.generated)], prompt
        assert len(program.generated) == len(reference) - 1  # generate's last token only closes the image
        prior = next(o for o in outs if type(o).__name__ == "PriorTokens").tokens
        rows, cols = h // 32, w // 32
        target = torch.tensor(reference[len(reference) - 1 - rows * cols:-1])
        expected = pipe._upsample_token_ids(target, rows, cols)[0]
        assert torch.equal(prior, expected), prompt
    # a mix-up fails: the tokens of different prompts differ
    assert programs[0].generated != programs[3].generated


# -- served images vs the pipeline ---------------------------------------------------------------------------
CASES = [  # prompt index, width, height, steps, guidance, seed, n
    (0, 96, 96, 3, 1.5, 11, 1), (1, 96, 64, 2, 1.0, 12, 1), (2, 64, 96, 4, 2.0, 13, 2),
    (3, 64, 64, 2, 3.0, 14, 1), (4, 64, 64, 3, 1.0, 15, 1), (5, 64, 64, 3, 1.5, 16, 1),
]


def _reference(pipe, prompt, width, height, steps, guidance, seed, n, pixels=True) -> Result:
    from tests.image_oracle import pipeline_result

    return pipeline_result(pipe, seed, pixels=pixels, prompt=prompt, height=height, width=width,
                           num_inference_steps=steps, guidance_scale=guidance, num_images_per_prompt=n)


def test_served_images_equal_the_pipeline_with_six_in_flight(glm_image_tiny_dir, pipe):
    from omni_serve.api.images import ImageGenerationRequest
    from omni_serve.graph.frontend import RequestContext
    from omni_serve.families.glm_image import FAMILY
    from omni_serve.graph.local import LocalGraph

    def request(case):
        i, width, height, steps, guidance, seed, n = case
        return ImageGenerationRequest(prompt=PROMPTS[i], size=f"{width}x{height}", num_inference_steps=steps,
                                      guidance_scale=guidance, seed=seed, n=n, return_latents=True)

    async def main():
        async with LocalGraph(FAMILY, {"checkpoint": glm_image_tiny_dir}) as graph:
            return await asyncio.gather(*(graph.frontend.images_generations(request(c), RequestContext(timeout_s=600))
                                          for c in CASES))

    responses = asyncio.run(main())
    for case, response in zip(CASES, responses):
        i, width, height, steps, guidance, seed, n = case
        got = response_result(response.data)
        what = f"{PROMPTS[i]!r} {width}x{height} steps={steps} cfg={guidance} n={n}"
        distance = assert_matches(got, _reference(pipe, PROMPTS[i], *case[1:]), what)
        assert response.metrics.true_cfg == (guidance > 1)
        if case is CASES[0]:
            swapped = {"prompt": _reference(pipe, PROMPTS[1], *case[1:], pixels=False),
                       "seed": _reference(pipe, PROMPTS[i], *case[1:5], seed + 1, n, pixels=False)}
            assert_swaps_fail(got, swapped, distance, what)


def test_ceiling_report_runs_and_sets_a_bench_run_against_it(glm_image_tiny_dir, tmp_path):
    """benchmarks/glm_image/ceiling.py (the docs' ceiling numbers) on the tiny checkpoint: every stage timed at both
    batches, the ceiling is the smaller of the two bounds, and a bench report's runs are set against it."""
    import json
    import subprocess
    import sys

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"label": "engine c=2", "throughput": {"images_per_s": 1.0}},
                                          {"label": "diffusers", "throughput": {"images_per_s": 0.5}}]}))
    out = tmp_path / "ceiling.json"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "glm_image", "ceiling.py")
    subprocess.run([sys.executable, script, glm_image_tiny_dir, "--size", "64", "--steps", "2",
                    "--batch", "2", "--baseline-requests", "1", "--bench-report", str(bench), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    costs = report["costs_s_per_image"]
    assert set(costs) == {"ar", "text_encoder", "dit", "vae"}
    assert all(set(by_batch) == {"1", "2"} and min(by_batch.values()) > 0 for by_batch in costs.values())
    best = report["best_s_per_image"]
    ceiling = min(2 / sum(best.values()), 1 / max(best.values()))
    assert report["ceiling_images_per_s"] == pytest.approx(ceiling)
    assert report["bench"]["engine c=2"]["measured_over_ceiling"] == pytest.approx(1.0 / ceiling)
    assert report["bench"]["ceiling_over_diffusers"] == pytest.approx(ceiling / 0.5)
    assert report["diffusers_images_per_s"] > 0
