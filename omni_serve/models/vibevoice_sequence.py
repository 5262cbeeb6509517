"""One VibeVoice text-to-speech request on the AR engine: ``VibeVoiceSequence``, the per-token loop of
``VibeVoiceForConditionalGeneration.generate`` for a batch of one, with the model work of each token batched across
the engine step (``omni_serve.models.vibevoice.VibeVoiceLM``).

Contract: ``VibeVoiceSequence(model, request)`` (a ``SpeechRequest``: prompt, seed, limits, overrides). Its rows are
the positive branch: the prompt (voice rows scattered in; clip voices are encoded in the first ``poll``, on the
engine's thread, drawing their sigma-VAE noise from the request's generator first, as ``generate`` after
``torch.manual_seed(seed)`` does), then one row per generated token: the token's embedding, or for a speech token
the feedback ``projector(latent) + semantic_connector(semantic)``. At each token ``on_computed`` hands the model a
``TokenStep`` (``followup``); ``on_followup`` gets the token and, for speech, the latent and its audio chunk, and
emits ``SpeechChunk(index, samples, latent)``. It ends on ``eos`` or after ``max_new_tokens`` tokens, as
``generate`` stops, with ``SpeechDone``; audio bos/eos tokens do not stop it (they only feed their embedding;
audio bos restarts the negative branch).

The request's other state (its generator, the negative branch's committed rows and the uncond branch's ids, the
tokenizers' padding caches) is a ``SpeechState`` the model owns. Only the side branches' KV is tied to memory
pressure: preemption frees it with the positive blocks (``preempted``), and the next follow-up recomputes it from
the stored rows and ids, so a preempted request's outputs equal an uninterrupted run's (to float rounding: its rows
are recomputed as prefill chunks), and no chunk is sent twice (tokens already chosen are never chosen again: the
engine asks for logits only past ``logits_done``). ``release`` frees everything.
"""

from __future__ import annotations

import torch

from omni_serve.engines.ar.sequence import ARSequence
from omni_serve.models.vibevoice import SpeechChunk, SpeechDone, SpeechRequest, VibeVoiceLM
from omni_serve.models.vibevoice_head import SpeechState, TokenResult, TokenStep


class VibeVoiceSequence(ARSequence):
    wants_hidden = True  # the positive condition of the diffusion head is the last hidden state

    def __init__(self, model: VibeVoiceLM, request: SpeechRequest):
        super().__init__(model.row_size, model.position_rows, model.dtype)
        self.model, self.req = model, request
        self.max_new_tokens, _, _ = model.settings(request)  # validates the request's settings
        self.prompt_len = request.prompt.num_tokens
        self.max_rows = self.prompt_len + self.max_new_tokens
        self.generator = torch.Generator().manual_seed(request.seed)
        self.state: SpeechState | None = None  # made in the first poll (a sequence never run holds nothing)
        self.generated: list[int] = []
        self.speech_tokens = 0

    def ready(self) -> bool:
        return not self.done and (self.num_rows == 0 or self.num_pending() > 0)

    def poll(self) -> None:
        if self.num_rows == 0 and not self.done:
            self.state = self.state or self.model.new_state(self.req, self.generator)
            rows = self.model.prompt_rows(self.req.prompt, self.generator, self.req.sample_voice)
            self.append(rows, torch.arange(self.prompt_len).view(1, -1))

    def on_computed(self, start, end, hidden, logits) -> list:
        if logits is None:
            return []
        first = not self.generated
        # the negative branch reads the positive branch's input of this step; at the first step (the whole prompt)
        # generate feeds it the audio bos token instead
        negative = self.model.embed([self.model.audio_bos])[0] if first else self.rows(end - 1, end)[0][0]
        processor = self.req.logits_processor
        self.followup = TokenStep(self.state, logits, hidden[-1], negative,
                                  self.req.prompt.input_ids + self.generated if processor else None, processor)
        return []

    def on_followup(self, result: TokenResult) -> list[SpeechChunk | SpeechDone]:
        if result.error is not None:
            raise result.error
        self.generated.append(result.token)
        out: list[SpeechChunk | SpeechDone] = []
        if result.samples is not None:
            out.append(SpeechChunk(index=self.speech_tokens, samples=result.samples, latent=result.latent))
            self.speech_tokens += 1
        stop = result.token == self.model.eos
        if stop or len(self.generated) >= self.max_new_tokens:
            self.done = True
            out.append(SpeechDone(prompt_tokens=self.prompt_len, generated_tokens=len(self.generated),
                                  speech_tokens=self.speech_tokens, finish_reason="stop" if stop else "length"))
            return out
        self.append(result.next_row.view(1, -1), torch.tensor([[self.num_rows]]))
        return out

    def preempted(self) -> None:
        super().preempted()
        if self.state is not None:
            self.model.drop_branches(self.state)

    def release(self) -> None:
        if self.state is not None:
            self.model.release(self.state)
