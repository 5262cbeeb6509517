"""Qwen-Image-Edit, in process (no Ray): the checkpoint loads in diffusers' pipeline, and the graph (the family's
own frontend, runners and engines, wired from its declaration by ``LocalGraph``) returns the latents and the
uint8 image of ``QwenImageEditPipeline`` on the same checkpoint and seed (``tests.image_oracle``; the latents as the
response's ``return_latents`` carries them): alone, and with six edits of different sizes, steps, CFG and input
images in flight. A swapped prompt, seed or input image must fail the same comparison.
"""

from __future__ import annotations

import asyncio
import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image
from starlette.datastructures import Headers, UploadFile

from omni_serve.api.errors import OpenAIError
from omni_serve.graph.frontend import RequestContext
from omni_serve.graph.local import LocalGraph
from omni_serve.families.qwen_image_edit import FAMILY
from omni_serve.families.qwen_image_edit.frontend import ImageEditRequest, condition_size
from omni_serve.families.qwen_image_edit.messages import FinalLatents
from omni_serve.models.qwen_image_edit import EditPromptProcessor
from omni_serve.transport.memory import MemoryConnector
from tests.conftest import tiny_checkpoint
from tests.image_oracle import Result, assert_matches, assert_swaps_fail, pipeline_result, response_result

# Served latents differ from the pipeline's by float rounding only (other thread counts and batch partners change
# the order of sums: at most 1.2e-6 measured here). With random tiny weights the image barely reacts to the prompt:
# a swapped prompt moves the latents by 1.3e-4 to 4e-4 and the pixels by one level at most, a swapped input image
# by ~4e-3, a swapped seed by ~5 (PYTHONPATH=. python benchmarks/qwen_image_edit/edit_oracle_margins.py prints these). So the latents
# are compared at LATENT_ATOL = 1e-5, and the negative controls check a swap misses that by SWAP_MARGIN = 10x.


@pytest.fixture(scope="module")
def edit_dir() -> str:
    return tiny_checkpoint("qwen_image_edit")


def reference_pipeline(checkpoint: str):
    """diffusers' QwenImageEditPipeline on the checkpoint (its Qwen2VLProcessor needs torchvision, which has no
    CPU build here: the processor is transformers' tokenizer and image processor, as the served graph's)."""
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline.from_pretrained(checkpoint, processor=None)
    pipe.register_modules(processor=EditPromptProcessor.from_pretrained(checkpoint))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(edit_dir):
    return reference_pipeline(edit_dir)


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def solid_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def upload(data: bytes, name: str = "in.png") -> UploadFile:
    return UploadFile(io.BytesIO(data), filename=name, headers=Headers({"content-type": "image/png"}))


# References by (checkpoint, case), for the session: a pipeline call takes seconds on CPU (it encodes a ~1 MP
# conditioning image), and some edits are compared more than once: CASES[1] alone and in flight, and
# test_qwen_image_edit_graph.py's first edit and its swapped prompt and seed are CASES[0] and its swaps here. A
# reference is a function of the checkpoint and the case alone (each call seeds its own generator).
_REFERENCES: dict[tuple, Result] = {}


def reference(pipe, case: dict, pixels: bool = True) -> Result:
    """The pipeline's packed latents and (unless ``pixels`` is False) uint8 images for an edit case."""
    key = (pipe.name_or_path, tuple(sorted(case.items())))
    known = _REFERENCES.get(key)
    if known is None or (pixels and known.pixels is None):
        image = Image.open(io.BytesIO(case["image"])).convert("RGB")
        w, h = (int(v) for v in case["size"].split("x"))
        known = _REFERENCES[key] = pipeline_result(
            pipe, case["seed"], pixels, image=image, prompt=case["prompt"], negative_prompt=case.get("negative_prompt"),
            true_cfg_scale=case.get("true_cfg_scale", 4.0), height=h, width=w, num_inference_steps=case["steps"],
            num_images_per_prompt=case.get("n", 1))
    return known if pixels else Result(known.latents, None)


class Recording(MemoryConnector):
    """The in-process connector, keeping each request's final latents (the DiT -> VAE payload)."""

    def __init__(self):
        super().__init__()
        self.latents = {}

    async def put(self, key, payload):
        if isinstance(payload, FinalLatents):
            self.latents[key.split("/")[0]] = payload.latents
        await super().put(key, payload)


class RecordedGraph(LocalGraph):
    """The edit graph in process, remembering each request's seed (from its DiT call)."""

    def __init__(self, checkpoint: str, connector: Recording, **args):
        super().__init__(FAMILY, {"checkpoint": checkpoint, **args}, connector=connector)
        self.seeds = {}

    def _open(self, stage, call):
        if stage == "dit":
            self.seeds[call.seed] = call.request_id
        return super()._open(stage, call)


