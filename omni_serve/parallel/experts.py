"""Expert parallelism for a transformers mixture-of-experts decoder: each rank keeps a share of every MoE layer's
experts, the rest of the model whole.

Contract: ``check_expert_split(model, world)`` raises ``ValueError`` unless ``shard_experts`` can split ``model``'s
experts across ``world`` ranks (the model has an expert-parallel plan, and ``world`` divides every MoE layer's
experts); it changes nothing. ``shard_experts(model, world)``, inside an initialized ``torch.distributed`` group of
``world`` ranks (gloo on CPU, NCCL on GPU) that all hold the same full weights and run the same forwards, keeps this
rank's contiguous share of each MoE layer's experts (rank ``r`` of ``world``: experts ``[r E / world, (r + 1) E /
world)``) and frees the others. Every rank then routes every token (the router and attention stay whole), runs
only its own experts on the tokens routed to them, and one all-reduce per MoE layer sums the partial outputs, so
every rank ends each layer with the whole hidden state: equal to one rank up to the order of the sums.

The library does the work: transformers' own expert-parallel plan (``config.base_model_ep_plan``) applied with
``apply_expert_parallelism`` and its ``all_reduce`` implementation (``AllReduceEP``: every rank holds the whole
batch, as in a replica whose ranks step together; no tokens move). What is ours: the plan's wildcards expanded to
the model's module names (transformers does it inside ``from_pretrained``, which our adapters do not call with a
device mesh), the mesh built on the group already formed, and each rank's share copied out of the full weights so
the others' experts are freed.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist


def _plan(model) -> dict[str, str]:
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    if not plan:
        raise ValueError(f"{type(model).__name__} has no expert-parallel plan in transformers (base_model_ep_plan)")
    return plan


def _expand(model, plan: dict[str, str]) -> dict[str, str]:
    """The plan's ``layers.*.`` patterns as the model's parameter and module names, in the plan's order (weights of
    a pattern before the module that runs them: sharding a weight sets the experts' local count their forward
    reads)."""
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_modules()]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for name in names:
            if rx.fullmatch(name):
                out[name] = style
    return out


def _experts_modules(model, plan: dict[str, str]) -> list:
    modules = dict(model.named_modules())
    return [modules[n] for n, style in _expand(model, plan).items() if n in modules]


def check_expert_split(model, world: int) -> None:
    plan = _plan(model)
    experts = _experts_modules(model, plan)
    if not experts:
        raise ValueError(f"{type(model).__name__}'s expert-parallel plan names no module of this model")
    counts = {int(getattr(m, "num_experts")) for m in experts}
    bad = sorted(n for n in counts if n % world)
    if bad:
        raise ValueError(f"parallel.expert {world} must divide the {bad[0]} experts of each MoE layer")


def shard_experts(model, world: int, group=None) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    check_expert_split(model, world)
    group = group or dist.group.WORLD
    if dist.get_world_size(group) != world:
        raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, parallel.expert asks {world}")
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mesh = DeviceMesh.from_group(group, device)
    plan = _plan(model)
    with torch.no_grad():
        apply_expert_parallelism(model, mesh, mesh, _expand(model, plan), ep_implementation="all_reduce")
        for experts in _experts_modules(model, plan):
            for name, param in list(experts.named_parameters(recurse=False)):
                if isinstance(param, DTensor):  # its local shard is a view of the full weights: copy it out
                    local = DTensor.from_local(param.to_local().clone(), param.device_mesh, param.placements,
                                               run_check=False, shape=param.shape, stride=param.stride())
                    experts._parameters[name] = torch.nn.Parameter(local, requires_grad=False)
