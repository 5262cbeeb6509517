"""Load one component of a checkpoint directory: only the tensors under a key prefix.

Contract: ``load_component(checkpoint_dir, module_cls, config, prefixes)`` builds ``module_cls`` from
``config`` without random initialisation and fills it from the checkpoint's safetensors (single file or
sharded with ``model.safetensors.index.json``), reading only the keys that start with one of
``prefixes`` (mapping ``{checkpoint_prefix: module_prefix}``). Missing or unexpected keys are errors, so a
replica provably holds exactly its component's parameters. This is the one path for tiny, small and real
checkpoints. ``linear_from(weight, bias, dtype)`` wraps copies of given tensors in an ``nn.Linear`` (for adapters
that rearrange a loaded module's weights), also without random initialisation.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open


def _shard_files(checkpoint_dir: str) -> list[str]:
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(checkpoint_dir, name) for name in files]
    single = os.path.join(checkpoint_dir, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {checkpoint_dir}")
    return [single]


def read_state_dict(checkpoint_dir: str, prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Tensors whose key starts with a checkpoint prefix, renamed to the module prefix."""
    state: dict[str, torch.Tensor] = {}
    for path in _shard_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                for src, dst in prefixes.items():
                    if key.startswith(src):
                        state[dst + key[len(src):]] = f.get_tensor(key)
                        break
    if not state:
        raise ValueError(f"checkpoint {checkpoint_dir} has no tensors under {sorted(prefixes)}")
    return state


def read_tensor_rows(checkpoint_dir: str, key: str, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of one 2-D tensor (e.g. a few embedding rows), reading only those rows from disk."""
    for path in _shard_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            if key in f.keys():
                table = f.get_slice(key)
                return torch.stack([table[r:r + 1][0] for r in rows])
    raise KeyError(f"checkpoint {checkpoint_dir} has no tensor {key!r}")


_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MoE weights as checkpoints store them (``experts.<e>.{gate,up,down}_proj.weight``) in the
    fused layout transformers' MoE modules hold (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj
    [E, H, I]``), which ``from_pretrained`` builds with its conversion mapping on load; this is that one
    transformation without the whole-model loader. Other keys pass through."""
    out, experts = {}, {}
    for key, value in state.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
    for prefix, by_index in experts.items():
        order = [by_index[e] for e in sorted(by_index)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([w["gate_proj"], w["up_proj"]]) for w in order])
        out[f"{prefix}.down_proj"] = torch.stack([w["down_proj"] for w in order])
    return out


def load_component(checkpoint_dir: str, module_cls, config, prefixes: dict[str, str],
                   dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """Instantiate ``module_cls(config)`` uninitialised, then load its weights strictly (MoE expert weights
    stored per expert are fused first: ``fuse_experts``)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        module = module_cls._from_config(config) if hasattr(module_cls, "_from_config") else module_cls(config)
    state = fuse_experts(read_state_dict(checkpoint_dir, prefixes))
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not _is_tied(module, k)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{module_cls.__name__} from {checkpoint_dir}: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    return module.to(device=device, dtype=dtype).eval()


def _is_tied(module, key: str) -> bool:
    tied = getattr(module, "_tied_weights_keys", None) or {}
    return key in tied


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.nn.Linear:
    """An ``nn.Linear`` on its own copies of ``weight`` ``[out, in]`` and ``bias`` (in ``dtype``, default theirs)."""
    dtype = dtype or weight.dtype
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = torch.nn.Parameter(weight.detach().to(dtype=dtype, copy=True))
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.detach().to(dtype=dtype, copy=True))
    return lin.eval()
