"""A Qwen2-style transformers decoder run layer by layer on prepared weights, over the AR engine's paged KV cache.

Contract: ``PreparedDecoder.supports(decoder)`` says whether ``decoder`` (a transformers text model whose layers are
``input_layernorm -> self_attn(q/k/v/o_proj, q/k/v biased or not, optionally Qwen3's per-head RMS norms
q_norm/k_norm before the rotation) -> post_attention_layernorm -> mlp(gate/up/down, SiLU)``, RMS norms, no sliding
window, rotary embedding module ``rotary_emb`` (M-RoPE or plain RoPE) and final ``norm``: Qwen2.5-Omni's thinker and
talker, Qwen3-ASR's Qwen3 decoder, VibeVoice's Qwen2 decoder) can be prepared. ``PreparedDecoder(decoder)`` takes
its weights: q/k/v become one linear, gate/up one linear (concatenated rows; each output is the same dot product as
before), o/down are taken as they are. It is a torch module, so the AR engine prepacks its linears like any model's
(``omni_kernels.pack_linears``). Calling it with ``(embeds [T, H], positions [R, T], batch)`` (``R`` 3 or 4 for
M-RoPE, 1 for plain RoPE) returns the final-norm hidden states ``[T, H]``: what ``PagedDecoder.run(decoder, ...)``
returns, to float rounding (tests/unit/test_prepared_decoder.py).
The decoder's own layers are emptied (``decoder.layers`` becomes an empty list) so the weights are not held twice;
its embeddings, rotary embedding and final norm stay in use.

Why: a decode step at small batch is dominated by per-op costs, not by arithmetic. transformers' layer calls
(output capture, kwargs plumbing, per-layer rotary with ``rotate_half``'s slices and ``cat``) cost as much as
the thinker's matrix products at one row. Here a layer is 5 matrix products and ~12 other ops; RoPE rotates q and k
of all heads with one ``roll`` and one ``addcmul`` against a sine whose first half is negated once per step
(``rotate_half(x) * sin == roll(x, d/2) * [-sin1, sin2]``, exact since negation is). RMS norms follow transformers'
order of operations in every dtype (normalized in float32, cast back, then scaled).
Nothing is subclassed or patched: the module reads the library modules' weights and reuses their rotary
embedding for cos/sin (M-RoPE sections included), so positions follow transformers' arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_serve.engines.ar.attention import PagedBatch, paged_attention
from omni_serve.models.loading import linear_from


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2 RMSNorm: normalized in float32, cast back, then scaled (one fused op in float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class _LayerIndex:
    """What ``paged_attention`` reads of the attention module: its cache layer."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx


def _fused(linears: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One linear whose output rows are ``linears``' outputs, concatenated."""
    biases = [lin.bias for lin in linears if lin.bias is not None]
    if biases and len(biases) != len(linears):
        raise ValueError("cannot fuse linears where only some have a bias")
    return linear_from(torch.cat([lin.weight.detach() for lin in linears]),
                       torch.cat([b.detach() for b in biases]) if biases else None)


class _Layer(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        # Qwen3: an RMS norm over each head's q and k, before the rotation (None: Qwen2)
        self.q_norm, self.k_norm = (getattr(attn, n, None) for n in ("q_norm", "k_norm"))
        self.in_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.variance_epsilon
        self.post_eps = layer.post_attention_layernorm.variance_epsilon
        self.index = _LayerIndex(attn.layer_idx)
        self.heads, self.kv_heads, self.head_dim = (attn.config.num_attention_heads, attn.config.num_key_value_heads,
                                                    attn.head_dim)
        self.scaling = attn.scaling
        self.intermediate = mlp.gate_proj.out_features


def _columns(linear: torch.nn.Linear, columns: list[int], rank: int) -> torch.nn.Linear:
    """A row-parallel share of ``linear``: its input ``columns``; the bias (added once, after the sum) on rank 0."""
    bias = linear.bias if linear.bias is not None and rank == 0 else None
    if linear.bias is not None and rank != 0:
        bias = torch.zeros_like(linear.bias)
    return linear_from(linear.weight[:, columns], bias)


class PreparedDecoder(torch.nn.Module):
    @staticmethod
    def supports(decoder) -> bool:
        layers = getattr(decoder, "layers", None)
        if not layers or not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "norm"):
            return False
        def linears(module, names) -> bool:
            return module is not None and all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in names)

        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not linears(attn, ("q_proj", "k_proj", "v_proj", "o_proj")):
                return False
            if getattr(attn, "sliding_window", None):
                return False
            norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
            if any(n is not None for n in norms) and not all(hasattr(n, "variance_epsilon") for n in norms):
                return False
            if not linears(mlp, ("gate_proj", "up_proj", "down_proj")):
                return False
            if getattr(attn.config, "hidden_act", None) != "silu":
                return False
            if not all(hasattr(getattr(layer, n, None), "variance_epsilon")
                       for n in ("input_layernorm", "post_attention_layernorm")):
                return False
        return hasattr(decoder.norm, "variance_epsilon")

    def __init__(self, decoder):
        super().__init__()
        if not self.supports(decoder):
            raise ValueError(f"{type(decoder).__name__} is not a decoder PreparedDecoder can run (see its contract)")
        self.layers = torch.nn.ModuleList(_Layer(layer) for layer in decoder.layers)
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm.weight
        self.norm_eps = decoder.norm.variance_epsilon
        self.tp_group, self.tp_world = None, 1  # a tensor-parallel group once shard() ran
        decoder.layers = torch.nn.ModuleList()  # the weights now live here; the library's forward is not used

    def shard(self, rank: int, world: int, group=None) -> int:
        """Keep this rank's share of every layer for tensor parallelism over ``world`` ranks (an initialized
        ``torch.distributed`` group; ``group`` None: the default one) and return the KV heads this rank caches.

        Megatron's split, one all-reduce per block half: q heads split evenly; KV heads split evenly when ``world``
        divides them, else each rank keeps the one KV head its q heads read (replicated, as vLLM does when there are
        fewer KV heads than ranks); q/k/v and gate/up keep this rank's output rows (column-parallel), o_proj and
        down_proj its input columns (row-parallel), and their partial outputs are summed across the ranks. Every
        rank then holds the whole hidden state after each block, so embeddings, norms and the LM head stay whole.
        Equal to one rank up to the order of the sums (float rounding)."""
        self.check_shard(world)
        first = self.layers[0]
        heads, kv_heads = first.heads, first.kv_heads
        q_per, group_size = heads // world, heads // kv_heads
        if kv_heads % world == 0:
            kv = list(range(rank * kv_heads // world, (rank + 1) * kv_heads // world))
        else:  # fewer KV heads than ranks: this rank's q heads all read one KV head
            kv = [rank * q_per // group_size]
        q = list(range(rank * q_per, (rank + 1) * q_per))
        for layer in self.layers:
            d, width = layer.head_dim, layer.intermediate // world
            def rows(first_row: int, heads_kept: list[int]) -> list[int]:
                return [first_row + h * d + i for h in heads_kept for i in range(d)]
            keep = rows(0, q) + rows(heads * d, kv) + rows((heads + kv_heads) * d, kv)
            qkv = layer.qkv
            layer.qkv = linear_from(qkv.weight[keep], qkv.bias[keep] if qkv.bias is not None else None)
            layer.o_proj = _columns(layer.o_proj, rows(0, q), rank)
            mlp = list(range(rank * width, (rank + 1) * width))
            up = [layer.intermediate + i for i in mlp]
            gate_up = layer.gate_up
            layer.gate_up = linear_from(gate_up.weight[mlp + up],
                                        gate_up.bias[mlp + up] if gate_up.bias is not None else None)
            layer.down_proj = _columns(layer.down_proj, mlp, rank)
            layer.heads, layer.kv_heads, layer.intermediate = q_per, len(kv), width
        self.tp_group, self.tp_world = group, world
        return len(kv)

    def check_shard(self, world: int) -> None:
        """Raises ``ValueError`` unless ``shard`` can split the layers over ``world`` ranks."""
        first = self.layers[0]
        heads, kv_heads = first.heads, first.kv_heads
        if heads % world:
            raise ValueError(f"tensor parallel size {world} must divide the {heads} attention heads")
        if kv_heads % world and world % kv_heads:
            raise ValueError(f"tensor parallel size {world} must divide or be a multiple of the {kv_heads} KV heads")
        if first.intermediate % world:
            raise ValueError(f"tensor parallel size {world} must divide the MLP width {first.intermediate}")

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial output (tensor parallel), or ``x`` on one rank."""
        if self.tp_world > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.tp_group)
        return x

    def _rotation(self, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[T, 1, head_dim]`` for this step's rows (the decoder's own rotary embedding)."""
        rope_rows = positions[-3:] if positions.shape[0] == 4 else positions  # a text row first is not rotary
        # M-RoPE's rotary embedding takes [sections, batch 1, T]; plain RoPE's takes [batch 1, T]
        rope_rows = rope_rows if rope_rows.shape[0] == 1 else rope_rows.unsqueeze(1)
        cos, sin = self.rotary_emb(embeds.unsqueeze(0), rope_rows.to(embeds.device))
        cos, sin = cos[0], sin[0]
        half = sin.shape[-1] // 2
        signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        return cos.unsqueeze(1), signed.unsqueeze(1)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        cos, signed_sin = self._rotation(embeds, positions)
        rows = embeds.shape[0]
        h = embeds
        for layer in self.layers:
            heads, kv_heads, d = layer.heads, layer.kv_heads, layer.head_dim
            x = _rms_norm(h, layer.in_norm, layer.eps)
            qkv = layer.qkv(x)
            qk = qkv[:, :(heads + kv_heads) * d].view(rows, heads + kv_heads, d)
            if layer.q_norm is not None:
                qk = torch.cat([_rms_norm(qk[:, :heads], layer.q_norm.weight, layer.q_norm.variance_epsilon),
                                _rms_norm(qk[:, heads:], layer.k_norm.weight, layer.k_norm.variance_epsilon)], dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), signed_sin)
            v = qkv[:, (heads + kv_heads) * d:].view(rows, kv_heads, d)
            q, k = qk[:, :heads], qk[:, heads:]
            attn, _ = paged_attention(layer.index, q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                      v.transpose(0, 1).unsqueeze(0), None, layer.scaling, omni_batch=batch)
            h = h + self._reduce(layer.o_proj(attn.reshape(rows, heads * d)))
            x = _rms_norm(h, layer.post_norm, layer.post_eps)
            gate, up = layer.gate_up(x).split(layer.intermediate, dim=-1)
            h = h + self._reduce(layer.down_proj(F.silu(gate) * up))
        return _rms_norm(h, self.norm, self.norm_eps)
