"""Qwen2.5-Omni's BigVGAN vocoder run from transformers' own modules, with less work per anti-aliased activation.

Contract: ``PreparedBigVGAN(vocoder)(mel [1, mel_dim, frames]) -> [frames * samples_per_frame]`` float32 samples:
what ``Qwen2_5OmniToken2WavBigVGANModel.forward`` returns (clamped to [-1, 1]), to float rounding (checked by
``tests/unit/test_qwen2_5_omni_vocoder.py`` against the module, and by the oracle tests against transformers' whole
token2wav). The other convolutions are the vocoder's own modules, called as they are; nothing is copied but the
activations' constants.

Why: the anti-aliased SnakeBeta activations (upsample x2, snake, downsample x2; six per residual block and one at
the end) are ~3/4 of the vocoder's time on CPU (one thread, 208 frames on the small checkpoint: 130 ms through the
module, 85 ms prepared), and most of it is avoidable:
- the up- and downsampling filters are depthwise convolutions, which oneDNN runs one channel per vector lane: with
  4-32 channels and signals of 10^4-10^5 samples most of each vector is idle. They run as banded products instead
  (``_UpFIR``, ``_DownFIR``: 2.5-6x faster upsampling, 1.3-3.6x faster downsampling up to 32 channels; above that
  the convolution is as fast and is kept);
- ``F.pad(mode="replicate")`` costs 150 us here against ~35 us for the same values concatenated from edge views;
- the upsample's ``ratio *`` is a pass over the upsampled signal: the ratio goes into the filter instead;
- SnakeBeta recomputes ``exp(alpha)``, ``exp(beta)`` and ``1 / (beta + eps)`` on every call and squares with
  ``pow``: they are computed once, and ``x + sin(x * a)^2 / b`` is three passes and one ``addcmul``.
Measured and not kept: polyphase slices and a batch-of-channels convolution (both slower than the depthwise
convolution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _replicate_pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``F.pad(x, (left, right), mode="replicate")`` on the last axis (the same values)."""
    parts = [x[..., :1].expand(*x.shape[:-1], left)] if left else []
    parts.append(x)
    if right:
        parts.append(x[..., -1:].expand(*x.shape[:-1], right))
    return torch.cat(parts, dim=-1)


_BLOCK = 16  # outputs (downsample) or inputs (upsample) per row of the banded products; measured best of 8-64


