"""Adapters over Qwen3-ASR's two halves (transformers' ``Qwen3ASRForConditionalGeneration``, the ``-hf`` layout);
each stage loads only its own part of the checkpoint.

Contract:

- ``Qwen3ASREncoder(dir)``: the audio tower and the projector (``model.audio_tower.*``,
  ``model.multi_modal_projector.*``). ``encode(clips)`` takes clips as ``(features [128, T], frames)`` pairs: a
  clip's own log-mel (the processor's output for that clip alone, zero-padded to a multiple of 100 frames) and its
  valid frame count. Clips of any lengths run in ONE encoder call (zero-padded in mel space to the longest, the
  mask marking each clip's frames: what the processor builds for one clip, so each clip gets its alone
  embeddings to float rounding) and come back split: ``[tokens_i, H]`` each, ``tokens_i`` =
  ``audio_tokens(frames_i)``. (The processor's own batching pads the *waveforms* before the STFT, which moves a
  shorter clip's last embedding and can add an audio token: docs/upstream_qwen3_asr.md, pitfall 1.)
- ``Qwen3ASRLM(dir)``: the Qwen3 decoder (``model.language_model.*``) with its tied head, an ``ARModel`` for
  ``omni_serve.engines.ar.AREngine``. ``prompt_rows(input_ids, audio)`` is the prompt's input rows: the token
  embeddings with the audio embeddings scattered into the ``<|audio_pad|>`` rows, in order (``masked_scatter``, as
  ``Qwen3ASRModel.forward`` does) and 1-D positions ``0..L-1`` (no M-RoPE: the ``-hf`` port runs a plain Qwen3
  decoder). ``eos_token_ids``: the generation config's stop tokens.
- ``audio_tokens(frames)``: audio tokens of a clip of ``frames`` valid mel frames (the encoder's own formula).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_serve.models.loading import load_component
from omni_serve.models.paged_decoder import PagedDecoder

CHUNK_FRAMES = 100  # the encoder's conv chunk (2 * n_window mel frames): features are padded to a multiple of it


def audio_tokens(frames: int) -> int:
    """Audio tokens the encoder gives a clip of ``frames`` valid mel frames: 13 per full 100-frame chunk, and three
    stride-2 halvings of a partial one (transformers' ``_get_feat_extract_output_lengths``)."""
    full, rest = divmod(frames, CHUNK_FRAMES)
    for _ in range(3):
        rest = (rest - 1) // 2 + 1 if rest > 0 else 0
    return full * 13 + rest


class Qwen3ASREncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from transformers import Qwen3ASRConfig

        self.config = Qwen3ASRConfig.from_pretrained(checkpoint_dir)
        self.model = load_component(checkpoint_dir, _AudioOnly, self.config,
                                    {"model.audio_tower.": "audio_tower.",
                                     "model.multi_modal_projector.": "multi_modal_projector."}, dtype, device)
        self.dtype, self.device = dtype, device
        self.modules = {"audio_tower": self.model.audio_tower, "projector": self.model.multi_modal_projector}

    @torch.inference_mode()
    def encode(self, clips: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        width = max(f.shape[-1] for f, _ in clips)
        feats = torch.zeros(len(clips), clips[0][0].shape[0], width, dtype=self.dtype)
        mask = torch.zeros(len(clips), width, dtype=torch.int32)
        for i, (f, frames) in enumerate(clips):
            feats[i, :, :f.shape[-1]] = f
            mask[i, :frames] = 1
        out = self.model.audio_tower(input_features=feats.to(self.device), input_features_mask=mask.to(self.device))
        embeds = self.model.multi_modal_projector(out.last_hidden_state)
        return list(torch.split(embeds.float().cpu(), [audio_tokens(frames) for _, frames in clips]))


class _AudioOnly(torch.nn.Module):
    """The audio half of ``Qwen3ASRModel``: its audio tower and projector, under the same names."""

    def __init__(self, config):
        from transformers import AutoModel
        from transformers.models.qwen3_asr.modeling_qwen3_asr import Qwen3ASRMultiModalProjector

        super().__init__()
        self.audio_tower = AutoModel.from_config(config.audio_config)
        self.multi_modal_projector = Qwen3ASRMultiModalProjector(config)


class Qwen3ASRLM(PagedDecoder):
    """``prepared_layers``: run the decoder's layers through ``PreparedDecoder`` (the stage's
    ``engine.ar.prepared_layers``; q/k norms included), else through transformers' forward."""

    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu", prepared_layers: bool = True):
        from transformers import GenerationConfig, Qwen3ASRConfig, Qwen3Model

        self.config = Qwen3ASRConfig.from_pretrained(checkpoint_dir)
        text = self.config.text_config
        self.model = load_component(checkpoint_dir, Qwen3Model, text, {"model.language_model.": ""}, dtype, device)
        self.use_paged_attention(self.model.config, dtype, device)
        self.audio_token_id = self.config.audio_token_id
        eos = GenerationConfig.from_pretrained(checkpoint_dir).eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos])
        self.modules = {"model": self.model}
        if self.prepare_layers(self.model, prepared_layers, "llm.layers"):
            self.modules["layers"] = self.prepared
        self.row_size = text.hidden_size  # an input row is a token's (or an audio token's) embedding
        self.position_rows = 1

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids.to(self.device))

    @torch.inference_mode()
    def prompt_rows(self, input_ids: list[int], audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds ``[L, E]``, positions ``[1, L]``) of a prompt whose ``<|audio_pad|>`` rows take ``audio``."""
        ids = torch.tensor(input_ids)
        slots = ids == self.audio_token_id
        if int(slots.sum()) != audio.shape[0]:
            raise ValueError(f"the prompt has {int(slots.sum())} audio placeholders for {audio.shape[0]} audio "
                             "embeddings")
        embeds = self.embed(ids).clone()
        embeds[slots.to(embeds.device)] = audio.to(embeds.device, embeds.dtype)
        return embeds, torch.arange(len(input_ids)).unsqueeze(0)

    @torch.inference_mode()
    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        hidden = self.run(self.model, embeds, positions, batch)
        # the head is tied to the token embeddings (tie_word_embeddings)
        logits = F.linear(hidden[logit_rows.to(hidden.device)], self.model.embed_tokens.weight).float()
        return (hidden if want_hidden else None), logits
