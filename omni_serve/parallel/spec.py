"""A stage's ``parallel`` settings: how many ranks one replica spans, and the placement group that holds them.

Contract: ``ParallelSpec.rows`` > 1 makes every replica of the stage own ``rows - 1`` rank workers besides
itself (the replica computes as rank 0), each in a bundle of the replica's placement group
(``placement_group_bundles``: the replica's bundle, then one per extra rank, ``STRICT_PACK``: one node). A step's
rows (requests, CFG branches) are split across the ranks (``omni_serve.graph.ranks``). ``tensor`` > 1 does the same
for an AR stage whose layers split across the ranks (tensor parallelism, one process group with the replica as
rank 0); ``expert`` > 1 likewise for a mixture-of-experts AR stage whose MoE layers' experts split across the ranks
(expert parallelism, ``omni_serve.parallel.experts``); ``sequence`` > 1 for a DiT stage whose ranks all compute every
row, each holding a share of its image tokens (sequence parallelism, ``omni_serve.parallel.sequence``). One kind per
stage. A stage declares the kinds it supports (``StageSpec.parallel_kinds``); asking another fails validation.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ParallelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rows: int = Field(1, ge=1, le=64, description=(
        "Ranks a replica splits each step's rows across (requests' images and CFG branches): the replica is rank "
        "0, and rows - 1 rank workers (Ray actors) start in its placement group, each loading the model. 1: no "
        "extra ranks. Outputs equal one rank's up to float rounding (docs/parallel.md)."))
    tensor: int = Field(1, ge=1, le=64, description=(
        "Tensor-parallel ranks of an AR stage on the native engine: each layer's attention heads and MLP split "
        "across the ranks (the replica is rank 0, tensor - 1 rank workers join it in a gloo or NCCL group), one "
        "all-reduce per block half, each rank caching its KV heads. Equal to one rank up to the order of the sums "
        "(greedy tokens the same unless two logits tie within float rounding; docs/parallel.md)."))
    expert: int = Field(1, ge=1, le=64, description=(
        "Expert-parallel ranks of a mixture-of-experts AR stage on the native engine: each MoE layer's experts split "
        "across the ranks (the replica is rank 0, expert - 1 rank workers join it in a gloo or NCCL group; "
        "attention, router and KV cache stay whole on each), every rank routes every token to its own experts and "
        "one all-reduce per MoE layer sums them (transformers' expert-parallel plan). It must divide the experts of "
        "each layer. Equal to one rank up to the order of the sums (docs/parallel.md)."))
    sequence: int = Field(1, ge=1, le=64, description=(
        "Sequence-parallel ranks of a DiT stage (Qwen-Image, Qwen-Image-Edit; the packed forward): every rank "
        "computes every row of a step, each holding a share of its image tokens through the blocks and gathering "
        "the image keys and values for attention (the replica is rank 0, sequence - 1 rank workers join it in a "
        "gloo or NCCL group); any image size. Composes with step-level batching and cache acceleration. Equal to "
        "one rank up to float rounding (docs/parallel.md)."))
    rank_cpus: float | None = Field(None, ge=0, description=(
        "CPUs reserved per extra rank (its placement-group bundle); default: the stage's num_cpus."))
    rank_gpus: float | None = Field(None, ge=0, description=(
        "GPUs reserved per extra rank; default: the stage's num_gpus."))
    call_timeout_s: float = Field(600.0, gt=0, description=(
        "Longest a rank may take to answer one step (or to start: load its model and join the group): past it "
        "(or when a rank dies) the replica's ranks are stopped, its requests fail with a 503 the client may retry "
        "and Serve replaces the replica."))

    @model_validator(mode="after")
    def _one_kind(self) -> "ParallelSpec":
        if len(self.kinds()) > 1:
            raise ValueError("one parallel kind per stage: set one of rows, tensor, expert and sequence above 1")
        return self

    def rank_resources(self, num_cpus: float, num_gpus: float) -> tuple[float, float]:
        """(CPUs, GPUs) of each extra rank: ``rank_cpus``/``rank_gpus``, else the stage's own."""
        return (num_cpus if self.rank_cpus is None else self.rank_cpus,
                num_gpus if self.rank_gpus is None else self.rank_gpus)

    @property
    def ranks(self) -> int:
        """Ranks of one replica, the replica included."""
        return self.rows * self.tensor * self.expert * self.sequence

    @property
    def sharded(self) -> str | None:
        """The kind that splits the model across one process group (``tensor`` or ``expert``), if any."""
        return next((k for k in ("tensor", "expert") if getattr(self, k) > 1), None)

    def kinds(self) -> dict[str, int]:
        """The kinds asked for (degree > 1) and their degrees."""
        return {k: v for k, v in {"rows": self.rows, "tensor": self.tensor, "expert": self.expert,
                                  "sequence": self.sequence}.items() if v > 1}

    @property
    def grouped(self) -> bool:
        """Whether the ranks form one process group (every kind but rows: their collectives pair up)."""
        return self.sharded is not None or self.sequence > 1
