"""Qwen-Image's packed forward (``omni_serve.models.qwen_image_packed``): rows of different text lengths, packed
without padding, each equal to diffusers' transformer forward on that row alone; conditioning latents (the edit
layout) likewise; a swapped text fails the comparison; variants it does not cover fall back to diffusers' forward."""

from __future__ import annotations

import pytest
import torch

from omni_serve.models.qwen_image import DenoiseRow, QwenImageDenoiser
from omni_serve.models.qwen_image_packed import PackedForward, supports

ATOL = 2e-5  # float32 rounding of a few batched matmuls and attention sums


@pytest.fixture(scope="module")
def denoiser(qwen_image_tiny_dir):
    return QwenImageDenoiser(qwen_image_tiny_dir)


def _rows(model, grid, lengths, condition=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens, channels = grid[0] * grid[1], model.num_channels_latents * 4
    dim = model.transformer.config.joint_attention_dim
    return [DenoiseRow(torch.randn(tokens, channels, generator=g), torch.tensor(90.0 * i + 30),
                       torch.randn(n, dim, generator=g), None,
                       torch.randn(tokens, channels, generator=g) if condition else None)
            for i, n in enumerate(lengths)]


def _alone(model, rows, grid, condition_grid=None):
    """diffusers' forward on each row by itself (a batch of one)."""
    with torch.inference_mode():
        return torch.cat([model.predict([r], grid, forward=model.plain_forward, condition_grid=condition_grid)
                          for r in rows])


@pytest.mark.parametrize("lengths", [[7, 3, 12, 3, 1], [5, 5], [9]], ids=["mixed", "equal", "one"])
def test_packed_rows_equal_each_row_alone(denoiser, lengths):
    grid = denoiser.latent_grid(64, 64)
    rows = _rows(denoiser, grid, lengths)
    with torch.inference_mode():
        packed = denoiser.predict(rows, grid)  # the packed path (the tiny transformer is covered)
        padded = denoiser.predict(rows, grid, forward=denoiser.plain_forward)  # diffusers: padded and masked
    alone = _alone(denoiser, rows, grid)
    torch.testing.assert_close(packed, alone, rtol=0, atol=ATOL)
    torch.testing.assert_close(padded, alone, rtol=0, atol=ATOL)


def test_conditioning_latents_follow_the_noised_ones(denoiser):
    grid = denoiser.latent_grid(64, 64)
    rows = _rows(denoiser, grid, [4, 9, 2], condition=True)
    with torch.inference_mode():
        packed = denoiser.predict(rows, grid, condition_grid=grid)
    torch.testing.assert_close(packed, _alone(denoiser, rows, grid, condition_grid=grid), rtol=0, atol=ATOL)


def test_a_swapped_text_fails_the_comparison(denoiser):
    """Negative control: the texts of two rows of equal length swapped; the comparison must fail by far."""
    grid = denoiser.latent_grid(64, 64)
    rows = _rows(denoiser, grid, [6, 6, 3])
    alone = _alone(denoiser, rows, grid)
    rows[0].text, rows[1].text = rows[1].text, rows[0].text
    with torch.inference_mode():
        swapped = denoiser.predict(rows, grid)
    assert (swapped[:2] - alone[:2]).abs().max() > 100 * ATOL
    torch.testing.assert_close(swapped[2], alone[2], rtol=0, atol=ATOL)  # the untouched row still matches


def test_uncovered_variants_keep_diffusers_forward(denoiser):
    class Config(dict):
        def get(self, key, default=None):
            return super().get(key, default)

    class Variant:
        config = Config(zero_cond_t=True)
    assert supports(denoiser.transformer) and not supports(Variant())
    with pytest.raises(ValueError, match="zero_cond_t"):
        PackedForward(Variant())


def test_the_spec_switch_keeps_diffusers_forward(qwen_image_tiny_dir, denoiser):
    """``stages.dit.params.packed_forward: false``: the stage's denoiser runs diffusers' padded forward (the same
    predictions), and the path is recorded for /health."""
    from omni_kernels import kernel_paths

    from omni_serve.families.qwen_image import FAMILY
    from omni_serve.graph.runner import build_runner

    runner = build_runner(FAMILY, "dit", {"checkpoint": qwen_image_tiny_dir,
                                          "stages": {"dit": {"params": {"packed_forward": False}}}})
    assert runner.model.packed is None
    assert kernel_paths()["qwen_image.transformer"] == {"path": "library", "reason": "params.packed_forward is false"}
    grid = denoiser.latent_grid(64, 64)
    rows = _rows(denoiser, grid, [7, 3])
    with torch.inference_mode():
        torch.testing.assert_close(runner.model.predict(rows, grid), denoiser.predict(rows, grid), rtol=0, atol=ATOL)
