"""Qwen2.5-Omni stage adapters over transformers' modules: one class per stage, each loading only its weights.

Contract (all tensors on the adapter's device; batch dimension 1 unless stated):

- ``OmniEncoder``: audio tower + vision tower. ``encode_audio(features, feature_mask) -> [n_audio_tokens, H]``,
  ``encode_image(pixel_values, grid_thw) -> [n_image_tokens, H]`` (H = thinker hidden size; videos go through
  ``encode_image`` too, with their video grid).
- ``OmniThinker``: text decoder + lm_head. ``prompt_positions(...)`` gives the 4-row position ids transformers'
  ``generate`` feeds the decoder (text row + 3 M-RoPE rows) and the rope delta used while decoding.
- ``OmniTalker``: codec decoder. Its input rows are exactly what ``Qwen2_5OmniForConditionalGeneration.
  generate`` passes the talker (embeddings before ``thinker_to_talker_proj``; plain positions, since it gets
  no attention mask there).
- Both are ``ARModel``s for ``omni_serve.engines.ar.AREngine``: ``forward_packed(embeds [T, E], positions
  [R, T], batch, logit_rows, want_hidden)`` runs one packed batch of many requests over the paged KV cache
  (attention implementation ``omni_paged``) and returns (last hidden states ``[T, H]`` or None, logits of
  ``logit_rows``).
- ``OmniCode2Wav``: DiT + BigVGAN. ``synthesize(codes, voice, seed, ...)`` -> 24 kHz waveform through
  transformers' own whole-sequence path (the DiT's initial noise comes from ``seed``, as a reference call made
  after ``torch.manual_seed(seed)``). Streaming uses ``dit_windows`` (block-aligned windows of several
  requests in one batched ODE solve) and ``vocode``; see ``families/qwen2_5_omni/replica/code2wav.py``.

No module is subclassed or patched; ``MropeIndex`` borrows transformers' own position-index functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf

from omni_serve.models.loading import load_component, read_state_dict
from omni_serve.models.paged_decoder import PagedDecoder
from omni_serve.models.prepared_paths import use_prepared
from omni_serve.models.qwen2_5_omni_dit import LibraryDiT, PreparedDiT, WindowPack
from omni_serve.models.qwen2_5_omni_vocoder import PreparedBigVGAN
from omni_serve.models.qwen2_5_omni_layout import SAMPLE_RATE, load_config, load_speakers


class MropeIndex:
    """transformers' multimodal RoPE index computation without holding the model that defines it.

    ``get_rope_index`` only reads ``self.config`` and ``self.spatial_merge_size``; borrowing the functions
    (not subclassing) keeps us on the library's exact arithmetic for audio/image/video positions.
    """

    _base = hf.Qwen2_5OmniPreTrainedModelForConditionalGeneration
    get_rope_index = _base.get_rope_index
    get_llm_pos_ids_for_vision = _base.get_llm_pos_ids_for_vision
    get_chunked_index = _base.get_chunked_index

    def __init__(self, config, spatial_merge_size: int):
        self.config = config
        self.spatial_merge_size = spatial_merge_size

    def positions(self, input_ids: torch.Tensor, image_grid_thw=None, video_grid_thw=None, audio_seqlens=None,
                  second_per_grids=None, use_audio_in_video: bool = False) -> tuple[torch.Tensor, int]:
        """M-RoPE positions ``[3, L]`` of a prompt ``[1, L]`` and the delta that continues them while decoding."""
        mask = torch.ones_like(input_ids)
        pos, delta = self.get_rope_index(input_ids, image_grid_thw, video_grid_thw, mask, use_audio_in_video,
                                         audio_seqlens, second_per_grids)
        return pos[:, 0], int(torch.as_tensor(delta).view(-1)[0])


class OmniEncoder:
    """The thinker's media towers (Qwen3-Omni's encoder subclasses it with its own towers and config)."""

    audio_tower, vision_tower = hf.Qwen2_5OmniAudioEncoder, hf.Qwen2_5OmniVisionEncoder
    read_config = staticmethod(load_config)

    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        cfg = self.read_config(checkpoint_dir).thinker_config
        self.device = device
        self.audio = load_component(checkpoint_dir, self.audio_tower, cfg.audio_config,
                                    {"thinker.audio_tower.": ""}, dtype, device)
        self.visual = load_component(checkpoint_dir, self.vision_tower, cfg.vision_config,
                                     {"thinker.visual.": ""}, dtype, device)
        self.modules = {"audio_tower": self.audio, "visual": self.visual}

    @torch.inference_mode()
    def encode_audio(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
        lengths = feature_attention_mask.sum(-1)
        feats = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)
        after_cnn, _ = self.audio._get_feat_extract_output_lengths(lengths)
        out = self.audio(feats.to(self.device, self.audio.dtype), feature_lens=lengths, aftercnn_lens=after_cnn)
        return out.last_hidden_state

    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Images or videos (the same tower; a video's grid has t > 1)."""
        out = self.visual(pixel_values.to(self.device, self.visual.dtype), grid_thw=image_grid_thw)
        return out.pooler_output


