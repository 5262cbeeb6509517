"""VibeVoice text-to-speech (transformers' ``vibevoice``), the lm stage: the LM with its per-token diffusion, decode
and feedback, as an ``ARModel`` whose sequences (``omni_serve.models.vibevoice_sequence.VibeVoiceSequence``)
reproduce ``VibeVoiceForConditionalGeneration.generate`` request by request under continuous batching
(docs/upstream_vibevoice.md is the brief on how ``generate`` works).

Contract:

- ``VibeVoiceLM(checkpoint_dir, dtype, device, branch_kv_blocks, branch_block_size)`` loads ``model.*`` of the
  checkpoint (the Qwen2 LM, both connectors, the diffusion head, the acoustic tokenizer, whose encoder clones voices
  and whose decoder is inside the loop, and the semantic encoder: all of it is the lm stage's) and the LM head (the
  tied token embeddings when the config ties them). ``forward_packed`` is the *positive* branch over the engine's
  paged KV cache; ``run_followups`` is the rest of a token for every sequence of the step at once (below). The side
  branches' KV (``branch_kv_blocks`` of ``branch_block_size`` rows) never runs short when it has twice the engine's
  blocks (a running request holds at most as many side rows per branch as positive rows); short of that, requests
  outside the step lose theirs (recomputed later) and a request that still does not fit fails with a clear error.
- Settings: ``defaults()`` (the generation config's ``max_new_tokens``, ``guidance_scale``, ``num_diffusion_steps``,
  with ``generate``'s fallbacks), ``settings(request)`` (with the request's overrides; ``ValueError`` when invalid).
- Prompts: ``prompt(turns, voices) -> SpeechPrompt`` renders the checkpoint's chat template (one ``Speaker <id>:``
  line per turn; one voice line per speaker, in first-appearance order) and expands each speaker's voice
  placeholder to its frame count, as the processor does; ``turns`` is ``[(speaker, text)]`` (``parse_script``
  reads ``"Speaker 0: ...\\nSpeaker 1: ..."``), ``voices`` maps every speaker to a 24 kHz float clip or an
  ``EncodedVoice``. ``prompt.num_tokens`` is the prompt's token count; a prompt that cannot be built (a speaker
  without a voice or a voice without a speaker, an empty clip or text) raises ``ValueError``.
- Voices, in two parts as ``get_audio_features`` computes them: ``encode_voices(clips) -> [EncodedVoice]``, the
  processor's feature extraction (-25 dBFS, padding to the longest clip) and the acoustic encoder on the batch,
  deterministic: a registered voice is encoded once and reused; then, per request, ``voice_rows(voices, generator,
  sample)``: with ``sample`` (generate's default) the sigma-VAE noise, ``randn(B)`` then ``randn_like(latents)``
  over the speakers' padded batch, drawn from the request's generator, then the latent scaling and the acoustic
  connector. A request seeded ``seed`` thus draws what ``torch.manual_seed(seed); generate(...)`` draws, whether its
  voices were encoded just now or registered earlier; ``sample=False`` equals ``generate(..., sample=False)``.
- ``prompt_rows(prompt, generator, sample)``: the positive branch's prompt rows ``[P, H]``: the prompt's clips
  encoded together, then ``voice_rows`` over all its speakers, scattered into the placeholders.
- ``run_followups(steps)``, for every ``TokenStep`` of the engine step, as batches: (1) ONE packed LM forward over
  the side branches (``vibevoice_head.BranchKV``): each request's uncond-token row (transformers' token CFG pass:
  ``[last prompt id, generated ids...]`` as token embeddings, under ``guidance_scale != 1``) and its negative-branch
  row (``embed(audio_bos)`` at the first step, then the positive branch's input row of the step; computed ahead
  of the token choice and kept only when the token is speech); (2) token choice: log-softmax CFG, the request's
  ``logits_processor``, the 4-token mask, argmax; (3) for speech tokens, the diffusion head (10 DPM-Solver steps
  by default) over all speaking rows, each request's noise ``randn(2, 64)`` from its own generator (row 0 used, as
  ``generate`` uses the first half); (4) the acoustic decode of one frame per request and the semantic encode of
  its chunk, batched by stacking the requests' padding caches (``vibevoice_head.ConvStreams``); (5) the next input
  row ``projector(latent) + semantic_connector(semantic)``, or the token's embedding. ``side_stats()``: the side
  KV's use and the requests holding state (zero when none is in flight).

Deviations from ``generate``, each commented where it happens: results equal ``generate``'s to float rounding, not
bit for bit (paged attention instead of SDPA over a DynamicCache; the side branches' rows of all requests in one
product; the diffusion head, decoder and encoder over every speaking request); registered voices were encoded alone
(the same frames as in a batch, rounded at another shape); ``generate`` with batch > 1 draws one noise stream for
its batch and decodes zero latents for its non-speaking rows, while each request here is its own batch-of-one
``generate``; a mid-stream ``audio_bos`` restarts the negative branch on a fresh cache (``generate`` masks the old
rows out: the same attention); on another device than the CPU, the voices' sigma-VAE noise is still drawn on the CPU
generator (``generate`` draws it on the device's).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from omni_serve.models.loading import load_component, read_state_dict
from omni_serve.models.paged_decoder import PagedDecoder
from omni_serve.models.vibevoice_prompt import parse_script, prompt_ids, speakers_of, voice_frames
from omni_serve.models.vibevoice_head import (NEGATIVE, UNCOND, BranchKV, BranchSegment, ConvStreams,
                                             DiffusionSampler, SideResult, SpeechState, TokenResult, TokenStep)

SAMPLE_RATE = 24000
__all__ = ["VibeVoiceLM", "parse_script"]  # parse_script: the prompt module's, importable from here


# -- outputs: plain dataclasses (a model adapter imports no graph code); the family's messages will carry them --------
@dataclass
class SpeechChunk:
    """One speech token's audio: ``samples`` float32 ``[hop]`` (3200 at 24 kHz) and the diffusion ``latent`` ``[64]``
    it was decoded from (a decoder stage re-decodes latents one frame per call to get the same samples)."""

    index: int
    samples: torch.Tensor
    latent: torch.Tensor


@dataclass
class SpeechDone:
    prompt_tokens: int
    generated_tokens: int  # every token chosen, speech or not (generate's new sequence length)
    speech_tokens: int  # chunks sent
    finish_reason: str  # "stop" (eos) or "length" (max_new_tokens)


# -- inputs ----------------------------------------------------------------------------------------------------
@dataclass
class EncodedVoice:
    """A reference voice through the acoustic encoder: its latents ``[frames, D]`` before the sigma-VAE noise (one
    frame, and one prompt placeholder, per 3200 samples)."""

    latents: torch.Tensor

    @property
    def frames(self) -> int:
        return self.latents.shape[0]


@dataclass
class SpeechPrompt:
    input_ids: list[int]
    speakers: list[str]  # in voice-placeholder order (first appearance)
    voices: list  # per speaker: a float32 clip (np.ndarray) or an EncodedVoice

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class SpeechRequest:
    """One request of the lm stage; None settings take the checkpoint's generation config."""

    prompt: SpeechPrompt
    seed: int = 0
    max_new_tokens: int | None = None
    guidance_scale: float | None = None
    num_diffusion_steps: int | None = None
    sample_voice: bool = True  # sigma-VAE noise on the voices' latents (generate's default)
    # transformers LogitsProcessor-like: (input_ids [1, L], scores [1, V]) -> scores, after the CFG, before the
    # speech-token mask, as generate(logits_processor=[...]) places it
    logits_processor: Callable | None = None


