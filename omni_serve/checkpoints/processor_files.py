"""The processor files of an omni checkpoint (tokenizer, Whisper feature extractor, Qwen2-VL image processor).

Contract: ``save_omni_processor_parts(tokenizer, out_dir, processor_class, patch_size, min_pixels, max_pixels)``
writes the tokenizer files and one ``preprocessor_config.json`` holding both the feature extractor's and the image
processor's settings (as the real Qwen-Omni checkpoints ship it), naming ``processor_class``. Each part loads on its
own (``WhisperFeatureExtractor.from_pretrained``, ``AutoImageProcessor.from_pretrained``); the Omni processors
themselves cannot be built here, they insist on a video processor, which needs torchvision.
"""

from __future__ import annotations

import json
import os
import tempfile


def save_omni_processor_parts(tokenizer, out_dir: str, processor_class: str, patch_size: int, min_pixels: int,
                              max_pixels: int) -> None:
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    parts = (
        Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size,
                                 temporal_patch_size=2, merge_size=2),
        WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300, n_fft=400,
                                padding_value=0.0, return_attention_mask=True),
    )
    merged: dict = {}
    for part in parts:  # both write preprocessor_config.json: one file holds both
        with tempfile.TemporaryDirectory() as tmp:
            part.save_pretrained(tmp)
            with open(os.path.join(tmp, "preprocessor_config.json")) as f:
                merged.update(json.load(f))
    merged["processor_class"] = processor_class
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(merged, f, indent=2, sort_keys=True)
    tokenizer.save_pretrained(out_dir)