def request(case: dict) -> ImageEditRequest:
    fields = {k: v for k, v in case.items() if k not in ("image", "mask", "steps")}
    if "mask" in case:
        fields["mask"] = upload(case["mask"], "mask.png")
    return ImageEditRequest.model_validate({**fields, "image": [upload(case["image"])],
                                            "num_inference_steps": case["steps"], "return_latents": True})


async def serve(checkpoint: str, cases: list[dict], **args) -> list[tuple[Result, object, torch.Tensor]]:
    """(the latents and uint8 images of the response, the response, the final latents the DiT put on the data
    plane) for each case, all in flight at once."""
    connector = Recording()
    graph = RecordedGraph(checkpoint, connector, **args)
    try:
        responses = await asyncio.gather(*(graph.frontend.images_edits(request(c), RequestContext(timeout_s=600))
                                           for c in cases))
    finally:
        await graph.aclose()
    return [(response_result(r.data), r, connector.latents[graph.seeds[c["seed"]]])
            for c, r in zip(cases, responses)]


def test_checkpoint_loads_in_the_pipeline_and_drops_the_template_prefix(edit_dir, pipe):
    from omni_serve.checkpoints.qwen_image_edit import template_prefix_tokens

    assert type(pipe).__name__ == "QwenImageEditPipeline"
    assert template_prefix_tokens(pipe.processor.tokenizer) == pipe.prompt_template_encode_start_idx == 64
    assert pipe.text_encoder.config.vision_config.out_hidden_size == pipe.transformer.config.joint_attention_dim


def test_conditioning_size_is_the_pipelines(pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    for w, h in [(80, 48), (48, 80), (64, 64), (1920, 1080), (333, 999), (17, 3000)]:
        assert condition_size(w, h) == calculate_dimensions(1024 * 1024, w / h)[:2]


CASES = [
    {"prompt": "make the sky red", "image": png(80, 48, 1), "size": "64x64", "steps": 2, "seed": 1},
    {"prompt": "add a cat", "image": png(48, 80, 2), "size": "96x64", "steps": 3, "seed": 2,
     "negative_prompt": "blurry", "true_cfg_scale": 3.0},
    {"prompt": "a house by the sea", "image": png(64, 64, 3), "size": "64x96", "steps": 2, "seed": 3, "n": 2},
    {"prompt": "turn it blue", "image": png(80, 48, 4), "size": "64x64", "steps": 4, "seed": 4},
    {"prompt": "winter", "image": png(72, 72, 5), "size": "64x64", "steps": 2, "seed": 5,
     "negative_prompt": " ", "true_cfg_scale": 2.0},
    {"prompt": "make the sky red", "image": png(80, 48, 6), "size": "64x64", "steps": 3, "seed": 6},
]


def test_one_edit_equals_the_pipeline(edit_dir, pipe):
    case = CASES[1]
    [(got, response, on_the_data_plane)] = asyncio.run(serve(edit_dir, [case]))
    assert torch.equal(got.latents, on_the_data_plane)  # return_latents: exactly what the VAE decoded
    assert_matches(got, reference(pipe, case), case["prompt"], pixel_levels=0)
    assert response.metrics.true_cfg and response.metrics.num_inference_steps == case["steps"]


def swapped_references(pipe, i: int, pixels: bool = True) -> dict[str, Result]:
    """The references of edit ``i`` with the next edit's prompt, seed or input image (a mix-up between requests in
    flight together)."""
    other = CASES[(i + 1) % len(CASES)]
    return {key: reference(pipe, {**CASES[i], key: other[key]}, pixels) for key in ("prompt", "seed", "image")}


def test_six_edits_in_flight_equal_the_pipeline_and_a_swap_fails(edit_dir, pipe):
    served = asyncio.run(serve(edit_dir, CASES))
    positives = [assert_matches(got, reference(pipe, case), case["prompt"]) for case, (got, _, _) in zip(CASES, served)]
    # Negative controls: the same comparison fails for the first edit's reference with the next edit's prompt, seed
    # or input image (latents only: each edit reference encodes a ~1 MP conditioning image, seconds on CPU).
    assert_swaps_fail(served[0][0], swapped_references(pipe, 0, pixels=False), positives[0], CASES[0]["prompt"])


def openai_mask(width: int, height: int, edit: tuple[slice, slice]) -> bytes:
    """OpenAI's mask: an RGBA PNG, fully transparent where the image is edited."""
    rgba = np.full((height, width, 4), 255, np.uint8)
    rgba[edit + (3,)] = 0
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def _inpaint_pipeline(checkpoint: str):
    from diffusers import QwenImageEditInpaintPipeline

    pipe = QwenImageEditInpaintPipeline.from_pretrained(checkpoint, processor=None)
    pipe.register_modules(processor=EditPromptProcessor.from_pretrained(checkpoint))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def inpaint_reference(checkpoint: str, case: dict, pixels: bool = True) -> Result:
    """diffusers' QwenImageEditInpaintPipeline on the case, its mask in diffusers' convention (white: repaint)."""
    pipe = _inpaint_pipeline(checkpoint)  # loaded once: a call keeps no state (each seeds its own generator)
    alpha = np.asarray(Image.open(io.BytesIO(case["mask"])))[..., 3]
    kwargs = dict(image=Image.open(io.BytesIO(case["image"])).convert("RGB"), prompt=case["prompt"],
                  mask_image=Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), "L"),
                  negative_prompt=case.get("negative_prompt"), true_cfg_scale=case.get("true_cfg_scale", 4.0),
                  num_inference_steps=case["steps"], strength=case.get("strength", 1.0))
    return pipeline_result(pipe, case["seed"], pixels, **kwargs)


