"""The qwen2_5_omni bench plug-in: the omni, text, speech and realtime modes of ``benchmarks.omni_modes`` with this family's
baselines (``hf_baseline``, ``cb_baseline``, ``speech_baseline``) and in-process engines (``engine_text``,
``vllm_text``). Run recipes: ``run.sh`` (chat with both thinker backends, text mode, ceiling), ``run_chat.sh``,
``run_speech.sh`` with the ``small*.yaml`` graph values; compute ceiling: ``ceiling.py``; the other scripts time
single pieces (code2wav, decoder steps, input processing)."""

from __future__ import annotations

from benchmarks.omni_modes import omni_bench

BENCH = omni_bench("qwen2_5_omni", ("omni", "text", "speech", "realtime"),
                   hf="benchmarks.qwen2_5_omni.hf_baseline:HFBaseline", default_for=("omni", "text", "speech"))
