"""PreparedDecoder equals transformers' decoder layers over the paged KV cache: Qwen2.5-Omni's thinker (M-RoPE) and
talker, Qwen3-ASR's Qwen3 decoder (per-head q/k norms, plain RoPE) and VibeVoice's Qwen2 decoder (plain RoPE).

Two adapters load the same tiny checkpoint; one runs its decoder through ``PreparedDecoder`` (the default), the
other through transformers' forward (``prepared_layers=False``). Both get the same packed batches on caches of
their own: a prompt prefilled in two chunks, then decode steps of two requests at different lengths. Hidden states
must agree to float rounding; a negative control shows a shifted position changes them far beyond it.
"""

from __future__ import annotations

import pytest
import torch

from omni_serve.engines.ar.attention import PagedBatch
from omni_serve.engines.ar.kv_cache import PagedKVCache
from omni_serve.models import qwen2_5_omni as omni
from omni_serve.models.prepared_decoder import PreparedDecoder

# Of the largest hidden value (at least 1). Measured: <= 3e-7 (float rounding: fused products, addcmul, the q/k norms
# of Qwen3-ASR, whose hidden values reach ~27).
TOL = 2e-6


def _atol(want: torch.Tensor) -> float:
    return TOL * max(1.0, float(want.abs().max()))


@pytest.fixture(scope="module")
def pairs(omni_tiny_dir, qwen3_asr_tiny_dir, vibevoice_tiny_dir):
    from omni_serve.models.qwen3_asr import Qwen3ASRLM
    from omni_serve.models.vibevoice import VibeVoiceLM

    adapters = (("thinker", omni.OmniThinker, omni_tiny_dir), ("talker", omni.OmniTalker, omni_tiny_dir),
                ("qwen3_asr", Qwen3ASRLM, qwen3_asr_tiny_dir), ("vibevoice", VibeVoiceLM, vibevoice_tiny_dir))
    return {name: (cls(path), cls(path, prepared_layers=False)) for name, cls, path in adapters}


def _decoder(adapter):
    if isinstance(adapter, omni.OmniTalker):
        return adapter.model.model
    return adapter.model.language_model if hasattr(adapter.model, "language_model") else adapter.model


def _positions(adapter, start: int, n: int) -> torch.Tensor:
    if isinstance(adapter, omni.OmniThinker):
        return adapter.step_positions(start, 3, n)  # 4 rows, M-RoPE rows offset from the text row
    if isinstance(adapter, omni.OmniTalker):
        return adapter.positions(start, n)
    return torch.arange(start, start + n).unsqueeze(0)  # plain RoPE: one row


def _steps(adapter, embeds: dict[str, torch.Tensor], shift: int = 0) -> list[torch.Tensor]:
    """Prefill request a in chunks of 5 + rest, prefill b, then 3 decode steps of both: hidden states per step.
    ``shift`` moves the decode steps' positions (RoPE is relative: shifting every row would change nothing)."""
    cache = PagedKVCache(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, 16, 4, torch.float32, "cpu")
    slots = {"a": torch.arange(0, 32), "b": torch.arange(32, 64)}
    done = {"a": 0, "b": 0}
    out = []
    plan = [[("a", 5)], [("a", 4), ("b", 6)]] + [[("a", 1), ("b", 1)]] * 3
    for i, step in enumerate(plan):
        rows, pos, segments = [], [], []
        for rid, n in step:
            s = done[rid]
            rows.append(embeds[rid][s:s + n])
            pos.append(_positions(adapter, s + (shift if i >= 2 else 0), n))
            segments.append((rid, n, slots[rid][s:s + n], slots[rid][:s + n]))
            done[rid] += n
        batch = PagedBatch.build(cache, segments)
        out.append(adapter.run(_decoder(adapter), torch.cat(rows), torch.cat(pos, dim=1), batch))
    return out


@pytest.mark.parametrize("stage", ["thinker", "talker", "qwen3_asr", "vibevoice"])
def test_prepared_layers_equal_transformers_layers(pairs, stage):
    prepared, plain = pairs[stage]
    assert isinstance(prepared.prepared, PreparedDecoder) and plain.prepared is None
    assert prepared.modules["layers"] is prepared.prepared  # the engine packs the prepared linears
    if stage == "qwen3_asr":
        assert prepared.prepared.layers[0].q_norm is not None  # the q/k norms are computed
    width = prepared.embedding_size if stage == "talker" else prepared.row_size
    torch.manual_seed(1)
    embeds = {"a": torch.randn(12, width), "b": torch.randn(9, width)}
    if stage == "talker":  # the talker's decoder reads projected rows (forward_packed projects first)
        embeds = {k: prepared.model.thinker_to_talker_proj(v).detach() for k, v in embeds.items()}
    with torch.inference_mode():
        got, want = _steps(prepared, embeds), _steps(plain, embeds)
        shifted = _steps(prepared, embeds, shift=7)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=_atol(w))
    # negative control: decode positions matter far beyond the tolerance (RoPE is applied)
    for s, w in zip(shifted[:2], want[:2]):
        torch.testing.assert_close(s, w, rtol=0, atol=_atol(w))
    assert min(float((s - w).abs().max()) / _atol(w) for s, w in zip(shifted[2:], want[2:])) > 50


def test_prepared_decoder_refuses_layers_it_does_not_model(pairs):
    _, plain = pairs["thinker"]
    layer = plain.model.layers[0]
    layer.self_attn.q_norm = torch.nn.Identity()  # q/k norms other than RMS norms are not what it computes
    try:
        assert not PreparedDecoder.supports(plain.model)
        with pytest.raises(ValueError, match="not a decoder PreparedDecoder can run"):
            PreparedDecoder(plain.model)
    finally:
        del layer.self_attn.q_norm
    assert PreparedDecoder.supports(plain.model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_rms_norm_to_the_bit(dtype):
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniRMSNorm

    from omni_serve.models.prepared_decoder import _rms_norm

    torch.manual_seed(0)
    norm = Qwen2_5OmniRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = (torch.randn(7, 96) * 3).to(dtype)
    assert torch.equal(_rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    assert not torch.equal(_rms_norm(x, norm.weight, 1e-1), norm(x))  # negative control: eps is read


def test_the_spec_switch_reaches_the_stage_and_health(omni_tiny_dir):
    """``engine.ar.prepared_layers: false`` runs transformers' layers; the path taken is recorded either way."""
    from omni_kernels import kernel_paths

    from omni_serve.families.qwen2_5_omni import FAMILY
    from omni_serve.graph.runner import build_runner

    off = build_runner(FAMILY, "talker", {"checkpoint": omni_tiny_dir,
                                          "stages": {"talker": {"engine": {"ar": {"prepared_layers": False}}}}})
    assert off.model.prepared is None
    assert kernel_paths()["talker.layers"] == {"path": "library", "reason": "engine.ar.prepared_layers is false"}
    on = build_runner(FAMILY, "talker", {"checkpoint": omni_tiny_dir})
    assert isinstance(on.model.prepared, PreparedDecoder) and kernel_paths()["talker.layers"] == {"path": "prepared"}
