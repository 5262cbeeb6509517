"""Qwen2.5-Omni code2wav's prepared paths under the rule of docs/prepared.md: each equals the library path it
replaces (``PreparedDiT`` vs transformers' ``DiTDecoderLayer`` window by window; ``PreparedBigVGAN`` vs the
vocoder's forward, in ``test_qwen2_5_omni_vocoder.py``), with a negative control; each has a ``supports()``
guard and a spec switch, and either way the path taken is recorded for ``/health``."""

from __future__ import annotations

import pytest
import torch

from omni_kernels import kernel_paths
from omni_serve.families.qwen2_5_omni import FAMILY
from omni_serve.graph.runner import build_runner
from omni_serve.models.qwen2_5_omni import DiTWindow, OmniCode2Wav
from omni_serve.models.qwen2_5_omni_dit import LibraryDiT, PreparedDiT
from omni_serve.models.qwen2_5_omni_vocoder import PreparedBigVGAN

STEPS = 3
# float32 both ways; the prepared blocks fuse and reorder products (q/k/v in one, tanh-GELU fused, scale folded,
# attention block by block), so the mels agree to rounding, not bit for bit: ~1.5e-7 of the mel's largest value
# on the tiny checkpoint. Reversing a window's codes (the negative control) moves it by ~4e-3 of it.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(omni_tiny_dir):
    return OmniCode2Wav(omni_tiny_dir), OmniCode2Wav(omni_tiny_dir, prepared_dit=False, prepared_vocoder=False)


def _windows(c2w, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [DiTWindow(codes=torch.randint(0, 8000, (n,), generator=g).tolist(),
                      noise=torch.randn(c2w.repeats * n, c2w.mel_dim, generator=g), voice=voice)
            for n, voice in zip(lengths, ["Chelsie", "Ethan"] * len(lengths))]


def test_prepared_dit_equals_transformers_layers_window_by_window(models):
    prepared, library = models
    assert isinstance(prepared.prepared, PreparedDiT) and isinstance(library.prepared, LibraryDiT)
    lengths = [prepared.block_codes * 3, 37, prepared.block_codes, 5]  # whole blocks and not, one call
    windows = _windows(prepared, lengths, seed=3)
    got, want = prepared.dit_windows(windows, num_steps=STEPS), library.dit_windows(windows, num_steps=STEPS)
    for g, w in zip(got, want):
        scale = float(w.abs().max())
        assert g.shape == w.shape and scale > 0
        torch.testing.assert_close(g, w, rtol=0, atol=TOLERANCE * scale)
    # negative control: the library path on another window's codes is far outside the tolerance
    mixed = [DiTWindow(windows[1].codes[::-1], windows[1].noise, windows[1].voice)]
    other = library.dit_windows(mixed, num_steps=STEPS)[0]
    assert float((other - want[1]).abs().max()) > 100 * TOLERANCE * float(want[1].abs().max())


def test_the_library_vocoder_is_the_modules_forward(models):
    _, library = models
    mel = torch.randn(library.mel_dim, 11, generator=torch.Generator().manual_seed(0)) - 4
    with torch.inference_mode():
        assert torch.equal(library.vocode(mel), library.vocoder(mel.unsqueeze(0)).reshape(-1))


def test_an_unsupported_module_falls_back_to_the_library_and_says_why(omni_tiny_dir, monkeypatch):
    monkeypatch.setattr(PreparedDiT, "supports", staticmethod(lambda dit: False))
    monkeypatch.setattr(PreparedBigVGAN, "supports", staticmethod(lambda vocoder: False))
    c2w = OmniCode2Wav(omni_tiny_dir)
    assert isinstance(c2w.prepared, LibraryDiT) and not isinstance(c2w.prepared_vocoder, PreparedBigVGAN)
    paths = kernel_paths()
    assert paths["code2wav.dit"]["path"] == "library" and "not the structure" in paths["code2wav.dit"]["reason"]
    assert paths["code2wav.vocoder"]["path"] == "library"


def test_the_real_modules_are_supported(models):
    prepared, _ = models
    assert PreparedDiT.supports(prepared.dit) and PreparedBigVGAN.supports(prepared.vocoder)
    broken = torch.nn.Module()
    broken.transformer_blocks = [torch.nn.Linear(2, 2)]
    assert not PreparedDiT.supports(broken) and not PreparedBigVGAN.supports(broken)


def test_the_spec_switches_reach_the_stage(omni_tiny_dir):
    runner = build_runner(FAMILY, "code2wav", {"checkpoint": omni_tiny_dir,
                                                "stages": {"code2wav": {"params": {"prepared_dit": False}}}})
    assert isinstance(runner.model.prepared, LibraryDiT)
    assert isinstance(runner.model.prepared_vocoder, PreparedBigVGAN)
    assert kernel_paths()["code2wav.dit"] == {"path": "library", "reason": "params.prepared_dit is false"}
