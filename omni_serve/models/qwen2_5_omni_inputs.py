"""Turn chat messages + decoded media into Qwen-Omni model inputs (what ``Qwen2_5OmniProcessor`` and
``Qwen3OmniMoeProcessor`` do).

Contract: ``OmniInputProcessor(checkpoint_dir)(messages, audios, images) -> OmniInputs``. ``messages`` use the
chat template's part types (``text``, ``audio``, ``image``) in order; ``audios`` are mono float32 arrays at
``sampling_rate`` (16 kHz) and ``images`` PIL images, in the order their parts appear. Each media
placeholder is expanded to as many tokens as its encoder will output, with the same arithmetic as
transformers' processor. Everything here is CPU preprocessing: no model weights.

Why not ``Qwen2_5OmniProcessor`` itself: in transformers 5.x it cannot be constructed without torchvision
(it requires a video processor), and torchvision has no CPU wheel matching torch 2.13. Its parts — the
tokenizer, the Whisper feature extractor and the Qwen2-VL image processor — load fine and are used as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class OmniInputs:
    input_ids: torch.Tensor  # [1, L] long
    input_features: torch.Tensor | None = None  # [n_audio, mel, frames]
    feature_attention_mask: torch.Tensor | None = None  # [n_audio, frames]
    pixel_values: torch.Tensor | None = None  # [patches, patch_dim]
    image_grid_thw: torch.Tensor | None = None  # [n_images, 3]

    @property
    def audio_seqlens(self) -> torch.Tensor | None:
        return None if self.feature_attention_mask is None else self.feature_attention_mask.sum(-1)

    def reference_kwargs(self) -> dict:
        """The keyword arguments transformers' ``generate`` takes for these inputs.

        Pixel values go with the ``thinker_`` prefix: transformers 5.23 otherwise also hands them to the
        talker, whose ``generate`` rejects them.
        """
        kw = {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids)}
        if self.input_features is not None:
            kw.update(input_features=self.input_features, feature_attention_mask=self.feature_attention_mask)
        if self.pixel_values is not None:
            kw.update(thinker_pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        return kw


def audio_output_lengths(feature_lengths: torch.Tensor) -> torch.Tensor:
    """Audio tokens per clip after the audio tower's two stride-2 stages (as transformers computes it)."""
    lengths = (feature_lengths - 1) // 2 + 1
    return (lengths - 2) // 2 + 1


class OmniInputProcessor:
    """``audio_tokens(feature_lengths) -> tokens per clip``: the audio tower's arithmetic (Qwen2.5-Omni's by
    default; Qwen3-Omni passes its own, see ``omni_serve.graphs.qwen3_omni.frontend``)."""

    def __init__(self, checkpoint_dir: str, audio_tokens=audio_output_lengths):
        self.audio_tokens = audio_tokens
        from transformers import AutoImageProcessor, AutoTokenizer, WhisperFeatureExtractor

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(checkpoint_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(checkpoint_dir)
        self.sampling_rate = self.feature_extractor.sampling_rate
        tok = self.tokenizer
        self.audio_token, self.image_token = tok.audio_token, tok.image_token
        self.merge_size = self.image_processor.merge_size

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def __call__(self, messages: list[dict], audios: list[np.ndarray] = (), images: list = ()) -> OmniInputs:
        text = self.render(messages)
        out = OmniInputs(input_ids=torch.empty(0))
        if audios:
            feats = self.feature_extractor(
                list(audios), sampling_rate=self.sampling_rate, return_attention_mask=True,
                padding="longest", return_tensors="pt")
            out.input_features = feats["input_features"]
            out.feature_attention_mask = feats["attention_mask"]
            counts = self.audio_tokens(out.feature_attention_mask.sum(-1)).tolist()
            text = _expand(text, self.audio_token, counts)
        if images:
            pix = self.image_processor(images=list(images), return_tensors="pt")
            out.pixel_values, out.image_grid_thw = pix["pixel_values"], pix["image_grid_thw"]
            counts = (out.image_grid_thw.prod(-1) // self.merge_size**2).tolist()
            text = _expand(text, self.image_token, counts)
        out.input_ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        return out


def _expand(text: str, placeholder: str, counts: list[int]) -> str:
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"{len(pieces) - 1} {placeholder} placeholders for {len(counts)} inputs")
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:]):
        out.append(placeholder * int(count))
        out.append(piece)
    return "".join(out)
