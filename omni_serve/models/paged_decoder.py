"""The part of an AR stage adapter that any transformers decoder shares: its KV layout for the engine's paged cache
and one packed forward over it.

Contract: an adapter calls ``use_paged_attention(text_config, dtype, device)`` once it has loaded its decoder (the
config switches the decoder's attention to ``omni_paged`` and gives the engine ``num_layers``, ``num_kv_heads``,
``head_dim``, ``dtype``, ``device``), then ``run(decoder, embeds [T, E], positions [R, T], batch)`` returns the
decoder's last hidden states ``[T, H]`` for one packed batch (``omni_serve.engines.ar.attention``). The decoder
builds no mask of its own: ``attention_mask={"full_attention": None}``, and transformers' mask builder has no
mask function for ``omni_paged``, so every layer gets None and attention follows the batch's block tables.
An adapter may call ``prepare_layers(decoder)`` once: from then on ``run`` computes the decoder's layers through
``omni_serve.models.prepared_decoder.PreparedDecoder`` (same result to float rounding, fewer ops per step) when the
decoder's structure allows it, and the adapter lists ``prepared`` among its modules so the engine packs its linears.
A prepared adapter may then be made one rank of a tensor-parallel decoder: ``shard(rank, world, group)``.
"""

from __future__ import annotations

from omni_serve.engines.ar.attention import ATTN_IMPLEMENTATION
from omni_serve.models.prepared_decoder import PreparedDecoder
from omni_serve.models.prepared_paths import use_prepared


class PagedDecoder:
    prepared: PreparedDecoder | None = None  # runs the decoder's layers once prepare_layers succeeded

    def use_paged_attention(self, text_config, dtype, device) -> None:
        text_config._attn_implementation = ATTN_IMPLEMENTATION
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = text_config.num_key_value_heads
        self.head_dim = (getattr(text_config, "head_dim", None)
                         or text_config.hidden_size // text_config.num_attention_heads)
        self.dtype, self.device = dtype, device

    def prepare_layers(self, decoder, wanted: bool = True, what: str = "decoder.layers") -> bool:
        """Run ``decoder``'s layers on prepared weights from now on when ``wanted`` and its structure allows (True
        when it does); the path taken is recorded as ``what`` for ``/health``."""
        if use_prepared(what, wanted, wanted and PreparedDecoder.supports(decoder), "engine.ar.prepared_layers",
                        "layers PreparedDecoder does not reproduce"):
            self.prepared = PreparedDecoder(decoder)
        return self.prepared is not None

    def check_shard(self, world: int) -> None:
        """Raises ``ValueError`` unless ``shard`` can make this adapter one of ``world`` tensor-parallel ranks."""
        if self.prepared is None:
            raise ValueError("tensor parallelism needs the prepared layers (engine.ar.prepared_layers)")
        self.prepared.check_shard(world)

    def shard(self, rank: int, world: int, group=None) -> None:
        """Make this adapter one rank of a tensor-parallel decoder (``PreparedDecoder.shard``): its layers keep this
        rank's heads and MLP share, and the engine's KV cache holds this rank's KV heads only."""
        self.check_shard(world)
        self.num_kv_heads = self.prepared.shard(rank, world, group)

    def run(self, decoder, embeds, positions, batch):
        embeds = embeds.to(self.device)  # a sequence keeps its rows on the host (engines/ar/sequence.py)
        if self.prepared is not None:
            return self.prepared(embeds, positions.to(embeds.device), batch)
        # [R, T] rows of M-RoPE positions are [R, batch 1, T] to transformers; plain RoPE's one row is [batch 1, T]
        position_ids = positions if positions.shape[0] == 1 else positions.unsqueeze(1)
        out = decoder(inputs_embeds=embeds.unsqueeze(0), position_ids=position_ids.to(embeds.device),
                      attention_mask={"full_attention": None}, use_cache=False, omni_batch=batch)
        return out.last_hidden_state[0]