class ThinkerDecoder(PagedDecoder):
    """A thinker's text model + lm_head with its M-RoPE prompt positions (both Omni families: each names its
    transformers text model class and position index)."""

    text_model_class: type = hf.Qwen2_5OmniThinkerTextModel
    rope_class: type = MropeIndex

    def _load_thinker(self, checkpoint_dir: str, thinker_config, dtype, device) -> None:
        self.config = thinker_config
        text_cfg = thinker_config.text_config
        self.model = load_component(checkpoint_dir, self.text_model_class, text_cfg, {"thinker.model.": ""},
                                    dtype, device)
        self.use_paged_attention(self.model.config, dtype, device)
        self.lm_head = torch.nn.Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False)
        self.lm_head.load_state_dict(read_state_dict(checkpoint_dir, {"thinker.lm_head.": ""}))
        self.lm_head.to(device=device, dtype=dtype).eval()
        self.rope = self.rope_class(thinker_config, thinker_config.vision_config.spatial_merge_size)
        self.modules = {"model": self.model, "lm_head": self.lm_head}
        self.vocab_size = text_cfg.vocab_size
        self.hidden_size = text_cfg.hidden_size
        self.position_rows = 4

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids.to(self.device))

    def prompt_positions(self, input_ids, **media) -> tuple[torch.Tensor, int]:
        """Prompt positions ``[4, L]`` (``[text; t; h; w]``) and the delta that continues M-RoPE while decoding;
        ``media``: ``MropeIndex.positions``' keyword arguments (none for a text prompt)."""
        mrope, delta = self.rope.positions(input_ids, **media)
        text = torch.arange(input_ids.shape[1]).view(1, -1)
        return torch.cat([text, mrope], dim=0), delta

    @staticmethod
    def step_positions(past_len: int, delta: int, n: int = 1) -> torch.Tensor:
        text = torch.arange(past_len, past_len + n).view(1, n)
        return torch.cat([text, text.expand(3, n) + delta], dim=0)


class OmniThinker(ThinkerDecoder):
    """``prepared_layers=False`` keeps transformers' own layer forward (for comparisons; see ``PagedDecoder``)."""

    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu", prepared_layers: bool = True):
        self._load_thinker(checkpoint_dir, load_config(checkpoint_dir).thinker_config, dtype, device)
        if self.prepare_layers(self.model, prepared_layers, "thinker.layers"):
            self.modules["layers"] = self.prepared
        self.row_size = self.hidden_size  # an input row is the embedding
        cfg = self.config
        self.media_token_ids = (cfg.audio_token_index, cfg.image_token_index, cfg.video_token_index)

    @torch.inference_mode()
    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        hidden = self.run(self.model, embeds, positions, batch)
        logits = self.lm_head(hidden[logit_rows.to(hidden.device)]).float()
        return (hidden if want_hidden else None), logits


