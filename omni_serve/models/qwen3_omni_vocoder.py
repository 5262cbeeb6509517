"""Qwen3-Omni's code2wav decoded as a stream: frames in, final samples out, nothing computed twice.

Contract: ``VocoderStream`` is one request's decoding state (attention cache of the transformer, the left
context of every causal convolution, the last input of every overlapping transposed convolution).
``StreamingCode2Wav(model).feed(stream, codes [G, m]) -> samples`` runs transformers' ``Qwen3OmniMoeCode2Wav``
modules, in the order of its ``forward``, on the ``m`` new frames only, and returns every output sample that is
final now. Fed a sequence in pieces, the concatenated samples equal one ``forward`` on the whole sequence
(float tolerance); a fresh stream is the reference's zero-padded start.

Why this is exact, module by module (stride-1 causal convolutions, transposed convolutions, pointwise ops):
- the transformer is causal (sliding-window attention): new frames attend to the cached keys/values;
- ``Qwen3OmniMoeCausalConvNet`` (stride 1) left-pads its input with ``k - 1`` zeros; streamed, the pad is the
  previous input's last ``k - 1`` samples instead (a pre-hook on its inner ``Conv1d`` writes them over the zeros
  of the freshly padded input, which the module made for this call only: no copy of the activation, and the
  convolution's output is exactly the new samples);
- ``Qwen3OmniMoeCausalTransConvNet`` with kernel 2r and stride r trims r samples on each side, so its output
  sample q depends on inputs q // r and q // r + 1: the last input's outputs are not final until the next one
  comes. Streamed, each call prepends the previous call's last input (a pre-hook): the module's own trimming then
  yields exactly the newly final samples. With kernel = stride (the upsampling stages) it is stateless;
- everything else (ConvNeXt's norm and pointwise layers, SnakeBeta, residual sums) is per time step.
The last frame's final samples wait for the next frame, as in the whole decode, whose output never contains
them either; so a stream fed all frames has produced exactly the whole decode's samples, without a flush.

Why hooks rather than our own convolution code: the modules and their forward stay transformers' (any fix there
applies here); the hooks only change what the input's left edge is. They act only while a stream is being fed
(``feed`` runs in one thread per model: the batch engine's worker), never in ``forward`` or ``chunked_decode``.
"""

from __future__ import annotations

import functools

import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf


class VocoderStream:
    """One request's state; fresh = the start of a decode (zero left context, empty attention cache)."""

    def __init__(self):
        self.cache = None  # the transformer's DynamicCache
        self.left: dict[torch.nn.Module, torch.Tensor] = {}  # per causal conv (its Conv1d): its last k - 1 inputs
        self.last: dict[torch.nn.Module, torch.Tensor] = {}  # per transposed conv: its last input sample
        self.frames = 0  # frames fed


class StreamingCode2Wav:
    def __init__(self, model: hf.Qwen3OmniMoeCode2Wav):
        self.model = model
        self._stream: VocoderStream | None = None
        for module in model.modules():
            if isinstance(module, hf.Qwen3OmniMoeCausalConvNet):
                if module.stride != 1 or module.conv.padding != (0,):
                    raise ValueError("streamed code2wav supports stride-1 causal convolutions that pad in their "
                                     "module, not in their Conv1d")
                if module.padding:  # a pointwise convolution has no left context
                    module.conv.register_forward_pre_hook(functools.partial(self._conv_pre, module.padding))
            elif isinstance(module, hf.Qwen3OmniMoeCausalTransConvNet) and module.left_pad:
                module.register_forward_pre_hook(self._transposed_pre)

    # -- hooks (no-ops unless a stream is being fed) -----------------------------------------------------------
    def _conv_pre(self, pad: int, conv, args):
        """``args[0]``: the causal convolution's input, just left-padded with ``pad`` zeros by its module (a new
        tensor, used by nothing else): the stream's left context goes over the zeros, in place."""
        if self._stream is None:
            return None
        x = args[0]
        left = self._stream.left.get(conv)
        if left is not None:
            x[..., :pad] = left
        self._stream.left[conv] = x[..., x.shape[-1] - pad:].clone()  # a copy: a view would pin all of x
        return None

    def _transposed_pre(self, module, args):
        if self._stream is None:
            return None
        x = args[0]
        last = self._stream.last.get(module)
        inp = x if last is None else torch.cat([last, x], dim=-1)
        self._stream.last[module] = inp[..., -1:].clone()
        return (inp,)

    # -- decoding ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def feed(self, stream: VocoderStream, codes: torch.Tensor) -> torch.Tensor:
        """Decode new frames ``codes [G, m]`` of ``stream``: the samples ``[n]`` (float32) final now."""
        from transformers import DynamicCache

        m = self.model
        if stream.cache is None:
            stream.cache = DynamicCache(config=m.pre_transformer.config)
        codes = codes.to(m.code_offset.device).unsqueeze(0)
        hidden = m.code_embedding(codes + m.code_offset).mean(1)
        hidden = m.pre_transformer(inputs_embeds=hidden, past_key_values=stream.cache, use_cache=True)
        hidden = hidden.last_hidden_state.permute(0, 2, 1)
        self._stream = stream
        try:
            for blocks in m.upsample:
                for block in blocks:
                    hidden = block(hidden)
            for block in m.decoder:
                hidden = block(hidden)
        finally:
            self._stream = None
        stream.frames += codes.shape[-1]
        return hidden.clamp(min=-1, max=1).float()[0, 0]