def _banded_product(x: torch.Tensor, matrix: torch.Tensor, step: int, length: int) -> torch.Tensor:
    """Rows of ``matrix.shape[0]`` samples of ``x [1, C, L]`` every ``step`` samples, times ``matrix``, laid end to end
    and cut to ``length``: a depthwise FIR filter with its taps in a banded ``matrix``. Zeros past ``x``'s end feed
    only outputs beyond ``length``."""
    window = matrix.shape[0]
    blocks = -(-length // matrix.shape[1])
    short = (blocks - 1) * step + window - x.shape[-1]
    if short > 0:
        x = F.pad(x, (0, short))
    rows = x.unfold(-1, window, step)  # [1, C, blocks, window], overlapping views
    out = torch.mm(rows.reshape(-1, window), matrix)  # one copy of the rows, one product
    return out.view(*rows.shape[:-2], -1)[..., :length]


class _UpFIR:
    """The upsample's transposed depthwise convolution (stride ``s``, filter ``f`` times the ratio) followed by its
    crop, as one product: every ``_BLOCK`` input samples give ``s * _BLOCK`` outputs through a fixed banded matrix
    ``[window, s * _BLOCK]`` (the filter's taps, zeros elsewhere: adding a zero product leaves a float sum as it
    is). The depthwise convolution runs one channel per vector lane, so with few channels and long signals it
    wastes most of each vector: measured on one thread, 2.5-6x slower than this product at 4-128 channels."""

    def __init__(self, taps: torch.Tensor, stride: int, crop_left: int):
        k = taps.shape[0]
        self.stride, self.offset = stride, -(-(crop_left - k + 1) // stride)  # first input sample a block reads
        window = (crop_left + stride * _BLOCK - 1) // stride - self.offset + 1
        matrix = torch.zeros(window, stride * _BLOCK, dtype=taps.dtype, device=taps.device)
        for i in range(window):
            for o in range(stride * _BLOCK):
                j = crop_left + o - stride * (self.offset + i)
                if 0 <= j < k:
                    matrix[i, o] = taps[j]
        self.matrix = matrix

    @staticmethod
    def applies(taps: torch.Tensor, crop_left: int) -> bool:
        return crop_left >= taps.shape[0] - 1  # no output reads before the padded signal's start

    def __call__(self, padded: torch.Tensor, length: int) -> torch.Tensor:
        """``padded [1, C, L]`` (replicate-padded input) -> the cropped upsampled ``[1, C, stride * length]``."""
        return _banded_product(padded[..., self.offset:], self.matrix, _BLOCK, self.stride * length)


class _DownFIR:
    """The downsample's strided depthwise convolution as one banded product (see ``_UpFIR``): each row of
    ``_BLOCK`` outputs reads ``stride * (_BLOCK - 1) + taps`` padded inputs. Used below ``MAX_CHANNELS`` channels,
    where it is faster than the convolution (measured: 1.3-3.6x at 4-32 channels, equal at 64, slower at 128)."""

    MAX_CHANNELS = 32

    def __init__(self, taps: torch.Tensor, stride: int):
        k = taps.shape[0]
        self.stride, self.taps = stride, k
        matrix = torch.zeros(stride * (_BLOCK - 1) + k, _BLOCK, dtype=taps.dtype, device=taps.device)
        for t in range(_BLOCK):
            matrix[stride * t:stride * t + k, t] = taps
        self.matrix = matrix

    def __call__(self, padded: torch.Tensor) -> torch.Tensor:
        length = (padded.shape[-1] - self.taps) // self.stride + 1
        return _banded_product(padded, self.matrix, self.stride * _BLOCK, length)


@dataclass(frozen=True)
class _Activation:
    """One ``Qwen2_5OmniAntiAliasedActivation1d`` (SnakeBeta between an x2 upsample and an x2 downsample)."""

    up_filter: torch.Tensor  # [C, 1, K] times the ratio
    up_stride: int
    up_pad: int
    up_crop: tuple[int, int]
    up_fir: _UpFIR | None
    alpha: torch.Tensor  # [1, C, 1] exp(alpha)
    inv_beta: torch.Tensor  # [1, C, 1] 1 / (exp(beta) + eps)
    down_filter: torch.Tensor  # [C, 1, K]
    down_stride: int
    down_pad: tuple[int, int]
    down_fir: _DownFIR | None

    @classmethod
    def of(cls, module) -> _Activation:
        up, snake, down = module.upsample, module.act, module.downsample
        channels = snake.alpha.shape[0]
        with torch.no_grad():
            alpha = torch.exp(snake.alpha.detach()).view(1, -1, 1)
            inv_beta = (1.0 / (torch.exp(snake.beta.detach()) + snake.no_div_by_zero)).view(1, -1, 1)
            up_taps, down_taps = (up.filter * up.ratio).reshape(-1), down.filter.reshape(-1)
            up_fir = _UpFIR(up_taps, up.stride, up.pad_left) if _UpFIR.applies(up_taps, up.pad_left) else None
            down_fir = _DownFIR(down_taps, down.stride) if channels <= _DownFIR.MAX_CHANNELS else None
        return cls(up_taps.view(1, 1, -1).expand(channels, -1, -1).contiguous(), up.stride, up.pad,
                   (up.pad_left, up.pad_right), up_fir, alpha, inv_beta,
                   down_taps.view(1, 1, -1).expand(channels, -1, -1).contiguous(), down.stride,
                   (down.pad_left, down.pad_right), down_fir)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        channels, length = x.shape[1], x.shape[-1]
        padded = _replicate_pad(x, self.up_pad, self.up_pad)
        if self.up_fir is not None:
            x = self.up_fir(padded, length)
        else:
            x = F.conv_transpose1d(padded, self.up_filter, stride=self.up_stride, groups=channels)
            left, right = self.up_crop
            x = x[..., left:x.shape[-1] - right]
        wave = torch.sin(x * self.alpha)
        wave.mul_(wave)
        x = torch.addcmul(x, wave, self.inv_beta)  # SnakeBeta: x + sin(alpha x)^2 / beta
        padded = _replicate_pad(x, *self.down_pad)
        if self.down_fir is not None:
            return self.down_fir(padded)
        return F.conv1d(padded, self.down_filter, stride=self.down_stride, groups=channels)


def check_vocoder(vocoder) -> None:
    """Refuse a vocoder whose structure ``PreparedBigVGAN`` does not reproduce (a changed transformers version)."""
    needed = ("conv_pre", "ups", "resblocks", "activation_post", "conv_post", "process_mel_spectrogram",
              "num_residual_blocks", "num_upsample_layers")
    block = vocoder.resblocks[0] if len(getattr(vocoder, "resblocks", ())) else None
    act = getattr(vocoder, "activation_post", None)
    ok = (all(hasattr(vocoder, a) for a in needed) and block is not None
          and all(hasattr(block, a) for a in ("convs1", "convs2", "activations"))
          and all(hasattr(act, a) for a in ("upsample", "act", "downsample"))
          and all(hasattr(act.act, a) for a in ("alpha", "beta", "no_div_by_zero"))
          and all(hasattr(act.upsample, a) for a in ("filter", "ratio", "stride", "pad", "pad_left", "pad_right"))
          and all(hasattr(act.downsample, a) for a in ("filter", "stride", "pad_left", "pad_right")))
    if not ok:
        raise TypeError(f"{type(vocoder).__name__} is not the BigVGAN omni_serve's code2wav reproduces "
                        "(AMP blocks of anti-aliased SnakeBeta activations); check the installed transformers version")


class PreparedBigVGAN:
    """The vocoder's forward with prepared activations (see the module docstring)."""

    @staticmethod
    def supports(vocoder) -> bool:
        """Whether ``vocoder`` has the structure this class reproduces."""
        try:
            check_vocoder(vocoder)
        except TypeError:
            return False
        return True

    def __init__(self, vocoder):
        check_vocoder(vocoder)
        self.vocoder = vocoder
        self.blocks = [(block, [_Activation.of(a) for a in block.activations]) for block in vocoder.resblocks]
        self.post = _Activation.of(vocoder.activation_post)

    @staticmethod
    def _amp_block(block, acts: list[_Activation], x: torch.Tensor) -> torch.Tensor:
        """``Qwen2_5OmniAMPBlock.forward``: pairs of (activation, dilated conv, activation, conv) with a residual."""
        for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, acts[::2], acts[1::2]):
            x = x + conv2(act2(conv1(act1(x))))
        return x

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor) -> torch.Tensor:
        v = self.vocoder
        x = v.conv_pre(v.process_mel_spectrogram(mel))
        per = v.num_residual_blocks
        for i in range(v.num_upsample_layers):
            x = v.ups[i][0](x)
            x = sum(self._amp_block(*self.blocks[i * per + j], x) for j in range(per)) / per
        out = v.conv_post(self.post(x))
        return torch.clamp(out, min=-1.0, max=1.0).reshape(-1)
