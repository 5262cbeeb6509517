"""Qwen3-Omni (MoE) stage adapters over transformers' modules: one class per stage, each loading only its weights.

Contract (tensors on the adapter's device; H = thinker hidden size, Ht = talker hidden size, G = code groups):

- ``Qwen3OmniEncoder``: audio tower + vision tower. ``encode_audio(features, feature_mask) -> [n_audio, H]``;
  ``encode_image(pixel_values, grid_thw) -> [n_image, (1 + D) * H]``: per image (or video: the same tower)
  token its embedding followed by its D deepstack features (the vision tower's intermediate mergers, added to
  the thinker's first D layers).
- ``Qwen3OmniThinker``: MoE text decoder + lm_head, an ``ARModel``. An input row is ``[(1 + D) * H]``: the
  input embedding, then D deepstack features (zero for every row that is not an image/video token; adding zero
  is exact, so the packed batch adds them to every row that has any). ``forward_packed`` returns, when asked
  for hidden states, those after layer ``accept_hidden_layer`` (what the talker reads for media rows), and the
  logits of ``logit_rows``. ``prompt_positions`` gives the 4-row positions ``generate`` uses (text + M-RoPE).
- ``Qwen3OmniTalker``: MoE codec decoder, an ``ARModel`` whose rows are talker-sized inputs (``prompt_rows``
  builds the prompt exactly as ``Qwen3OmniMoeForConditionalGeneration.generate`` does from the thinker's
  vectors). Its hidden states are the last (normed) ones, which the code predictor reads. ``run_followups``
  runs the code predictor for a batch of codec frames at once (all frames have the same length, so one
  dense batch, fresh KV per frame): it draws the G-1 residual codes of each frame and returns them with the
  sum of the frame's G code embeddings (the next talker input, before the text part is added).
- ``Qwen3OmniCode2Wav``: the causal ConvNet vocoder. ``feed(stream, codes [G, m])`` decodes new frames of a
  ``VocoderStream`` and returns the samples final now (``omni_serve.models.qwen3_omni_vocoder``: the pieces
  concatenate to one whole-sequence forward); ``reference(codes)`` is ``chunked_decode`` as ``generate`` calls it.

Both decoders are mixtures of experts that expert parallelism can split (``ExpertSplit``: ``check_expert_shard``,
``shard_experts``).

No module is subclassed or patched; ``RopeIndex`` borrows transformers' own position-index functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from omni_serve.engines.sampling import Sampler, select_rows
from omni_serve.models.loading import load_component
from omni_serve.models.paged_decoder import PagedDecoder
from omni_serve.models.qwen2_5_omni import MropeIndex, OmniEncoder, ThinkerDecoder
from omni_serve.models.qwen3_omni_layout import SAMPLE_RATE, load_config
from omni_serve.models.qwen3_omni_vocoder import StreamingCode2Wav, VocoderStream

# What Qwen3OmniMoeForConditionalGeneration.generate hard-codes for the talker and code2wav.
SUPPRESSED_CODEC_TAIL = 1024  # the talker never samples the top 1024 codec ids (except its eos)
REFERENCE_CHUNK, REFERENCE_LEFT_CONTEXT = 300, 25  # code2wav.chunked_decode(chunk_size, left_context_size)


class RopeIndex(MropeIndex):
    """transformers' Qwen3-Omni M-RoPE index without holding the model that defines it (it reads only
    ``self.config`` and ``self.spatial_merge_size``); used for the thinker's and the talker's prompts."""

    _base = hf.Qwen3OmniMoePreTrainedModelForConditionalGeneration
    get_rope_index = _base.get_rope_index
    get_llm_pos_ids_for_vision = _base.get_llm_pos_ids_for_vision
    get_chunked_index = _base.get_chunked_index


def talker_rope_config(full):
    """The talker's config as its M-RoPE index reads it. transformers' ``get_rope_index`` reads
    ``config.audio_config.n_window`` for audio placed with a video (``use_audio_in_video``), which the talker's
    config lacks (transformers 5.23: ``generate`` raises AttributeError there); the audio tower's is the one
    meant. A copy, so the loaded config stays as it is."""
    import copy

    cfg = copy.copy(full.talker_config)
    cfg.audio_config = full.thinker_config.audio_config
    return cfg


class Qwen3OmniEncoder(OmniEncoder):
    audio_tower, vision_tower = hf.Qwen3OmniMoeAudioEncoder, hf.Qwen3OmniMoeVisionEncoder
    read_config = staticmethod(load_config)

    @torch.inference_mode()
    def encode_audio(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
        lengths = feature_attention_mask.sum(-1)
        feats = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)
        return self.audio(feats.to(self.device, self.audio.dtype), feature_lens=lengths).last_hidden_state

    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        out = self.visual(pixel_values.to(self.device, self.visual.dtype), grid_thw=image_grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


class ExpertSplit:
    """An adapter whose decoder (``moe_decoder``) is a transformers mixture of experts that expert parallelism
    (``omni_serve.parallel.experts``) can split: ``check_expert_shard(world)`` raises ``ValueError`` unless it can
    split the MoE layers' experts across ``world`` ranks; ``shard_experts(world)`` (inside the ranks' process group)
    keeps this rank's share of them; attention, router, shared experts, embeddings and KV cache stay whole."""

    @property
    def moe_decoder(self):
        raise NotImplementedError

    def check_expert_shard(self, world: int) -> None:
        from omni_serve.parallel.experts import check_expert_split

        check_expert_split(self.moe_decoder, world)

    def shard_experts(self, world: int, group=None) -> None:
        from omni_serve.parallel.experts import shard_experts

        shard_experts(self.moe_decoder, world, group)