class VibeVoiceLM(PagedDecoder):
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu", branch_kv_blocks: int = 1024,
                 branch_block_size: int = 16, prepared_layers: bool = True):
        from transformers import AutoProcessor, GenerationConfig, VibeVoiceConfig
        from transformers.models.vibevoice.modeling_vibevoice import VibeVoiceModel

        self.config = VibeVoiceConfig.from_pretrained(checkpoint_dir)
        self.model = load_component(checkpoint_dir, VibeVoiceModel, self.config, {"model.": ""}, dtype, device)
        lm = self.model.language_model
        self.use_paged_attention(lm.config, dtype, device)
        embed = lm.embed_tokens
        self.lm_head = torch.nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device="meta")
        if self.config.tie_word_embeddings:
            self.lm_head.weight = embed.weight
        else:
            weight = read_state_dict(checkpoint_dir, {"lm_head.": ""})["weight"]
            self.lm_head.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
        self.lm_head.eval()
        self.processor = AutoProcessor.from_pretrained(checkpoint_dir)
        self.generation_config = GenerationConfig.from_pretrained(checkpoint_dir)
        c = self.config
        self.audio_bos, self.audio_eos, self.audio_token, self.eos = (c.audio_bos_token_id, c.audio_eos_token_id,
                                                                      c.audio_token_id, c.eos_token_id)
        self.hidden_size = c.text_config.hidden_size
        self.row_size, self.position_rows = self.hidden_size, 1
        self.hop = c.audio_config.hop_length
        self.latent_size = c.diffusion_head_config.latent_size
        mask = torch.full((c.vocab_size,), float("-inf"))
        mask[[self.audio_bos, self.audio_eos, self.audio_token, self.eos]] = 0.0
        self.token_mask = mask.to(device)  # generate's VibeVoiceTokenConstraintProcessor
        m = self.model
        self.modules = {"language_model": lm, "lm_head": self.lm_head, "diffusion_head": m.diffusion_head,
                        "connectors": torch.nn.ModuleList([m.multi_modal_projector, m.semantic_connector]),
                        "acoustic_tokenizer": m.audio_tower, "semantic_encoder": m.semantic_tokenizer_encoder}
        if self.prepare_layers(lm, prepared_layers, "lm.layers"):  # every branch's forward runs them
            self.modules["layers"] = self.prepared
        self.branches = BranchKV(self.num_layers, self.num_kv_heads, self.head_dim, branch_kv_blocks,
                                 branch_block_size, dtype, device)
        self.branches.on_evict = self._evicted
        self._states: dict[str, SpeechState] = {}
        self._ids = itertools.count()
        self.sampler = DiffusionSampler(m.diffusion_head, self._new_scheduler)
        probe = torch.zeros(1, 1, self.latent_size, dtype=dtype, device=device)
        self.acoustic = ConvStreams(m.audio_tower, _decode, probe)
        self.semantic = ConvStreams(m.semantic_tokenizer_encoder, _semantic_encode,
                                    torch.zeros(1, 1, self.hop, dtype=dtype, device=device))

    # -- settings ------------------------------------------------------------------------------------------------
    def _new_scheduler(self):
        import diffusers

        g = self.generation_config
        name = getattr(g, "noise_scheduler_class", None) or "DPMSolverMultistepScheduler"
        config = getattr(g, "noise_scheduler_config", None) or {"beta_schedule": "squaredcos_cap_v2",
                                                                "prediction_type": "v_prediction"}
        return getattr(diffusers, name)(**config)

    def defaults(self) -> dict:
        """generate's settings from the checkpoint's generation config (its fallbacks where unset)."""
        g = self.generation_config
        return {"max_new_tokens": g.max_new_tokens or 20,
                "guidance_scale": 1.0 if g.guidance_scale is None else float(g.guidance_scale),
                "num_diffusion_steps": getattr(g, "num_diffusion_steps", None) or 10}

    # -- prompts and voices --------------------------------------------------------------------------------------
    def prompt(self, turns: list[tuple[str, str]] | str, voices: dict) -> SpeechPrompt:
        """The prompt of a script (``turns`` or a ``parse_script`` string) spoken with ``voices`` (speaker -> clip or
        ``EncodedVoice``; every speaker needs exactly one). Raises ``ValueError`` on a malformed request."""
        if isinstance(turns, str):
            turns = parse_script(turns)
        voices = {str(k): v for k, v in voices.items()}
        frames = {}
        for s, v in voices.items():
            if isinstance(v, EncodedVoice):
                if v.latents.ndim != 2 or v.latents.shape[1] != self.latent_size or v.frames == 0:
                    raise ValueError(f"speaker {s}: an encoded voice is [frames, {self.latent_size}]")
                frames[s] = v.frames
            else:
                v = np.asarray(v, dtype=np.float32)
                if v.ndim != 1 or v.size == 0:
                    raise ValueError(f"speaker {s}: a voice clip is a non-empty 1-D array of 24 kHz samples")
                frames[s] = voice_frames(v.size, self.hop)
                voices[s] = v
        ids = prompt_ids(self.processor, turns, frames)
        speakers = speakers_of(turns)
        return SpeechPrompt(input_ids=ids, speakers=speakers, voices=[voices[s] for s in speakers])

    def voice_frames(self, samples: int) -> int:
        """Placeholder rows (speech frames) of a clip of ``samples`` samples."""
        return voice_frames(samples, self.hop)

    @torch.inference_mode()
    def encode_voices(self, clips: list[np.ndarray]) -> list[EncodedVoice]:
        """The acoustic encoder's latents of ``clips`` (24 kHz float arrays), encoded as one padded batch as the
        processor and ``get_audio_features`` do; deterministic (the noise is ``voice_rows``')."""
        fe = self.processor.feature_extractor
        feats = fe([np.asarray(c, dtype=np.float32) for c in clips], sampling_rate=SAMPLE_RATE, return_tensors="pt")
        latents = self.model.audio_tower.encoder(feats["input_values"].to(self.device, self.dtype)).latents
        frames = torch.ceil(feats["padding_mask"].sum(dim=-1) / self.hop).to(torch.int64).tolist()
        return [EncodedVoice(latents[i, :n].clone()) for i, n in enumerate(frames)]

    @torch.inference_mode()
    def voice_rows(self, voices: list[EncodedVoice], generator: torch.Generator | None,
                   sample: bool = True) -> list[torch.Tensor]:
        """Each voice's placeholder rows ``[frames, H]``, as ``get_audio_features`` computes them for a batch of
        ``voices`` (a request's speakers, in placeholder order), the sigma-VAE noise drawn from ``generator``."""
        m = self.model
        b, longest = len(voices), max(v.frames for v in voices)
        latents = torch.zeros(b, longest, self.latent_size, dtype=self.dtype, device=self.device)
        for i, v in enumerate(voices):
            latents[i, :v.frames] = v.latents.to(latents)
        if sample:
            if generator is None:
                raise ValueError("sampled voice rows need a generator (the request's, seeded)")
            # tokenizer.encode(sample=True): vae_std * randn(B), then randn_like(latents), from one stream. The
            # encoder's latents are a permuted view of [B, D, T], so randn_like fills a tensor of those strides
            # (not contiguous: other values than a contiguous draw); the same view is filled here. Drawn on the CPU
            # generator whatever the device (generate draws on the latents' device there).
            std = torch.empty(b, dtype=self.dtype).normal_(generator=generator)
            noise = torch.empty(b, self.latent_size, longest, dtype=self.dtype).permute(0, 2, 1)
            noise.normal_(generator=generator)
            std = (self.config.audio_config.vae_std * std).to(self.device)
            latents = latents + std[:, None, None] * noise.to(self.device)
        rows = m.multi_modal_projector((latents + m.latent_bias_factor) * m.latent_scaling_factor)
        return [rows[i, :v.frames] for i, v in enumerate(voices)]

    @torch.inference_mode()
    def embed(self, ids) -> torch.Tensor:
        return self.model.language_model.embed_tokens(torch.as_tensor(ids, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def prompt_rows(self, prompt: SpeechPrompt, generator: torch.Generator | None, sample: bool) -> torch.Tensor:
        """The positive branch's prompt rows ``[P, H]``: token embeddings, voice rows in the placeholders."""
        voices = list(prompt.voices)
        clips = [i for i, v in enumerate(voices) if not isinstance(v, EncodedVoice)]
        if clips:
            for i, encoded in zip(clips, self.encode_voices([voices[i] for i in clips])):
                voices[i] = encoded
        ids = torch.tensor(prompt.input_ids, device=self.device)
        rows = self.embed(ids)
        placeholders = ids == self.audio_token
        voice = torch.cat(self.voice_rows(voices, generator, sample))
        if int(placeholders.sum()) != voice.shape[0]:
            raise ValueError(f"{int(placeholders.sum())} voice placeholders for {voice.shape[0]} voice frames")
        rows[placeholders] = voice.to(rows)
        return rows

    # -- per-request state ---------------------------------------------------------------------------------------
    def settings(self, request: SpeechRequest) -> tuple[int, float, int]:
        """(max_new_tokens, guidance_scale, num_diffusion_steps) of a request: its overrides, else the generation
        config's. Raises ``ValueError`` on values ``generate`` could not run."""
        d = self.defaults()
        new = d["max_new_tokens"] if request.max_new_tokens is None else int(request.max_new_tokens)
        g = d["guidance_scale"] if request.guidance_scale is None else float(request.guidance_scale)
        steps = d["num_diffusion_steps"] if request.num_diffusion_steps is None else int(request.num_diffusion_steps)
        if new < 1 or not math.isfinite(g) or not 1 <= steps <= 1000:
            raise ValueError(f"max_new_tokens {new} must be >= 1, guidance_scale {g} finite, num_diffusion_steps "
                             f"{steps} in [1, 1000]")
        if not request.prompt.input_ids:
            raise ValueError("empty prompt")
        return new, g, steps

    def new_state(self, request: SpeechRequest, generator: torch.Generator) -> SpeechState:
        _, g, steps = self.settings(request)
        state = SpeechState(key=f"s{next(self._ids)}", generator=generator, guidance_scale=g,
                            num_diffusion_steps=steps, unc_ids=[request.prompt.input_ids[-1]])
        self._states[state.key] = state
        return state

    def drop_branches(self, state: SpeechState) -> None:
        """Free the state's side KV (preemption); its rows are recomputed from its stored inputs when next needed."""
        self.branches.free(state.key)
        state.unc_done = state.neg_done = 0

    def release(self, state: SpeechState) -> None:
        self.drop_branches(state)
        self._states.pop(state.key, None)
        state.acoustic = state.semantic = state.neg_buffer = None
        state.neg_count = 0

    def side_stats(self) -> dict:
        """The side branches' KV use and the requests holding state here (all zero when nothing is in flight)."""
        kv = self.branches
        return {"branch_blocks_used": kv.num_used_blocks, "branch_blocks_total": kv.blocks.num_blocks,
                "states": len(self._states), "branch_evictions": kv.evictions}

    def _evicted(self, key: str) -> None:
        state = self._states.get(key)
        if state is not None:
            state.unc_done = state.neg_done = 0

    # -- the positive branch ---------------------------------------------------------------------------------------
    def _decoder(self, embeds: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """The LM's final hidden states ``[T, H]`` for one packed batch (the engine's cache or the side branches')."""
        return self.run(self.model.language_model, embeds.to(self.dtype), positions, batch)

    @torch.inference_mode()
    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        hidden = self._decoder(embeds, positions, batch)
        logits = self.lm_head(hidden[logit_rows.to(hidden.device)]).float()
        return (hidden if want_hidden else None), logits

    # -- one token for every sequence of the step --------------------------------------------------------------------
    @torch.inference_mode()
    def run_followups(self, steps: list[TokenStep]) -> list[TokenResult]:
        side = self._side_forward(steps)
        results: list[TokenResult] = []
        speaking: list[int] = []
        for i, (step, s) in enumerate(zip(steps, side)):
            if s.error is not None:
                results.append(TokenResult(token=-1, error=s.error))
                continue
            token = self._choose(step, s.uncond)
            self._commit(step, token)
            results.append(TokenResult(token=token))
            if token == self.audio_token:
                speaking.append(i)
            else:
                results[-1].next_row = self.embed([token])[0]
        if speaking:
            self._speak([steps[i] for i in speaking], [side[i].negative for i in speaking],
                        [results[i] for i in speaking])
        return results

    def _side_forward(self, steps: list[TokenStep]) -> list[SideResult]:
        """One packed forward over every step's uncond-token and negative rows (with the rows a branch lost to
        preemption or eviction recomputed first)."""
        segments, inputs = [], []
        for step in steps:
            st = step.state
            if st.guidance_scale != 1:
                ids = st.unc_ids[st.unc_done:]
                segments.append(BranchSegment(st.key, UNCOND, st.unc_done, len(ids)))
                inputs.append(self.embed(ids))
            rows = step.negative_row.view(1, -1).to(self.device, self.dtype)
            if st.neg_done < st.neg_count:  # rows lost to preemption or eviction: recomputed first
                rows = torch.cat([st.negative_rows(st.neg_done), rows])
            segments.append(BranchSegment(st.key, NEGATIVE, st.neg_done, rows.shape[0]))
            inputs.append(rows)
        batch, refused = self.branches.plan(segments)
        out = [SideResult() for _ in steps]
        for i, step in enumerate(steps):
            if step.state.key in refused:
                self.drop_branches(step.state)
                out[i].error = RuntimeError(
                    "the side-branch KV cache is full (branch_kv_blocks): give it about twice the engine's blocks")
        kept = [(s, x) for s, x in zip(segments, inputs) if s.key not in refused]
        if batch is None:
            return out
        embeds = torch.cat([x for _, x in kept])
        positions = torch.cat([torch.arange(s.done, s.done + s.n) for s, _ in kept]).view(1, -1)
        hidden = self._decoder(embeds, positions, batch)
        last, row = {}, 0
        for s, _ in kept:
            row += s.n
            last[(s.key, s.branch)] = row - 1
        unc_rows = [last[(st.state.key, UNCOND)] for st in steps if (st.state.key, UNCOND) in last]
        unc_logits = iter(self.lm_head(hidden[unc_rows]).float()) if unc_rows else iter(())
        for i, step in enumerate(steps):
            key = step.state.key
            if key in refused:
                continue
            if (key, UNCOND) in last:
                out[i].uncond = next(unc_logits)
            out[i].negative = hidden[last[(key, NEGATIVE)]]
        return out

    def _choose(self, step: TokenStep, uncond: torch.Tensor | None) -> int:
        """generate's token: its logits processors in order (token CFG, the request's, the 4-token mask), argmax."""
        scores = step.logits.view(1, -1).float()
        g = step.state.guidance_scale
        if g != 1:  # UnbatchedClassifierFreeGuidanceLogitsProcessor
            scores = torch.nn.functional.log_softmax(scores, dim=-1)
            unc = torch.nn.functional.log_softmax(uncond.view(1, -1), dim=-1)
            scores = g * (scores - unc) + unc
        if step.logits_processor is not None:
            scores = step.logits_processor(torch.tensor([step.input_ids]), scores)
        scores = scores + self.token_mask
        return int(torch.argmax(scores, dim=-1))

    def _commit(self, step: TokenStep, token: int) -> None:
        """Advance the side branches past this step: the uncond branch read its rows, and will read the token next;
        the negative branch keeps its row only when the token is speech (generate steps it only then)."""
        st = step.state
        if st.guidance_scale != 1:
            st.unc_done = len(st.unc_ids)
        st.unc_ids.append(token)
        if token == self.audio_token:
            st.commit_negative(step.negative_row.to(self.device, self.dtype))
        st.neg_done = st.neg_count  # a row computed for a token that is not speech is dropped (overwritten)
        if token == self.audio_bos:
            # generate masks every earlier negative row out (_reset_negative_cache_for_audio_start): its next row
            # attends to itself alone, as the first row of a fresh cache does here
            self.branches.free_branch(st.key, NEGATIVE)
            st.neg_count = st.neg_done = 0

    def _speak(self, steps: list[TokenStep], negative: list[torch.Tensor], results: list[TokenResult]) -> None:
        """Diffusion, decode, semantic encode and feedback for the speaking requests, batched."""
        m = self.model
        latents = torch.empty(len(steps), self.latent_size, dtype=self.dtype, device=self.device)
        by_steps: dict[int, list[int]] = {}
        for i, step in enumerate(steps):
            by_steps.setdefault(step.state.num_diffusion_steps, []).append(i)
        for n_steps, members in by_steps.items():
            pos = torch.stack([steps[i].hidden for i in members]).to(self.dtype)
            neg = torch.stack([negative[i] for i in members])
            # generate draws randn(2n, D) for its n speaking rows and uses the first n; alone, n = 1
            noise = torch.stack([torch.randn(2, self.latent_size, generator=steps[i].state.generator)[0]
                                 for i in members])
            scales = torch.tensor([[steps[i].state.guidance_scale] for i in members], dtype=self.dtype,
                                  device=self.device)
            latents[members] = self.sampler.sample(pos, neg, noise.to(self.device), scales, n_steps)
        latents = latents.unsqueeze(1)  # [n, 1, D]
        scaled = latents / m.latent_scaling_factor - m.latent_bias_factor
        audio, acoustic = self.acoustic.run([s.state.acoustic for s in steps], scaled)
        semantic, sem_states = self.semantic.run([s.state.semantic for s in steps], audio)
        rows = m.multi_modal_projector(latents) + m.semantic_connector(semantic)  # [n, 1, H]
        for i, (step, result) in enumerate(zip(steps, results)):
            step.state.acoustic, step.state.semantic = acoustic[i], sem_states[i]
            result.latent = latents[i, 0].to("cpu", copy=True)  # outputs leave the device
            result.samples = audio[i, 0].to("cpu", torch.float32, copy=True)
            result.next_row = rows[i, 0]


def _decode(tower, scaled: torch.Tensor, cache):
    out = tower.decode(scaled, padding_cache=cache, use_cache=True)
    return out.audio, out.padding_cache


def _semantic_encode(encoder, audio: torch.Tensor, cache):
    out = encoder(audio, padding_cache=cache, use_cache=True)
    return out.latents, out.padding_cache
