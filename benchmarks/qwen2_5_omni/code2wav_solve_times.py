"""code2wav's compute in process, one thread: the timings behind docs/benchmarks.md and docs/prepared.md.

Usage: python benchmarks/qwen2_5_omni/code2wav_solve_times.py [CHECKPOINT_DIR] [--solves-only]
(default checkpoints/qwen2_5_omni-small)

Prints the CPU's capability and (1) one ``dit_windows`` solve (10 steps) of several window sets, bfloat16 and
float32 prepared blocks, with the linear layers' path in each (prepacked, or plain where the CPU has no bfloat16
product), and transformers' own layers (``prepared_dit: false``, float32); ``--solves-only`` stops here); (2) the vocoder
on 208 frames (a 96-code chunk with its context) through transformers' module and through ``OmniCode2Wav.vocode``;
(3) a request's code2wav cost (384 random codes, the served chunking) with 1, 2 and 4 requests per call, split
into DiT and vocoder. Each timing is the mean of 3 runs after a warm-up; run it on a quiet machine.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from omni_kernels import cpu_capability, kernel_paths

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.qwen2_5_omni.ceiling import run_code2wav_streams
from benchmarks.tools.ceiling_report import timed

from omni_serve.families.qwen2_5_omni.replica.code2wav import Code2WavCompute
from omni_serve.models.qwen2_5_omni import DiTWindow, OmniCode2Wav


def request_cost(model: OmniCode2Wav, per_call: int, gen: torch.Generator) -> tuple[float, float, float]:
    """Seconds per request (total, DiT, vocoder) for ``per_call`` requests of 384 codes stepped as the engine does."""
    spent = {"dit": 0.0, "vocode": 0.0}

    def timing(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out
        return run

    dit, vocode = model.dit_windows, model.vocode
    model.dit_windows, model.vocode = timing("dit", dit), timing("vocode", vocode)
    try:
        compute = Code2WavCompute(model, 10, 0.5, -1.0)
        run_code2wav_streams(model, compute, per_call, 384, 10, gen)  # warm-up
        spent.update(dit=0.0, vocode=0.0)
        start = time.perf_counter()
        run_code2wav_streams(model, compute, per_call, 384, 10, gen)
        total = time.perf_counter() - start
    finally:
        model.dit_windows, model.vocode = dit, vocode
    return total / per_call, spent["dit"] / per_call, spent["vocode"] / per_call


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ckpt = args[0] if args else "checkpoints/qwen2_5_omni-small"
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print("cpu:", cpu_capability().as_dict())
    for dtype, prepared in ((torch.bfloat16, True), (torch.float32, True), (torch.float32, False)):
        model = OmniCode2Wav(ckpt, dit_dtype=dtype, prepared_dit=prepared)
        name = str(dtype).split(".")[-1] if prepared else "library"
        if prepared:
            print(f"dit {name}: linear layers {kernel_paths()[f'linear.{name}']}")

        def window(n: int) -> DiTWindow:
            return DiTWindow(torch.randint(0, 8000, (n,), generator=gen).tolist(),
                             torch.randn(model.repeats * n, model.mel_dim, generator=gen), "Chelsie")

        for lengths in ([24], [120], [120, 120], [120] * 4):
            windows = [window(n) for n in lengths]
            seconds = timed(lambda: model.dit_windows(windows, 10))
            print(f"dit {name:8s} windows {lengths}: {seconds:.3f} s per solve")
    if "--solves-only" in sys.argv:
        return
    mel = torch.randn(model.mel_dim, 208, generator=gen) - 4
    with torch.inference_mode():
        module = timed(lambda: model.vocoder(mel.unsqueeze(0)))
        served = timed(lambda: model.vocode(mel))
    print(f"vocoder 208 frames: {module * 1e3:.1f} ms through the module, {served * 1e3:.1f} ms through vocode()")
    model = OmniCode2Wav(ckpt, dit_dtype=torch.bfloat16)
    for per_call in (1, 2, 4):
        total, dit, voc = request_cost(model, per_call, gen)
        print(f"request of 384 codes, bfloat16 DiT, {per_call} per call: {total:.2f} s (DiT {dit:.2f}, vocoder {voc:.2f})")


if __name__ == "__main__":
    main()
