"""The engine side of the text-only comparison: the Omni thinker on ``AREngine``, in process, no HTTP.

Contract: ``run_engine_text(checkpoint_dir, prompts, max_new_tokens, concurrency, ...)`` has the arguments and
result shape of ``benchmarks.qwen2_5_omni.cb_baseline.run_transformers_cb``: the same token-id prompts, greedy,
stopping on ``<|im_end|>`` (suppressed until ``min_new_tokens``), closed loop at ``concurrency`` or Poisson
arrivals at ``request_rate``; one ``RequestRecord`` per prompt with TTFT / ITL / E2E from per-token arrival
times and exact token counts. The thinker runs exactly as in the served graph (``ThinkerSequence`` on an
``AREngine`` with its paged KV cache, continuous batching and chunked prefill), minus Ray and HTTP, so
the comparison with transformers' ``ContinuousBatchingManager`` is engine against engine.
"""

from __future__ import annotations

import asyncio
import time

from omni_serve.bench.records import RequestRecord, RunResult, finish_token_record


def run_engine_text(checkpoint_dir: str, prompts: list[list[int]], max_new_tokens: int,
                    concurrency: int | None = 1, *, request_rate: float | None = None, arrival_seed: int = 0,
                    eos_token_id: int | None = None, progress_every: int = 10, label: str | None = None,
                    tokenizer=None, min_new_tokens: int = 0, ar_config=None, warmup: bool = True) -> RunResult:
    import torch
    from transformers import AutoTokenizer

    from omni_serve.bench.client import LoadPoint, poisson_arrivals, progress_logger
    from omni_serve.engines.ar import ARConfig, AREngine
    from omni_serve.engines.sampling import SamplingParams
    from omni_serve.families.qwen2_5_omni.replica.programs import ThinkerRequest, ThinkerSequence
    from omni_serve.models.qwen2_5_omni import OmniThinker

    if not prompts:
        raise ValueError("no prompts")
    tok = tokenizer or AutoTokenizer.from_pretrained(checkpoint_dir)
    eos = eos_token_id if eos_token_id is not None else tok.convert_tokens_to_ids("<|im_end|>")
    point = LoadPoint(concurrency=concurrency, request_rate=request_rate)
    label = label or point.label("engine_text")
    cap = concurrency or len(prompts)
    longest = max(len(p) for p in prompts) + max_new_tokens
    cfg = ar_config or ARConfig(max_num_seqs=max(cap, 1), num_kv_blocks=max(512, cap * (-(-longest // 16) + 1)))
    model = OmniThinker(checkpoint_dir)
    arrivals = poisson_arrivals(len(prompts), request_rate, arrival_seed) if request_rate else [0.0] * len(prompts)
    records = [RequestRecord(index=i) for i in range(len(prompts))]
    on_done = progress_logger(label, len(prompts), progress_every)

    def sequence(ids: list[int]) -> ThinkerSequence:
        return ThinkerSequence(model, tok, ThinkerRequest(
            input_ids=ids, max_new_tokens=max_new_tokens, stop_token_ids=(eos,), block_size=cfg.block_size,
            sampling=SamplingParams(temperature=0, min_new_tokens=min_new_tokens, stop_token_ids=(eos,))))

    async def one(engine, i: int, t_run: float, slots: asyncio.Semaphore) -> None:
        await asyncio.sleep(max(0.0, t_run + arrivals[i] - time.perf_counter()))
        async with slots:
            rec = records[i]
            t0 = time.perf_counter()
            rec.start_s = t0 - t_run
            stamps, tokens, text = [], [], []
            try:
                async for out in engine.generate(f"bench_{i}", sequence(prompts[i])):
                    stamps.append(time.perf_counter())
                    tokens += out.token_ids
                    text.append(out.text)
                    rec.finish_reason = out.finish_reason or rec.finish_reason
                rec.ok = True
            except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crash
                rec.error = f"{type(exc).__name__}: {exc}"[:300]
            finish_token_record(rec, t0, stamps, tokens, text)
            on_done(rec)

    async def main() -> float:
        engine = AREngine("thinker", model, cfg, max_active=max(cap, 1), torch_threads=torch.get_num_threads())
        try:
            if warmup:
                async for _ in engine.generate("warmup", ThinkerSequence(model, tok, ThinkerRequest(
                        input_ids=prompts[0], max_new_tokens=2, stop_token_ids=(eos,),
                        sampling=SamplingParams(temperature=0)))):
                    pass
            slots = asyncio.Semaphore(cap)
            t_run = time.perf_counter()
            await asyncio.gather(*(one(engine, i, t_run, slots) for i in range(len(prompts))))
            return time.perf_counter() - t_run
        finally:
            await engine.cleanup()

    wall = asyncio.run(main())
    notes = [f"omni_serve AREngine (in process), greedy, {torch.get_num_threads()} torch threads; KV cache "
             f"{cfg.num_kv_blocks} blocks x {cfg.block_size}, max_batch_tokens={cfg.max_batch_tokens}, "
             f"max_num_seqs={cfg.max_num_seqs}"]
    return RunResult(label=label, system="engine_text", mode="text", concurrency=concurrency,
                     request_rate=request_rate, wall_s=wall, streaming=True, records=records, notes=notes)
