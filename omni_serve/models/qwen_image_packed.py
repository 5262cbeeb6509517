"""Qwen-Image's transformer over rows of different text lengths, packed without padding, from diffusers' own modules.

Contract: ``PackedForward(transformer)`` runs a ``QwenImageTransformer2DModel`` (its submodules and weights, nothing
copied) over B rows that share one image geometry but not their text length. ``__call__(latents [B, S, C],
texts (B tensors [L_b, D]), timestep [B], img_shapes, row_cache=None)`` returns the prediction ``[B, S, C_out]``
that diffusers' ``forward`` returns for each row alone (a batch of one), to float rounding.
``supports(transformer)`` says whether a transformer's variant is covered (those with ``zero_cond_t``,
``use_additional_t_cond``, ``guidance_embeds`` or layered 3D RoPE are not: they keep diffusers' padded forward).

How: the image stream stays ``[B, S, dim]`` (every row has the same image tokens). The text stream is one packed
``[T, dim]`` tensor (T = sum of the rows' lengths): its projections, MLPs and modulation (per-token shift, scale
and gate, gathered from each token's row) run once over exactly the real tokens. Only joint attention is per
row: rows of equal text length are attended together in one ``scaled_dot_product_attention`` call, without a
mask. diffusers' padded batch instead computes every row's text at the longest row's length and attends with a
key mask (which also forces the slower masked attention kernel); on a CPU batch of 16 rows with 6-53-token
prompts that padding cost ~25% of the forward.

The blocks' submodules are called directly, not the block modules: hooks registered on a block, and diffusers'
attention-backend switches, do not apply here (omni_serve registers none; cache-dit's caching runs through
``row_cache`` below).

``row_cache`` (optional, ``omni_serve.kits.diffusion.replica.cache.RowCache``) makes the forward DBCache-aware
per row group: the first ``Fn`` blocks run on every row, ``row_cache.decide`` then picks the rows that compute the
middle blocks (the others take their cached residuals), and the last ``Bn`` blocks run on every row again.

``shards`` (``omni_serve.parallel.sequence.SequenceShards``, None by default): sequence parallelism. Every rank of the
shards' group runs the same call; each keeps its share of the image tokens through the blocks (the text stream
whole), gathers the image keys and values before each joint attention, and the prediction is gathered whole at the
end. With ``row_cache`` the cache decides on the gathered first-blocks residual (the same decision on every rank) and
each rank keeps the residuals of its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from omni_kernels import tanh_gelu


@dataclass
class TextLayout:
    """Where each row's text tokens lie in the packed text stream."""

    lengths: list[int]
    offsets: list[int]  # first token of each row
    token_row: torch.Tensor  # [T] row of each packed token
    token_pos: torch.Tensor  # [T] position of each token within its row

    @classmethod
    def of(cls, lengths: list[int], device) -> "TextLayout":
        offsets, total = [], 0
        for n in lengths:
            offsets.append(total)
            total += n
        token_row = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                            torch.tensor(lengths, device=device))
        token_pos = torch.cat([torch.arange(n, device=device) for n in lengths]) if lengths else torch.zeros(0)
        return cls(list(lengths), offsets, token_row, token_pos.long())

    def tokens(self, rows: list[int]) -> torch.Tensor:
        """Packed token indices of ``rows`` (in the order given)."""
        return torch.cat([torch.arange(self.offsets[r], self.offsets[r] + self.lengths[r]) for r in rows])

    def subset(self, rows: list[int]) -> "TextLayout":
        return TextLayout.of([self.lengths[r] for r in rows], self.token_row.device)


def supports(transformer) -> bool:
    """Whether ``PackedForward`` covers this transformer variant (else: diffusers' padded forward)."""
    cfg = transformer.config
    return not (cfg.get("zero_cond_t") or cfg.get("use_additional_t_cond") or cfg.get("guidance_embeds")
                or cfg.get("use_layer3d_rope"))


def _modulate_rows(x: torch.Tensor, params: torch.Tensor):
    """diffusers' ``_modulate`` for per-row parameters ``[B, 3 dim]`` on ``x [B, S, dim]``."""
    shift, scale, gate = params.chunk(3, dim=-1)
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), gate.unsqueeze(1)


def _modulate_tokens(x: torch.Tensor, params: torch.Tensor, token_row: torch.Tensor):
    """The same for packed tokens ``x [T, dim]``: each token takes its row's parameters."""
    shift, scale, gate = params[token_row].chunk(3, dim=-1)
    return x * (1 + scale) + shift, gate


