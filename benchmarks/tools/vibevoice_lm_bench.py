"""VibeVoice's lm stage on the AR engine against transformers' ``generate``, in process (no Ray, no HTTP).

Usage: python benchmarks/tools/vibevoice_lm_bench.py CHECKPOINT [--requests 8] [--threads 1] [--new-tokens N]

Runs ``--requests`` text-to-speech requests (different scripts, synthetic reference voices and seeds; the
checkpoint's generation config: 10 diffusion steps, CFG 1.3) three ways: ``generate`` one at a time (seeded with
``torch.manual_seed``), the engine (``VibeVoiceLM`` + ``VibeVoiceSequence`` on ``AREngine``) one request at a time,
and the engine with every request in flight at once. Prints per way the wall time and the process' CPU time,
speech tokens per second and seconds of audio per second (24 kHz, 3200 samples a token) of wall time, and the largest
latent difference of the engine's results from ``generate``'s. On a machine shared with other work, the CPU time is
the steadier measure (``tokens/cpu-s``). One warm-up request per way is not timed (the first ``generate`` imports
diffusers).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import time

import numpy as np
import torch

SAMPLE_RATE, HOP = 24000, 3200
TEXTS = ["Hello world, this is a test of the speech engine.", "The cat sat by the river and watched the boats.",
         "A quick brown fox jumps over the lazy dog.", "Good morning to you all, and welcome.",
         "Rain is expected in the afternoon, so take an umbrella.", "Please hold the line while we connect you.",
         "The museum opens at nine and closes at five.", "Three trains leave the station every hour."]


def _voice(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    t = np.arange(int((1.5 + 0.25 * (i % 5)) * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * (150 + 37 * i) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - informational only
        return platform.processor() or "unknown"


def run_generate(hf, processor, i: int, new_tokens: int):
    content = [{"type": "text", "text": TEXTS[i % len(TEXTS)]}, {"type": "audio", "audio": _voice(i)}]
    inputs = processor.apply_chat_template([{"role": "0", "content": content}], tokenize=True, return_dict=True,
                                           return_tensors="pt", processor_kwargs={"sampling_rate": SAMPLE_RATE})
    latents, sample = [], hf._sample_audio_latent
    hf._sample_audio_latent = lambda *a, **k: latents.append(sample(*a, **k)) or latents[-1]
    try:
        torch.manual_seed(i)
        hf.generate(**inputs, max_new_tokens=new_tokens)
    finally:
        del hf._sample_audio_latent
    return torch.cat(latents).squeeze(1)


async def run_engine(model, indices: list[int], new_tokens: int, in_flight: bool) -> dict[int, torch.Tensor]:
    from omni_serve.engines.ar import ARConfig, AREngine
    from omni_serve.models.vibevoice import SpeechChunk, SpeechRequest
    from omni_serve.models.vibevoice_sequence import VibeVoiceSequence

    engine = AREngine("lm", model, ARConfig(), torch_threads=torch.get_num_threads())

    async def one(i):
        prompt = model.prompt([("0", TEXTS[i % len(TEXTS)])], {"0": _voice(i)})
        seq = VibeVoiceSequence(model, SpeechRequest(prompt=prompt, seed=i, max_new_tokens=new_tokens))
        outs = [o async for o in engine.generate(f"r{i}", seq)]
        return i, torch.stack([o.latent for o in outs if isinstance(o, SpeechChunk)])

    try:
        if in_flight:
            results = await asyncio.gather(*(one(i) for i in indices))
        else:
            results = [await one(i) for i in indices]
        return dict(results)
    finally:
        await engine.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: the generation config's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForTextToWaveform, AutoProcessor

    from omni_serve.models.vibevoice import VibeVoiceLM

    processor = AutoProcessor.from_pretrained(args.checkpoint)
    hf = AutoModelForTextToWaveform.from_pretrained(args.checkpoint).eval()
    model = VibeVoiceLM(args.checkpoint)
    new = args.new_tokens or model.defaults()["max_new_tokens"]
    n = args.requests
    print(f"CPU: {_cpu()}; torch threads: {args.threads}; {n} requests x {new} speech tokens "
          f"({new * HOP / SAMPLE_RATE:.1f} s of audio each)")
    run_generate(hf, processor, n, 4)  # warm-up (diffusers import, lazy init)
    asyncio.run(run_engine(model, [n], 4, False))

    rows = []
    start, cpu = time.perf_counter(), time.process_time()
    reference = {i: run_generate(hf, processor, i, new) for i in range(n)}
    rows.append(("generate, one at a time", time.perf_counter() - start, time.process_time() - cpu, None))
    for label, in_flight in (("engine, one at a time", False), (f"engine, {n} in flight", True)):
        start, cpu = time.perf_counter(), time.process_time()
        got = asyncio.run(run_engine(model, list(range(n)), new, in_flight))
        rows.append((label, time.perf_counter() - start, time.process_time() - cpu,
                     max((got[i] - reference[i]).abs().max().item() for i in range(n))))
    tokens = n * new
    print(f"{'way':26s} {'wall s':>7s} {'cpu s':>7s} {'tokens/s':>9s} {'audio s/s':>10s} {'tokens/cpu-s':>13s} "
          f"{'x generate (cpu)':>17s} {'max |dlatent|':>14s}")
    for label, wall, cpu, diff in rows:
        print(f"{label:26s} {wall:7.2f} {cpu:7.2f} {tokens / wall:9.2f} {tokens * HOP / SAMPLE_RATE / wall:10.3f} "
              f"{tokens / cpu:13.2f} {rows[0][2] / cpu:17.2f} {'-' if diff is None else f'{diff:.2e}':>14s}")


if __name__ == "__main__":
    main()