class OmniTalker(PagedDecoder):
    """``prepared_layers``: as ``OmniThinker``'s."""

    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu", prepared_layers: bool = True):
        full = load_config(checkpoint_dir)
        self.config = full.talker_config
        self.model = load_component(checkpoint_dir, hf.Qwen2_5OmniTalkerForConditionalGeneration, self.config,
                                    {"talker.": ""}, dtype, device)
        self.use_paged_attention(self.model.model.config, dtype, device)
        self.modules = {"talker": self.model}
        if self.prepare_layers(self.model.model, prepared_layers, "talker.layers"):
            self.modules["layers"] = self.prepared
        c = self.config
        self.codec_bos, self.codec_eos = c.tts_codec_start_token_id, c.tts_codec_end_token_id
        self.codec_pad, self.codec_mask = c.tts_codec_pad_token_id, c.tts_codec_mask_token_id
        # transformers' Qwen2_5OmniForConditionalGeneration.generate stops the talker on these two ids.
        self.stop_ids = (c.tts_codec_pad_token_id, c.tts_codec_end_token_id)
        self.embedding_size = c.embedding_size
        self.position_rows = 3
        wav = full.token2wav_config  # the codes' rate, to pace the talker by the audio it has made
        self.codes_per_s = SAMPLE_RATE / (wav.dit_config.repeats * math.prod(wav.bigvgan_config.upsample_rates))

    def prompt_codec_ids(self, prompt_len: int) -> list[int]:
        """The talker's input ids for its prompt: mask per thinker prompt token, then pad and bos."""
        return [self.codec_mask] * prompt_len + [self.codec_pad, self.codec_bos]

    @torch.inference_mode()
    def embed_codes(self, ids: list[int]) -> torch.Tensor:
        return self.model.get_input_embeddings()(torch.tensor(ids, device=self.device))

    @staticmethod
    def positions(start: int, n: int) -> torch.Tensor:
        """The talker decodes with plain positions (``generate`` passes it no attention mask)."""
        return torch.arange(start, start + n).view(1, n).expand(3, n)

    @torch.inference_mode()
    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        """``embeds``: talker inputs before ``thinker_to_talker_proj`` (thinker-sized, as ``generate`` builds)."""
        hidden = self.run(self.model.model, self.model.thinker_to_talker_proj(embeds.to(self.device)), positions, batch)
        logits = self.model.codec_head(hidden[logit_rows.to(hidden.device)]).float()
        return (hidden if want_hidden else None), logits


@dataclass
class DiTWindow:
    """One window of a request's codec sequence for ``OmniCode2Wav.dit_windows``.

    ``codes``: the window's codec ids; ``noise``: ``[2 * len(codes), mel]`` — the slice of the request's
    whole-sequence initial noise at the window's frames; ``voice``: speaker name.
    """

    codes: list[int]
    noise: torch.Tensor
    voice: str


def _prepared(what: str, prepared, library, module, wanted: bool, switch: str, *args):
    """``prepared(module, *args)`` when ``wanted`` and ``prepared.supports(module)``, else ``library(module)``."""
    if use_prepared(what, wanted, wanted and prepared.supports(module), f"params.{switch}",
                    f"{type(module).__name__} is not the structure it reproduces"):
        return prepared(module, *args)
    return library(module)


def _library_vocoder(vocoder):
    """The vocoder's own forward, with ``PreparedBigVGAN``'s call signature (``[1, mel, frames]`` -> samples)."""
    return lambda mel: vocoder(mel).reshape(-1)