def _mlp(ff, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``FeedForward`` (Linear, tanh-GELU, dropout, Linear; eval mode) with ``omni_kernels.tanh_gelu``."""
    return ff.net[2](tanh_gelu(ff.net[0].proj(x)))


def check_block(block) -> None:
    """Refuse a block whose structure ``PackedForward`` does not reproduce (a changed diffusers version)."""
    for ff in (block.img_mlp, block.txt_mlp):
        net = getattr(ff, "net", None)
        if (net is None or len(net) != 3 or getattr(net[0], "approximate", None) != "tanh"
                or not hasattr(net[0], "proj") or not isinstance(net[1], torch.nn.Dropout)):
            raise TypeError("Qwen-Image block MLP is not Linear, tanh-GELU, dropout, Linear: check the installed "
                            "diffusers version")
    if not isinstance(block.attn.processor, QwenDoubleStreamAttnProcessor2_0):
        raise TypeError(f"Qwen-Image attention processor {type(block.attn.processor).__name__} is not the joint "
                        "attention PackedForward reproduces")


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` for ``x [..., N, H, D]``, ``freqs [N, D/2]``."""
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(rotated * freqs.unsqueeze(1)).flatten(-2).type_as(x)


class PackedForward:
    def __init__(self, transformer):
        if not supports(transformer):
            raise ValueError("PackedForward does not cover Qwen-Image transformers with zero_cond_t, "
                             "use_additional_t_cond, guidance_embeds or use_layer3d_rope")
        self.t = transformer
        self.shards = None  # SequenceShards: this rank's share of the image tokens (sequence parallelism)
        self.blocks = list(transformer.transformer_blocks)
        for block in self.blocks:
            check_block(block)

    # -- one block ----------------------------------------------------------------------------------------------
    def block(self, block, img: torch.Tensor, txt: torch.Tensor, layout: TextLayout, temb: torch.Tensor,
              img_freqs: torch.Tensor, txt_freqs: torch.Tensor, gather=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``QwenImageTransformerBlock.forward`` on image rows ``[B, S, dim]`` and packed text ``[T, dim]``.
        ``gather``: under sequence parallelism, makes this rank's image tokens (dim 1) whole."""
        img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
        img_in, img_gate1 = _modulate_rows(block.img_norm1(img), img_mod1)
        txt_in, txt_gate1 = _modulate_tokens(block.txt_norm1(txt), txt_mod1, layout.token_row)
        img_attn, txt_attn = self.attention(block.attn, img_in, txt_in, layout, img_freqs, txt_freqs, gather)
        img = img + img_gate1 * img_attn
        txt = txt + txt_gate1 * txt_attn
        img_in2, img_gate2 = _modulate_rows(block.img_norm2(img), img_mod2)
        img = img + img_gate2 * _mlp(block.img_mlp, img_in2)
        txt_in2, txt_gate2 = _modulate_tokens(block.txt_norm2(txt), txt_mod2, layout.token_row)
        txt = txt + txt_gate2 * _mlp(block.txt_mlp, txt_in2)
        if txt.dtype == torch.float16:  # as diffusers: keep float16 finite
            txt, img = txt.clip(-65504, 65504), img.clip(-65504, 65504)
        return img, txt

    def attention(self, attn, img: torch.Tensor, txt: torch.Tensor, layout: TextLayout, img_freqs: torch.Tensor,
                  txt_freqs: torch.Tensor, gather=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``QwenDoubleStreamAttnProcessor2_0`` (joint text + image attention of each row), text packed. With
        ``gather`` (sequence parallelism) the image queries are this rank's, the keys and values every rank's."""
        head_dim = attn.inner_dim // attn.heads
        iq, ik, iv = (p(img).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (p(txt).unflatten(-1, (-1, head_dim)) for p in (attn.add_q_proj, attn.add_k_proj,
                                                                      attn.add_v_proj))
        if attn.norm_q is not None:
            iq = attn.norm_q(iq)
        if attn.norm_k is not None:
            ik = attn.norm_k(ik)
        if attn.norm_added_q is not None:
            tq = attn.norm_added_q(tq)
        if attn.norm_added_k is not None:
            tk = attn.norm_added_k(tk)
        iq, ik = _rope(iq, img_freqs), _rope(ik, img_freqs)
        tq, tk = _rope(tq, txt_freqs), _rope(tk, txt_freqs)
        if gather is not None:
            ik, iv = gather(ik), gather(iv)
        img_out = torch.empty_like(iq)
        txt_out = torch.empty_like(tq)
        groups: dict[int, list[int]] = {}
        for row, n in enumerate(layout.lengths):
            groups.setdefault(n, []).append(row)
        for n, rows in groups.items():  # rows of equal text length: one unmasked attention call
            tok = layout.tokens(rows)
            g = len(rows)

            def joint(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
                return torch.cat([t[tok].view(g, n, *t.shape[1:]), i[rows]], dim=1).transpose(1, 2)

            out = F.scaled_dot_product_attention(joint(tq, iq), joint(tk, ik), joint(tv, iv)).transpose(1, 2)
            txt_out[tok] = out[:, :n].reshape(-1, *out.shape[2:])
            img_out[rows] = out[:, n:]
        img_out = attn.to_out[0](img_out.flatten(-2).contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.flatten(-2).contiguous())

    # -- the whole forward --------------------------------------------------------------------------------------
    def __call__(self, latents: torch.Tensor, texts: list[torch.Tensor], timestep: torch.Tensor, img_shapes,
                 row_cache=None) -> torch.Tensor:
        """Predictions ``[B, S, C_out]`` for rows ``latents [B, S, C]`` with texts ``[L_b, D]`` at ``timestep [B]``
        (the transformer's input scale, 0..1). ``img_shapes``: one row's list of image segments ``(f, h, w)``."""
        t = self.t
        tokens, gather = latents.shape[1], None
        if self.shards is not None:  # this rank's image tokens only, from here to the end
            mine = self.shards.share(tokens)
            latents = latents[:, mine.start:mine.stop]

            def gather(x: torch.Tensor) -> torch.Tensor:
                return self.shards.gather(x, tokens, dim=1)
        img = t.img_in(latents)
        layout = TextLayout.of([x.shape[0] for x in texts], img.device)
        txt = t.txt_in(t.txt_norm(torch.cat(texts)))
        temb = t.time_text_embed(timestep.to(img.dtype), img)
        img_freqs, txt_table = t.pos_embed([img_shapes], max_txt_seq_len=max(layout.lengths), device=img.device)
        if self.shards is not None:
            img_freqs = img_freqs[mine.start:mine.stop]
        txt_freqs = txt_table[layout.token_pos]
        args = (temb, img_freqs, txt_freqs, gather)
        if row_cache is None:
            for block in self.blocks:
                img, txt = self.block(block, img, txt, layout, *args)
        else:
            img, txt = self._cached_blocks(img, txt, layout, args, row_cache)
        out = t.proj_out(t.norm_out(img, temb))
        return out if gather is None else gather(out)

    def _middle_blocks(self, img, txt, layout: TextLayout, args, rows: list[int], row_cache):
        """The middle blocks on ``rows`` (``img``/``txt`` hold just those rows, text packed by ``layout``); their
        residuals go to ``row_cache``."""
        fn, bn = row_cache.fn_blocks, row_cache.bn_blocks
        start_img, start_txt = img, txt
        for block in self.blocks[fn:len(self.blocks) - bn]:
            img, txt = self.block(block, img, txt, layout, *args)
        img = img.contiguous()
        row_cache.computed(rows, img - start_img, txt - start_txt, img, txt, layout)
        return img, txt

    def _cached_blocks(self, img, txt, layout: TextLayout, args, row_cache):
        fn, bn = row_cache.fn_blocks, row_cache.bn_blocks
        temb, img_freqs, txt_freqs, gather = args
        before = img
        for block in self.blocks[:fn]:
            img, txt = self.block(block, img, txt, layout, *args)
        if gather is None:
            compute = row_cache.decide(img - before, img, txt, layout)  # rows that run the middle blocks
        else:  # every rank decides on the whole image: the same rows everywhere
            compute = row_cache.decide(gather(img - before), gather(img), txt, layout)
        if len(compute) == img.shape[0]:  # nobody takes the cache this step: all rows, no gathering
            img, txt = self._middle_blocks(img, txt, layout, args, compute, row_cache)
        elif compute:
            tok = layout.tokens(compute)
            m_img, m_txt = self._middle_blocks(img[compute], txt[tok], layout.subset(compute),
                                               (temb[compute], img_freqs, txt_freqs[tok], gather), compute,
                                               row_cache)
            img, txt = img.clone(), txt.clone()
            img[compute], txt[tok] = m_img, m_txt
        img, txt = row_cache.apply(img, txt, layout)  # the cached rows: their residuals added
        for block in self.blocks[len(self.blocks) - bn:]:
            img, txt = self.block(block, img, txt, layout, *args)
        return img, txt