class Qwen3OmniThinker(ExpertSplit, ThinkerDecoder):
    text_model_class, rope_class = hf.Qwen3OmniMoeThinkerTextModel, RopeIndex

    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        full = load_config(checkpoint_dir)
        self._load_thinker(checkpoint_dir, full.thinker_config, dtype, device)
        self.deepstack_layers = len(self.config.vision_config.deepstack_visual_indexes)
        self.row_size = self.hidden_size * (1 + self.deepstack_layers)  # [embedding | deepstack features]
        self.accept_layer = full.talker_config.accept_hidden_layer
        self.media_token_ids = (self.config.audio_token_id, self.config.image_token_id, self.config.video_token_id)
        # the turn markers the talker's inputs are cut by
        self.im_start_token_id, self.user_token_id = full.im_start_token_id, full.user_token_id
        self.assistant_token_id = full.assistant_token_id

    @property
    def moe_decoder(self):
        return self.model

    def rows(self, embeds: torch.Tensor) -> torch.Tensor:
        """Input rows for embeddings without deepstack features (text and audio tokens, generated tokens)."""
        return torch.cat([embeds, embeds.new_zeros(embeds.shape[0], self.row_size - self.hidden_size)], dim=-1)

    @torch.inference_mode()
    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        h, d = self.hidden_size, self.deepstack_layers
        embeds = embeds.to(self.device)
        x = embeds[:, :h]
        kwargs = {}
        if d:
            stack = embeds[:, h:].view(-1, d, h)
            visual = stack.abs().amax(dim=(1, 2)) > 0
            if bool(visual.any()):
                kwargs = {"visual_pos_masks": visual.unsqueeze(0),
                          "deepstack_visual_embeds": [stack[visual, i] for i in range(d)]}
        if want_hidden:
            kwargs["output_hidden_states"] = [self.accept_layer]
        out = self.model(inputs_embeds=x.unsqueeze(0), position_ids=positions.unsqueeze(1).to(self.device),
                         attention_mask={"full_attention": None}, use_cache=False, omni_batch=batch, **kwargs)
        last = out.last_hidden_state[0]
        logits = self.lm_head(last[logit_rows.to(last.device)]).float()
        return (out.hidden_states[self.accept_layer][0] if want_hidden else None), logits


