"""The toy model adapter and checkpoint writer: one embedding table over the 128 ASCII codes.

``make_checkpoint(out_dir, size, seed)`` writes ``toy.json`` and ``embedding.pt`` (random rows; ``size`` picks
the width). ``ToyModel(checkpoint, dtype, device)`` embeds characters and maps rows back to the nearest code.
"""

from __future__ import annotations

import json
import os

import torch

WIDTHS = {"tiny": 8, "small": 32}


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    os.makedirs(out_dir, exist_ok=True)
    table = torch.randn(128, WIDTHS[size], generator=torch.Generator().manual_seed(seed))
    torch.save(table, os.path.join(out_dir, "embedding.pt"))
    with open(os.path.join(out_dir, "toy.json"), "w") as f:
        json.dump({"width": WIDTHS[size]}, f)
    return out_dir


class ToyModel:
    def __init__(self, checkpoint: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.table = torch.load(os.path.join(checkpoint, "embedding.pt")).to(device, dtype)
        self.modules = {"embedding": self.table}

    def encode(self, text: str) -> torch.Tensor:
        return self.table[torch.tensor([ord(c) for c in text])]

    def decode(self, rows: torch.Tensor) -> str:
        codes = torch.cdist(rows.to(self.table.dtype), self.table).argmin(dim=1)
        return "".join(chr(int(c)) for c in codes)