LEFT, TOP = (slice(None), slice(0, 40)), (slice(0, 20), slice(None))
INPAINT = [
    {"prompt": "a cat", "image": png(80, 48, 7), "mask": openai_mask(80, 48, LEFT), "steps": 3, "seed": 7,
     "negative_prompt": " ", "true_cfg_scale": 2.0},
    {"prompt": "snow", "image": png(80, 48, 8), "mask": openai_mask(80, 48, TOP), "steps": 3, "seed": 8,
     "strength": 0.6},
]


def test_edits_with_a_mask_equal_the_inpainting_pipeline(edit_dir):
    """Two inpainting edits in flight (the whole masked area repainted with CFG; 60% of the way): latents and
    pixels of diffusers' inpainting pipeline (the VAE decodes untiled, as the pipeline). A swapped mask fails."""
    served = asyncio.run(serve(edit_dir, INPAINT, **{"stages.vae.params.tile_min_pixels": None}))
    assert all(got.pixels.shape == (1, 800, 1312, 3) for got, _, _ in served)  # the conditioning size of 80x48
    try:
        positives = [assert_matches(got, inpaint_reference(edit_dir, case), case["prompt"])
                     for case, (got, _, _) in zip(INPAINT, served)]
        assert served[1][1].metrics.num_inference_steps == 2  # the last 3 - int(3 - 3 * 0.6) of the 3 steps run
        swapped = {"mask": inpaint_reference(edit_dir, {**INPAINT[0], "mask": openai_mask(80, 48, TOP)},
                                             pixels=False),
                   "seed": inpaint_reference(edit_dir, {**INPAINT[0], "seed": INPAINT[1]["seed"]}, pixels=False)}
        assert_swaps_fail(served[0][0], swapped, positives[0], "inpainting " + INPAINT[0]["prompt"])
    finally:
        _inpaint_pipeline.cache_clear()  # its memory goes with the test


def _bad(edit_dir, **fields):
    """The 400 of an edit with ``fields``; no stage call was opened and nothing put on the data plane."""
    connector = Recording()
    graph = RecordedGraph(edit_dir, connector, max_input_pixels=10_000, max_input_bytes=20_000)
    opened = []
    graph.stages._open = lambda stage, call: opened.append(stage)  # what the ingress side would open

    async def main():
        try:
            req = ImageEditRequest.model_validate({"prompt": "x", "size": "64x64", **fields})
            await graph.frontend.images_edits(req, RequestContext(timeout_s=60))
        finally:
            await graph.aclose()
    with pytest.raises(OpenAIError) as info:
        asyncio.run(main())
    assert opened == [] and connector.stats() == {"unread": 0}
    return info.value


@pytest.mark.parametrize("fields, param, words", [
    ({}, "image", "image is required"),
    ({"image": [upload(b"not a png")]}, "image", "not an image in an accepted format"),
    ({"image": [upload(solid_png(120, 100))]}, "image", "too large (120x100"),
    ({"image": [upload(b"x" * 20_001)]}, "image", "too large (more than 20000 bytes"),
    ({"image": [upload(png(8, 8, 0))], "image[]": [upload(png(8, 8, 1))]}, "image", "one image at a time"),
    ({"image": [upload(solid_png(400, 1))]}, "image", "aspect ratio must be at most 200:1"),
    ({"image": [upload(png(8, 8, 0))], "mask": upload(openai_mask(8, 6, LEFT))}, "mask",
     "mask size 8x6 does not match the image's 8x8"),
    ({"image": [upload(png(8, 8, 0))], "mask": upload(png(8, 8, 1))}, "mask", "no fully transparent pixel"),
    ({"image": [upload(png(8, 8, 0))], "strength": 0.5}, "strength", "applies to edits with a mask"),
    ({"image": [upload(png(8, 8, 0))], "mask": upload(openai_mask(8, 8, LEFT)), "size": "64x64"}, "size",
     "keeps the input image's size"),
    ({"image": [upload(png(8, 8, 0))], "size": "50x50"}, "size", "multiples of 16"),
    ({"image": [upload(png(8, 8, 0))], "n": 99}, "n", "between 1"),
])
def test_bad_edits_are_400s_before_any_stage_runs(edit_dir, fields, param, words):
    err = _bad(edit_dir, **fields)
    assert err.status_code == 400 and err.param == param and words in err.message, err.message
