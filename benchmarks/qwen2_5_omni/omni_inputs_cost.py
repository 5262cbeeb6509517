"""Ingress preprocessing cost of audio clips: transformers' Qwen-Omni processor called as is vs omni_serve's call
of it (the number quoted in omni_serve/models/qwen2_5_omni_inputs.py).

Usage: python benchmarks/qwen2_5_omni/omni_inputs_cost.py [CHECKPOINT_DIR] (default checkpoints/qwen2_5_omni-tiny)

Prints the mean time of one user turn with two clips (2 s and 1 s) through ``AutoProcessor``'s default call
(Qwen2.5-Omni pads each clip to 300 s) and through ``OmniInputProcessor`` (padded to the longest clip), with the
feature tensors' shapes; ``tests/unit/test_omni_inputs.py`` holds the two equal where the encoder reads them.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout


def main(checkpoint: str, repeats: int = 5) -> None:
    from transformers import AutoProcessor

    from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
    from tests.omni_cases import audio_clip

    reference, ours = AutoProcessor.from_pretrained(checkpoint), OmniInputProcessor(checkpoint)
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "audio"}, {"type": "text", "text": "hi"}]}]
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    clips = [audio_clip(2.0), audio_clip(1.0)]
    runs = {"AutoProcessor (default call)": lambda: reference(text=[text], audio=clips, return_tensors="pt"),
            "OmniInputProcessor": lambda: ours(messages, clips)}
    for name, run in runs.items():
        run()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            out = run()
        features = out["input_features"] if isinstance(out, dict) or hasattr(out, "keys") else out.input_features
        print(f"{name}: {(time.perf_counter() - start) / repeats * 1000:.0f} ms, features {tuple(features.shape)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/qwen2_5_omni-tiny")