@dataclass
class CodeFrame:
    """One codec frame for the code predictor: the talker's last hidden state ``[Ht]`` at the step that drew
    ``code0`` (the first codebook), and the request's sampler for the residual codebooks."""

    hidden: torch.Tensor
    code0: int
    sampler: Sampler


@dataclass
class FrameCodes:
    codes: list[int]  # [G]: code0, then the G-1 residual codes
    embedding: torch.Tensor  # [Ht]: sum of the frame's G code embeddings (the next talker input, text not added)


class Qwen3OmniTalker(ExpertSplit, PagedDecoder):
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        full = load_config(checkpoint_dir)
        self.config = c = full.talker_config
        self.model = load_component(checkpoint_dir, hf.Qwen3OmniMoeTalkerForConditionalGeneration, c,
                                    {"talker.": ""}, dtype, device)
        self.use_paged_attention(self.model.model.config, dtype, device)
        self.predictor = self.model.code_predictor
        self.modules = {"talker": self.model}
        self.embedding_size = c.text_config.hidden_size
        self.position_rows = 3
        self.num_code_groups = c.num_code_groups
        self.codec_eos = c.codec_eos_token_id
        vocab = c.text_config.vocab_size
        self.suppress_tokens = tuple(i for i in range(vocab - SUPPRESSED_CODEC_TAIL, vocab) if i != self.codec_eos)
        self.voices = dict(c.speaker_id)
        self.rope = RopeIndex(talker_rope_config(full), c.spatial_merge_size)
        self.tts_pad_token_id = full.tts_pad_token_id
        wav = full.code2wav_config  # the frames' rate, to pace the talker by the audio it has made
        self.codes_per_s = SAMPLE_RATE / (math.prod(wav.upsample_rates) * math.prod(wav.upsampling_ratios))

    @property
    def moe_decoder(self):
        return self.model.model

    @torch.inference_mode()
    def project_text(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.text_projection(x.to(self.device, self.dtype))

    @torch.inference_mode()
    def project_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_projection(x.to(self.device, self.dtype))

    @torch.inference_mode()
    def embed_codes(self, ids: list[int]) -> torch.Tensor:
        return self.model.get_input_embeddings()(torch.tensor(ids, device=self.device))

    @torch.inference_mode()
    def prompt_rows(self, user: torch.Tensor, user_is_media: torch.Tensor, assistant: torch.Tensor,
                    voice_id: int, tts: torch.Tensor) -> torch.Tensor:
        """The talker's prompt ``[U + 9, Ht]``, as ``generate`` builds it.

        ``user`` [U, H]: per user-turn row, the thinker's accept-layer hidden state (media rows, flagged in
        ``user_is_media``) or its input embedding (text rows); ``assistant`` [4, H]: the thinker embeddings of
        the assistant turn's first four rows (``<|im_start|>assistant\\n`` and the first generated token);
        ``tts`` [3, H]: the thinker embeddings of the tts bos, eos and pad tokens.
        """
        c = self.config
        mask = user_is_media.to(self.device).bool()
        user_rows = torch.empty(user.shape[0], self.embedding_size, device=self.device, dtype=self.dtype)
        if bool(mask.any()):
            user_rows[mask] = self.project_hidden(user[mask])
        if bool((~mask).any()):
            user_rows[~mask] = self.project_text(user[~mask])
        text = self.project_text(assistant)
        bos, _, pad = self.project_text(tts)
        text_part = torch.cat([text[:3], pad.expand(4, -1), bos.view(1, -1), text[3:4]])
        codec_ids = [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, voice_id, c.codec_pad_id,
                     c.codec_bos_id]
        codec_part = torch.cat([text_part.new_zeros(3, self.embedding_size), self.embed_codes(codec_ids)])
        return torch.cat([user_rows, text_part + codec_part])

    def prompt_positions(self, user_ids: list[int], **media) -> tuple[torch.Tensor, int]:
        """Positions ``[3, U + 9]`` of the talker's prompt and its decoding delta: M-RoPE over the user turns' ids
        when the request has media (``media``: ``RopeIndex.positions``' keyword arguments), else plain.

        As ``generate`` computes them: it hands the talker the media grids and audio lengths but not
        ``use_audio_in_video`` (transformers 5.23), so the talker's index runs with it off."""
        n = len(user_ids) + 9
        if not media:
            return torch.arange(n).view(1, n).expand(3, n), 0
        ids = torch.tensor([list(user_ids) + [self.tts_pad_token_id] * 9])
        return self.rope.positions(ids, **{**media, "use_audio_in_video": False})

    @staticmethod
    def step_positions(past_len: int, delta: int, n: int = 1) -> torch.Tensor:
        return (torch.arange(past_len, past_len + n) + delta).view(1, n).expand(3, n)

    @torch.inference_mode()
    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        hidden = self.run(self.model.model, embeds.to(self.device, self.dtype), positions, batch)
        logits = self.model.codec_head(hidden[logit_rows.to(hidden.device)]).float()
        return (hidden if want_hidden else None), logits

    @torch.inference_mode()
    def run_followups(self, frames: list[CodeFrame]) -> list[FrameCodes]:
        """The residual codes of a batch of frames: the code predictor's G-1 steps, every frame at once (its
        model's own forward over one cache; each step's codes drawn by ``select_rows``: what every frame's
        ``sampler.select`` draws, one argmax for greedy frames)."""
        from transformers import DynamicCache

        p = self.predictor
        samplers = [f.sampler for f in frames]
        code0 = [f.code0 for f in frames]
        first = self.embed_codes(code0)  # [B, Ht]
        x = torch.stack([torch.stack([f.hidden.to(self.device, self.dtype) for f in frames]), first], dim=1)
        cache = DynamicCache(config=p.config)
        codes = [code0]
        total = first.clone()
        for g in range(self.num_code_groups - 1):
            out = p.model(inputs_embeds=x, past_key_values=cache, use_cache=True)
            logits = p.lm_head[g](out.last_hidden_state[:, -1]).float()
            drawn = select_rows(samplers, logits)
            codes.append(drawn)
            emb = p.model.get_input_embeddings()[g](torch.tensor(drawn, device=self.device))  # [B, Ht]
            total = total + emb
            x = emb.unsqueeze(1)
        return [FrameCodes([row[i] for row in codes], total[i]) for i in range(len(frames))]


class Qwen3OmniCode2Wav:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        cfg = load_config(checkpoint_dir).code2wav_config
        self.device = device
        self.config = cfg
        self.model = load_component(checkpoint_dir, hf.Qwen3OmniMoeCode2Wav, cfg, {"code2wav.": ""}, dtype, device)
        self.modules = {"code2wav": self.model}
        self.num_quantizers = cfg.num_quantizers
        self.samples_per_code = int(self.model.total_upsample)
        self.streaming = StreamingCode2Wav(self.model)

    def feed(self, stream: VocoderStream, codes: torch.Tensor) -> torch.Tensor:
        """New frames ``codes [G, m]`` of a streamed decode -> the samples final now (``qwen3_omni_vocoder``)."""
        return self.streaming.feed(stream, codes)

    @torch.inference_mode()
    def reference(self, codes: torch.Tensor) -> torch.Tensor:
        """What ``generate`` returns for one request's ``codes [G, n]``: its ``chunked_decode``."""
        wav = self.model.chunked_decode(codes.unsqueeze(0).to(self.device), chunk_size=REFERENCE_CHUNK,
                                        left_context_size=REFERENCE_LEFT_CONTEXT)
        return wav.float()[0, 0]
