"""omni_serve's own kernels (``kernels/``, imported as ``omni_kernels``) against their pure-torch references.

``decode_attention``: equals SDPA with ``enable_gqa`` (the reference) to float rounding over GQA ratios, padded
lengths and dtypes; each sequence's result is the same bits whatever its batch partners and their order (what lets
the AR engine keep its decode KV copy in its own row order); keys past a sequence's length never matter; and a
mix-up the reference would catch (another head grouping, one key too few) fails the comparison.

``PackedLinear`` / ``pack_linears``: equal ``F.linear`` for any row count and leading dimensions, with and without
bias, in float32 and bfloat16; only CPU float linear layers are swapped, their unpacked weights released, and a
packed model computes what it did before. bfloat16 tests take the branch of this CPU's capability
(``omni_kernels.packing_supported``, itself checked against the CPU's flags in ``test_cpu_capability.py``, which
also reruns this file on a CPU capped to AVX2): the prepacked product where oneDNN runs it, else a refusal that says
why and the plain layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_kernels import (PackedLinear, decode_attention, decode_bias, pack_linears, packing_available,
                          packing_supported, reference_decode_attention, reference_linear, reference_linear_gelu,
                          reference_tanh_gelu, tanh_gelu)

SHAPES = [  # batch, query heads, key/value heads, keys, head dim
    (1, 8, 4, 60, 64), (2, 4, 2, 120, 8), (8, 8, 4, 250, 48), (32, 8, 4, 130, 64), (5, 6, 6, 33, 32), (3, 8, 1, 17, 16),
]


def _inputs(batch, heads, kv_heads, keys, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(batch, kv_heads, keys, dim, generator=g)
    v = torch.randn(batch, kv_heads, keys, dim, generator=g)
    lengths = torch.randint(1, keys + 1, (batch,), generator=g)
    lengths[0] = keys
    return q.to(dtype), k.to(dtype), v.to(dtype), lengths


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "full"])
def test_decode_attention_equals_sdpa(shape, padded):
    q, k, v, lengths = _inputs(*shape)
    bias = decode_bias(lengths, shape[3]) if padded else None
    got, want = decode_attention(q, k, v, bias), reference_decode_attention(q, k, v, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    scale = 0.3
    torch.testing.assert_close(decode_attention(q, k, v, bias, scale), reference_decode_attention(q, k, v, bias, scale),
                               rtol=1e-5, atol=2e-6)


def test_decode_attention_in_bfloat16_is_close_to_float32():
    q, k, v, lengths = _inputs(8, 8, 4, 200, 64)
    bias = decode_bias(lengths, 200)
    want = reference_decode_attention(q, k, v, bias)
    got = decode_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_sequences_result_does_not_depend_on_its_batch(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, lengths = _inputs(24, 8, 4, 130, 64, seed=threads)
        bias = decode_bias(lengths, 130)
        whole = decode_attention(q, k, v, bias)
        for seed in range(4):
            order = torch.randperm(24, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(decode_attention(q[order], k[order], v[order], bias[order]), whole[order])
        part = torch.tensor([3, 0, 17])
        assert torch.equal(decode_attention(q[part], k[part], v[part], bias[part]), whole[part])
        garbage_k, garbage_v = k.clone(), v.clone()  # what lies past a sequence's length is never read
        for b, n in enumerate(lengths.tolist()):
            garbage_k[b, :, n:], garbage_v[b, :, n:] = 1e4, -1e4
        assert torch.equal(decode_attention(q, garbage_k, garbage_v, bias), whole)
    finally:
        torch.set_num_threads(previous)


def test_mix_ups_fail_the_comparison():
    """Negative controls: the comparison above tells apart another head grouping and an off-by-one length."""
    q, k, v, lengths = _inputs(4, 8, 4, 40, 16, seed=5)
    bias = decode_bias(lengths, 40)
    got = decode_attention(q, k, v, bias)
    tiled = reference_decode_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), bias)  # head h -> kv h % 4
    assert not torch.allclose(got, tiled, atol=1e-3)
    shorter = reference_decode_attention(q, k, v, decode_bias(torch.clamp(lengths - 1, min=1), 40))
    assert not torch.allclose(got, shorter, atol=1e-3)


def test_bad_head_ratio_is_refused():
    q, k, v, _ = _inputs(2, 6, 4, 8, 16)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        decode_attention(q, k, v)


@pytest.mark.gpu
def test_decode_attention_on_cuda_equals_sdpa_and_the_cpu():
    q, k, v, lengths = _inputs(16, 8, 4, 300, 64)
    bias = decode_bias(lengths, 300)
    cuda = [t.cuda() for t in (q, k, v)]
    got = decode_attention(*cuda, bias.cuda())
    torch.testing.assert_close(got, reference_decode_attention(*cuda, bias.cuda()), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.cpu(), decode_attention(q, k, v, bias), rtol=1e-4, atol=1e-5)


# -- packed_linear -------------------------------------------------------------------------------------------------
needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")
PACKED_BF16 = packing_supported(torch.bfloat16)


def refused_in_bfloat16(make):
    """Where this CPU has no prepacked bfloat16 product: ``make()`` raises the error that says so."""
    with pytest.raises(ValueError, match="cannot prepack a torch.bfloat16 weight here: oneDNN"):
        make()


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 100, 256])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_packed_linear_equals_f_linear(rows, bias):
    linear = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    want = reference_linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear, batch_hint=32)
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x.view(1, rows, 96)), want.view(1, rows, 160), rtol=1e-5, atol=1e-5)
    other = reference_linear(x, linear.weight.roll(1, dims=0), linear.bias)  # negative control: rows mixed up
    assert not torch.allclose(packed(x), other, atol=1e-3)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 32])
def test_packed_linear_with_plain_rows_equals_f_linear_and_switches_path_by_row_count(rows):
    """``plain_max_rows=2``: one or two rows (any leading dims) take ``F.linear`` on the kept row-major weight, more
    take the packed product; both equal ``F.linear``. A poisoned plain copy shows which path ran."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    x = torch.randn(1, rows, 96)
    want = reference_linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear, batch_hint=32, plain_max_rows=2)
    assert packed.plain_weight is not None and "plain_max_rows=2" in repr(packed)
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
    packed.plain_weight = torch.zeros_like(packed.plain_weight)  # negative control: the path is the row count's
    assert torch.equal(packed(x), linear.bias.expand_as(want)) == (rows <= 2)


