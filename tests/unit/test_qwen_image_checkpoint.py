"""The tiny random-weight Qwen-Image checkpoint loads in diffusers' ``QwenImagePipeline`` and is deterministic."""

from __future__ import annotations

import json
import os

import pytest
import torch

from omni_serve.checkpoints.qwen_image import SCHEDULER_CONFIG, make_checkpoint, template_prefix_tokens

PROMPT = "a red cat under the blue sky"


@pytest.fixture(scope="module")
def pipe(qwen_image_tiny_dir):
    from diffusers import QwenImagePipeline

    p = QwenImagePipeline.from_pretrained(qwen_image_tiny_dir)
    p.set_progress_bar_config(disable=True)
    return p


def _run(pipe, **kw):
    kw.setdefault("true_cfg_scale", 1.0)
    gen = torch.Generator().manual_seed(0)
    return pipe(PROMPT, height=64, width=64, num_inference_steps=2, generator=gen, output_type="pt", **kw).images


def _safetensors(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".safetensors"):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


def test_layout_and_configs(qwen_image_tiny_dir, pipe):
    with open(os.path.join(qwen_image_tiny_dir, "omni_serve_checkpoint.json")) as f:
        assert json.load(f) == {"family": "qwen_image", "size": "tiny", "seed": 0}
    for key, value in SCHEDULER_CONFIG.items():
        assert pipe.scheduler.config[key] == value, key
    tcfg, vcfg = pipe.transformer.config, pipe.vae.config
    assert pipe.text_encoder.config.text_config.hidden_size == tcfg.joint_attention_dim
    assert vcfg.z_dim == tcfg.in_channels // 4 == tcfg.out_channels
    assert len(vcfg.latents_mean) == len(vcfg.latents_std) == vcfg.z_dim
    assert pipe.vae_scale_factor == 8
    for tok in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|image_pad|>", "<|video_pad|>"):
        assert pipe.tokenizer.convert_tokens_to_ids(tok) is not None
    te = pipe.text_encoder.config
    assert pipe.tokenizer.convert_ids_to_tokens(te.image_token_id) == "<|image_pad|>"
    assert pipe.tokenizer.convert_ids_to_tokens(te.vision_start_token_id) == "<|vision_start|>"


def test_seeded_calls_are_identical(pipe):
    a = _run(pipe)
    b = _run(pipe)
    assert a.shape == (1, 3, 64, 64)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)


def test_true_cfg_call_runs(pipe):
    out = _run(pipe, negative_prompt="blurry", true_cfg_scale=4.0)
    assert out.shape == (1, 3, 64, 64)
    assert torch.isfinite(out).all()


def test_rewrite_is_byte_identical(qwen_image_tiny_dir, tmp_path):
    again = make_checkpoint(str(tmp_path / "again"), "tiny", seed=0)
    first, second = _safetensors(qwen_image_tiny_dir), _safetensors(again)
    assert sorted(first) == [
        "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert first == second


def test_prompt_template_prefix_is_the_34_tokens_the_pipeline_drops(pipe):
    assert template_prefix_tokens(pipe.tokenizer) == pipe.prompt_template_encode_start_idx == 34