class OmniCode2Wav:
    """``dit_dtype``: the dtype the DiT's transformer blocks run in inside ``dit_windows`` (float32, as transformers
    runs token2wav; bfloat16 runs them on a bfloat16 copy, while the ODE state, its solver, the input projection
    and the output head stay float32: on CPUs with AMX its matrix products are several times faster)."""

    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu",
                 dit_dtype: torch.dtype = torch.float32, prepared_dit: bool = True, prepared_vocoder: bool = True):
        cfg = load_config(checkpoint_dir).token2wav_config
        self.device = device
        # transformers runs token2wav in float32 whatever the rest of the model uses.
        self.model = load_component(checkpoint_dir, hf.Qwen2_5OmniToken2WavModel, cfg, {"token2wav.": ""},
                                    torch.float32, device)
        self.dit, self.vocoder = self.model.code2wav_dit_model, self.model.code2wav_bigvgan_model
        self.dit_dtype = dit_dtype
        # The DiT's blocks on their own copies of the weights (in ``dit_dtype``): synthesize(), transformers' own
        # path, keeps the float32 modules.
        self.prepared = _prepared("code2wav.dit", PreparedDiT, LibraryDiT, self.dit, prepared_dit, "prepared_dit",
                                  dit_dtype)
        self.prepared_vocoder = _prepared("code2wav.vocoder", PreparedBigVGAN, _library_vocoder, self.vocoder,
                                          prepared_vocoder, "prepared_vocoder")
        self.modules = {"token2wav": self.model}
        self.speakers = load_speakers(checkpoint_dir)
        bigvgan = cfg.bigvgan_config
        self.repeats = cfg.dit_config.repeats
        self.mel_dim = cfg.dit_config.mel_dim
        self.samples_per_frame = int(torch.tensor(bigvgan.upsample_rates).prod())
        self.samples_per_code = self.repeats * self.samples_per_frame
        # The DiT attends block-locally (blocks of block_size mel frames): windows must start on a block.
        self.block_codes = max(1, cfg.dit_config.block_size // self.repeats)
        self._voice_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def synthesize(self, codes: list[int], voice: str, seed: int, num_steps: int = 10,
                   guidance_scale: float = 0.5, sway_coefficient: float = -1.0) -> torch.Tensor:
        """Whole-sequence synthesis through transformers' own ``Qwen2_5OmniToken2WavModel`` (the reference)."""
        spk = self.speakers[voice]
        code = torch.tensor([codes], dtype=torch.long, device=self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wav = self.model(code, conditioning=spk["cond"].float().to(self.device),
                             reference_mel=spk["ref_mel"].float().to(self.device), num_steps=num_steps,
                             guidance_scale=guidance_scale, sway_coefficient=sway_coefficient)
        return wav.reshape(-1).float()

    def _voice(self, voice: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(speaker-encoder output ``[2, C]`` for the conditional and unconditional branch, conditioning ``[D]``).

        transformers recomputes the speaker encoder on every ODE evaluation; it depends only on the voice.
        """
        if voice not in self._voice_cache:
            spk = self.speakers[voice]
            ref = spk["ref_mel"].float().to(self.device)
            enc = self.dit.input_embed.spk_encoder(torch.cat([ref, torch.zeros_like(ref)]))
            self._voice_cache[voice] = (enc, spk["cond"].float().to(self.device).view(-1))
        return self._voice_cache[voice]

    @torch.inference_mode()
    def dit_windows(self, windows: list[DiTWindow], num_steps: int = 10, guidance_scale: float = 0.5,
                    sway_coefficient: float = -1.0) -> list[torch.Tensor]:
        """Mel ``[mel, frames]`` of each window (any lengths), all solved together; the same flow-matching ODE as
        ``Qwen2_5OmniToken2WavDiTModel.sample`` (its solver and its submodules), with classifier-free guidance.

        The windows are packed end to end along the frame axis (``WindowPack``; the two CFG branches are the two
        rows), so windows of different lengths share every matrix product. Constant inputs (speaker encoder,
        code embeddings, their share of the input projection) are computed once per call instead of once per
        ODE evaluation.
        """
        dit, dev, prepared = self.dit, self.device, self.prepared
        order = sorted(range(len(windows)), key=lambda i: len(windows[i].codes))  # equal lengths side by side
        windows = [windows[i] for i in order]
        pack = WindowPack(tuple(self.repeats * len(w.codes) for w in windows), dit.block_size, dev)
        x0 = pack.pack([w.noise.to(dev) for w in windows]).unsqueeze(0)  # [1, total, mel]
        per_window = []  # [2 (cond, uncond), frames, features] of each window's constant input
        for w, frames in zip(windows, pack.lengths):
            (spk_cond, spk_null), cond = self._voice(w.voice)
            codes = torch.tensor([w.codes], dtype=torch.long, device=dev)
            code_embed = torch.cat([dit.text_embed(codes), dit.text_embed(codes, drop_code=True)])
            spk = torch.stack([spk_cond, spk_null]).unsqueeze(1).expand(-1, frames, -1)
            speaker = torch.stack([cond, torch.zeros_like(cond)]).unsqueeze(1).expand(-1, frames, -1)
            per_window.append(torch.cat([torch.zeros(2, frames, self.mel_dim, device=dev), spk, code_embed,
                                         speaker], dim=-1))
        proj = dit.input_embed.proj
        const = proj(pack.pack(per_window))
        w_x = proj.weight[:, :self.mel_dim]
        rope = prepared.rope(*dit.rotary_embed(const, pack.positions()))

        def velocity(t, x):
            # Both CFG rows see the same x: one product, broadcast over the rows.
            h = (torch.nn.functional.linear(x, w_x) + const).to(prepared.dtype)
            out = prepared.head(prepared.blocks(h, t, rope, pack), t)
            guided, null = torch.chunk(out, 2, dim=0)
            if guidance_scale < 1e-5:
                return guided
            return guided + (guided - null) * guidance_scale

        times = torch.linspace(0, 1, num_steps, device=dev, dtype=const.dtype)
        if sway_coefficient is not None:
            times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
        mel = hf.RungeKutta4ODESolver(function=velocity, initial_value=x0).integrate(times)[-1]
        mels = [None] * len(windows)
        for i, m in zip(order, pack.unpack(mel)):
            mels[i] = m[0].T
        return mels

    @torch.inference_mode()
    def vocode(self, mel: torch.Tensor) -> torch.Tensor:
        """BigVGAN: mel ``[mel, frames]`` -> waveform ``[frames * samples_per_frame]`` (``PreparedBigVGAN``: the
        vocoder's own forward to float rounding, with cheaper anti-aliased activations)."""
        return self.prepared_vocoder(mel.unsqueeze(0).to(self.device)).float()