@needs_onednn
def test_packed_linear_keeps_no_plain_copy_in_bfloat16_or_with_an_activation():
    gelu = PackedLinear(torch.nn.Linear(64, 64), 8, activation="gelu_tanh", plain_max_rows=2)
    assert gelu.plain_weight is None and gelu.plain_max_rows == 0

    def bf16():
        return PackedLinear(torch.nn.Linear(64, 64).to(torch.bfloat16), 8, plain_max_rows=2)
    if not PACKED_BF16:
        return refused_in_bfloat16(bf16)
    assert bf16().plain_weight is None and bf16().plain_max_rows == 0


@needs_onednn
def test_packed_linear_in_bfloat16():
    linear = torch.nn.Linear(64, 64).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    if not PACKED_BF16:
        return refused_in_bfloat16(lambda: PackedLinear(linear, 8))
    got = PackedLinear(linear, 8)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_linear(x.float(), linear.weight.float(), linear.bias.float()),
                               rtol=0.02, atol=0.02)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_with_fused_gelu_equals_linear_then_gelu(dtype):
    """The fused tanh-GELU acts on the float32 accumulator: float32 equals the two ops to rounding; bfloat16 is as
    close to the float32 result as a bfloat16 rounding (closer than the two ops in bfloat16)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).to(dtype)
    x = torch.randn(2, 37, 96, dtype=dtype)
    if dtype == torch.bfloat16 and not PACKED_BF16:
        return refused_in_bfloat16(lambda: PackedLinear(linear, 32, activation="gelu_tanh"))
    got = PackedLinear(linear, 32, activation="gelu_tanh")(x)
    want = reference_linear_gelu(x.float(), linear.weight.float(), linear.bias.float())
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * float(want.abs().max())
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)
    plain = reference_linear(x.float(), linear.weight.float(), linear.bias.float())  # negative control: no GELU
    assert float((got.float() - plain).abs().max()) > 0.1


def test_packed_linear_refuses_an_unknown_activation():
    with pytest.raises(ValueError, match="activation 'relu'"):
        PackedLinear(torch.nn.Linear(4, 4), 8, activation="relu")


@needs_onednn
def test_pack_linears_swaps_only_cpu_float_linear_layers_and_keeps_the_output():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(),
                                torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.LayerNorm(64)),
                                torch.nn.Linear(64, 8).double())
    x = torch.randn(5, 32)

    def run(m):
        return m[3](m[2](m[1](m[0](x))).double())

    with torch.inference_mode():
        want = run(model)
        assert pack_linears(model) == 2  # the float64 one stays an nn.Linear
        assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
        assert type(model[3]) is torch.nn.Linear
        assert not any(name.endswith("weight") and p.dim() == 2 for name, p in model.named_parameters()
                       if not name.startswith("3."))  # the unpacked weights are gone
        torch.testing.assert_close(run(model), want, rtol=1e-5, atol=1e-6)
        assert pack_linears(model) == 0  # packing twice is a no-op


# -- tanh_gelu ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (3, 5, 96), (300, 1536)], ids=["vector", "3d", "many-chunks"])
def test_tanh_gelu_equals_f_gelu(shape):
    x = torch.randn(*shape) * 3
    torch.testing.assert_close(tanh_gelu(x), reference_tanh_gelu(x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(tanh_gelu(x), F.gelu(x), atol=1e-4)  # negative control: the exact (erf) GELU differs


def test_tanh_gelu_in_bfloat16_keeps_the_dtype_and_the_values():
    x = torch.randn(64, 384, dtype=torch.bfloat16) * 3
    got = tanh_gelu(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference_tanh_gelu(x), rtol=0.01, atol=0.01)


def test_the_kernels_package_stands_alone():
    """kernels/ is below every omni_serve layer: it imports torch only, never omni_serve."""
    import ast
    import pathlib

    import omni_kernels

    for path in pathlib.Path(omni_kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("omni_serve") for n in names), f"{path.name} imports {names}"
