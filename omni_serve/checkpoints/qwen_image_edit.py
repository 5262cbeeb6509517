"""Deterministic random-weight Qwen-Image-Edit checkpoints in the diffusers on-disk layout.

Contract: ``make_checkpoint(out_dir, size, seed)`` writes what ``diffusers.QwenImageEditPipeline.from_pretrained``
reads from a real ``Qwen/Qwen-Image-Edit`` directory: model_index.json and the component folders (Qwen-Image's
components, ``omni_serve.checkpoints.qwen_image.build_components``: a Qwen2.5-VL text encoder whose vision tower
reads the input image, the MMDiT, the VAE, the scheduler) plus ``processor/`` (the tokenizer files and the
Qwen2-VL image processor config, ``processor_class`` ``Qwen2VLProcessor``) and ``omni_serve_checkpoint.json``.
The same ``size`` and ``seed`` always yield byte-identical weights.

The tokenizer is trained with the edit pipeline's prompt template in its corpus, so that the template's system
prefix up to ``<|im_start|>user\\n`` is the 64 tokens the pipeline drops (``prompt_template_encode_start_idx``),
as with the real tokenizer: only the image tokens, the instruction and the assistant header reach the DiT.

Sizes (parameters in ``SIZES``' comments): ``tiny`` for tests; the VAE is narrower than Qwen-Image's tiny one
because the pipeline VAE-encodes the input image at ~1 MP whatever its size (~1.6 s on 2 cores instead of ~4 s);
``small`` (Qwen-Image's small components) for benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
import os

from omni_serve.checkpoints import write_marker
from omni_serve.checkpoints.qwen_image import CHAT_TEMPLATE, SIZES as IMAGE_SIZES, SPECIAL_TOKENS, build_components

SIZES = {
    "tiny": dataclasses.replace(IMAGE_SIZES["tiny"], vocab=1024, vae_base_dim=4),
    "small": dataclasses.replace(IMAGE_SIZES["small"], vocab=2048),
}
EXTRA_SPECIAL = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                 "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}
# transformers' Qwen2VLImageProcessor defaults (what the real checkpoint's processor/ holds)
IMAGE_PROCESSOR = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
                   "max_pixels": 28 * 28 * 1280}


def prompt_template() -> tuple[str, int]:
    """(the pipeline's prompt template, the tokens it drops), read off an instance built without components."""
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None,
                                 transformer=None)
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


def template_prefix_tokens(tokenizer) -> int:
    """Tokens of the template up to and including ``<|im_start|>user\\n`` (64 with the real tokenizer)."""
    template, _ = prompt_template()
    return len(tokenizer(template[:template.index("<|vision_start|>")])["input_ids"])


def build_tokenizer(size) -> object:
    from omni_serve.checkpoints.tokenizer import build_qwen_tokenizer

    template, _ = prompt_template()
    corpus = [template.replace("{}", "")] * 400
    return build_qwen_tokenizer(SPECIAL_TOKENS, size.vocab, EXTRA_SPECIAL, CHAT_TEMPLATE, extra_corpus=corpus)


def _write_processor(out_dir: str, tokenizer) -> None:
    """processor/: the tokenizer and the image processor config of a Qwen2VLProcessor (written part by part: the
    processor itself cannot be built here, its video processor needs torchvision)."""
    from transformers import Qwen2VLImageProcessorPil

    path = os.path.join(out_dir, "processor")
    tokenizer.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)
    image_processor.save_pretrained(path)
    config_path = os.path.join(path, "preprocessor_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight Qwen-Image-Edit checkpoint to ``out_dir``; returns the path."""
    from diffusers import QwenImagePipeline

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    s = SIZES[size]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(s)
    # Saved through the text-to-image pipeline (same component folders), then declared as the edit pipeline.
    QwenImagePipeline(**build_components(s, tokenizer, seed)).save_pretrained(out_dir, safe_serialization=True)
    _write_processor(out_dir, tokenizer)
    index_path = os.path.join(out_dir, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index.update(_class_name="QwenImageEditPipeline", processor=["transformers", "Qwen2VLProcessor"])
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    write_marker(out_dir, "qwen_image_edit", size, seed)
    return out_dir
