"""The tiny random-weight Wan 2.1 checkpoint loads in diffusers' ``WanPipeline``, generates a video, reacts to its
prompt, and is deterministic; its tokenizer has UMT5's special ids."""

from __future__ import annotations

import json
import os

import pytest
import torch

from omni_serve.checkpoints.wan import SCHEDULER_CONFIG, Z_DIM, make_checkpoint
from tests.unit.test_qwen_image_checkpoint import _safetensors


@pytest.fixture(scope="module")
def pipe(wan_tiny_dir):
    from diffusers import WanPipeline

    p = WanPipeline.from_pretrained(wan_tiny_dir)
    p.set_progress_bar_config(disable=True)
    return p


def _latents(pipe, prompt: str, seed: int = 0, **kw) -> torch.Tensor:
    return pipe(prompt, height=16, width=32, num_frames=5, num_inference_steps=2, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(seed), output_type="latent", **kw).frames


def test_layout_and_configs(wan_tiny_dir, pipe):
    with open(os.path.join(wan_tiny_dir, "omni_serve_checkpoint.json")) as f:
        assert json.load(f) == {"family": "wan", "size": "tiny", "seed": 0}
    for key, value in SCHEDULER_CONFIG.items():
        assert pipe.scheduler.config[key] == value, key
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    t, v = pipe.transformer.config, pipe.vae.config
    assert pipe.text_encoder.config.d_model == t.text_dim
    assert v.z_dim == t.in_channels == t.out_channels == Z_DIM
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (8, 4)
    tok = pipe.tokenizer
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("a red cat").input_ids
    assert ids[-1] == 1 and 2 not in ids  # </s> appended; every word known


def test_a_video_of_the_requested_shape_that_follows_its_prompt_and_seed(pipe):
    video = pipe("a red cat", height=16, width=32, num_frames=5, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert video.shape == (1, 5, 16, 32, 3) and video.min() >= 0 and video.max() <= 1
    a = _latents(pipe, "a red cat", negative_prompt="blurry")
    assert a.shape == (1, Z_DIM, 2, 2, 4) and torch.isfinite(a).all()
    assert torch.equal(a, _latents(pipe, "a red cat", negative_prompt="blurry"))
    # random tiny weights barely react to the prompt, but they do: well above float rounding
    assert (a - _latents(pipe, "a green tree by the sea", negative_prompt="blurry")).abs().max() > 1e-4
    assert (a - _latents(pipe, "a red cat", seed=1, negative_prompt="blurry")).abs().max() > 1e-1


def test_rewrite_is_byte_identical(wan_tiny_dir, tmp_path):
    again = make_checkpoint(str(tmp_path / "again"), "tiny", seed=0)
    first, second = _safetensors(wan_tiny_dir), _safetensors(again)
    assert sorted(first) == [
        "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert first == second
    other = _safetensors(make_checkpoint(str(tmp_path / "other"), "tiny", seed=1))
    assert all(first[k] != other[k] for k in first)
