"""code2wav cost and seam accuracy on a checkpoint (the numbers quoted in docs/benchmarks.md).

Usage: python benchmarks/qwen2_5_omni/code2wav_cost.py [CHECKPOINT_DIR] (default checkpoints/qwen2_5_omni-small)

Prints (1) transformers' whole-sequence token2wav time per code, (2) omni_serve's batched DiT windows time
per window code, in float32 and with the blocks in bfloat16 (``dit_dtype``, with its error against float32),
(3) the relative max error of streamed chunks against the whole-sequence waveform for several context settings.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from omni_serve.families.qwen2_5_omni.messages import CodecChunk
from omni_serve.families.qwen2_5_omni.replica.code2wav import Code2WavCompute, Code2WavRequest, Code2WavStream
from omni_serve.models.qwen2_5_omni import DiTWindow, OmniCode2Wav


def stream(model, codes, seed, steps, **kw):
    compute, st = Code2WavCompute(model, steps, 0.5, -1.0), Code2WavStream(model, Code2WavRequest("Chelsie", seed, steps, **kw))
    st.feed(CodecChunk(codes=codes, end=True))
    outs = []
    with torch.inference_mode():
        while st.ready():
            outs += st.complete(compute([st.work()[1]])[0])
    return np.concatenate([o.audio for o in outs])


def main() -> None:
    ckpt = sys.argv[1] if len(sys.argv) > 1 else "checkpoints/qwen2_5_omni-small"
    torch.set_num_threads(2)
    model = OmniCode2Wav(ckpt)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 8000, (128,), generator=gen).tolist()
    model.synthesize(codes[:24], "Chelsie", 0)  # warm-up
    t = time.perf_counter()
    whole = model.synthesize(codes, "Chelsie", 7).numpy()
    dt = time.perf_counter() - t
    print(f"transformers token2wav, whole sequence of {len(codes)} codes: {dt:.2f} s = {dt / len(codes) * 1e3:.1f} ms/code")
    for n, b in [(72, 1), (72, 8), (120, 8)]:
        windows = [DiTWindow(torch.randint(0, 8000, (n,), generator=gen).tolist(), torch.randn(2 * n, 80, generator=gen),
                             "Chelsie") for _ in range(b)]
        t = time.perf_counter()
        model.dit_windows(windows)
        dt = time.perf_counter() - t
        print(f"omni_serve DiT windows, {b} x {n} codes in one batch: {dt:.2f} s = {dt / (n * b) * 1e3:.1f} ms/window code")
    low = OmniCode2Wav(ckpt, dit_dtype=torch.bfloat16)  # stages.code2wav.params.dit_dtype: bfloat16
    windows = [DiTWindow(torch.randint(0, 8000, (120,), generator=gen).tolist(), torch.randn(240, 80, generator=gen),
                         "Chelsie") for _ in range(8)]
    low.dit_windows(windows[:1])
    t = time.perf_counter()
    mel_low = torch.stack(low.dit_windows(windows))
    dt = time.perf_counter() - t
    mel = torch.stack(model.dit_windows(windows))
    err = float((mel_low - mel).abs().max() / mel.abs().max())
    print(f"omni_serve DiT windows, bfloat16 blocks, 8 x 120 codes: {dt / 960 * 1e3:.1f} ms/window code; mel max "
          f"|diff| / peak against float32 = {err:.1e}")
    peak = np.abs(whole).max()
    for kw in [{}, {"left_context_codes": 0}, {"chunk_codes": 48}, {"right_context_codes": 0}]:
        err = np.abs(stream(model, codes, 7, 10, **kw) - whole).max() / peak
        print(f"streamed chunks {kw or 'defaults'}: max |diff| / peak = {err:.1e}")


if __name__ == "__main__":
    main()
