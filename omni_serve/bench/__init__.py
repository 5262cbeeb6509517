"""``omni-serve bench``: replay a deterministic workload against a running endpoint and against in-process
transformers baselines, and report latency/throughput with ratios.

Modules (each states its own contract):

- ``workload``: the deterministic list of chat requests (``build_workload``).
- ``records``: the per-request record and per-run result shared by every runner and the report.
- ``client``: async httpx streaming client, closed-loop (concurrency) and open-loop (Poisson rate) load.
- ``hf_baseline``: the same workload through ``Qwen2_5OmniForConditionalGeneration.generate``, one at a time.
- ``cb_baseline``: text-only comparison: the Omni thinker as a ``Qwen2ForCausalLM`` run through transformers'
  continuous batching; ``engine_text.run_engine_text`` is the engine side, ``vllm_text.run_vllm_text`` the same
  thinker on vLLM (run in the vLLM environment's interpreter).
- ``report``: percentiles, throughput, ratios, JSON + PNG + a stdout table; merging reports of one workload.
- ``runner``: what ``omni-serve bench`` runs (``BenchConfig`` -> runs -> report).
- ``image`` / ``image_report``: ``--mode image``: image generations over HTTP vs diffusers'
  ``QwenImagePipeline`` one request at a time, cache-dit runs with PSNR, and their report.

Heavy dependencies (torch, transformers, matplotlib) are imported inside the functions that need them.
"""
