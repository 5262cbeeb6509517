"""The qwen3_omni bench plug-in: the omni and speech modes of ``benchmarks.omni_modes`` with this family's transformers
baseline (``hf_baseline.Qwen3HFBaseline``). Run recipe: ``run.sh`` with ``small.yaml``."""

from __future__ import annotations

from benchmarks.omni_modes import omni_bench

BENCH = omni_bench("qwen3_omni", ("omni", "speech", "realtime"), hf="benchmarks.qwen3_omni.hf_baseline:Qwen3HFBaseline")
