"""``PreparedBigVGAN``: Qwen2.5-Omni's vocoder with prepared anti-aliased activations equals the module's forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_serve.models.qwen2_5_omni import OmniCode2Wav
from omni_serve.models.qwen2_5_omni_vocoder import PreparedBigVGAN, _DownFIR, _UpFIR


@pytest.fixture(scope="module")
def vocoder(omni_tiny_dir):
    return OmniCode2Wav(omni_tiny_dir).vocoder


@pytest.mark.parametrize("frames", [1, 5, 37])
def test_prepared_vocoder_equals_the_module(vocoder, frames):
    g = torch.Generator().manual_seed(frames)
    mel = torch.randn(1, vocoder.config.mel_dim, frames, generator=g) - 4
    with torch.inference_mode():
        want = vocoder(mel).reshape(-1)
        got = PreparedBigVGAN(vocoder)(mel)
        other = PreparedBigVGAN(vocoder)(mel.roll(1, dims=1))  # negative control: mel bins mixed up
    assert got.shape == want.shape
    scale = float(want.abs().max())
    assert scale > 0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
    assert float((other - want).abs().max()) > 1e-2 * scale


@pytest.mark.parametrize("channels,length", [(3, 1), (4, 15), (32, 16), (8, 333)])
def test_banded_fir_products_equal_the_depthwise_convolutions(channels, length):
    """The upsample (transposed conv, padded, cropped) and downsample (strided conv) as banded products, for signal
    lengths below, at and off the product's block; a filter reversed (mixed-up taps) does not match."""
    g = torch.Generator().manual_seed(length)
    taps = torch.randn(12, generator=g)
    x = torch.randn(1, channels, length, generator=g)
    weight = taps.view(1, 1, -1).expand(channels, -1, -1)
    padded = F.pad(x, (5, 5), mode="replicate")
    want_up = F.conv_transpose1d(padded, weight, stride=2, groups=channels)[..., 15:15 + 2 * length]
    assert _UpFIR.applies(taps, 15)
    torch.testing.assert_close(_UpFIR(taps, 2, 15)(padded, length), want_up, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_UpFIR(taps.flip(0), 2, 15)(padded, length), want_up, atol=1e-3)
    padded = F.pad(want_up, (5, 6), mode="replicate")
    want_down = F.conv1d(padded, weight, stride=2, groups=channels)
    torch.testing.assert_close(_DownFIR(taps, 2)(padded), want_down, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_DownFIR(taps.flip(0), 2)(padded), want_down, atol=1e-3)
