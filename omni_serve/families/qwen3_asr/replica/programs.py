"""Per-request programs of the Qwen3-ASR stages; a request is one audio window.

- ``EncodeProgram`` (batch engine, one key for all): the window's features, once they arrive, are one unit of work;
  ``Qwen3ASREncoder.encode`` runs the units of every ready window in one call (each keeps its own features: see
  ``omni_serve.models.qwen3_asr``). Emits ``AudioEmbeds`` downstream and ``AudioEncoded``.
- ``TranscribeSequence`` (AR engine): waits for the window's audio embeddings, then its prompt's rows (the
  ``<|audio_pad|>`` rows holding them, positions ``0..L-1``), then one token per step, chosen greedily (or sampled
  with the request's seed) and fed back at the next position, as ``generate`` does; it stops at a stop token or
  ``max_tokens``. Each step's token goes out as it is chosen (``TranscriptTokens``); the stop token is not sent.
  Its prompt's full blocks before the audio are offered for prefix sharing (every window of a request, and every
  request with the same context prompt, starts alike).
"""

from __future__ import annotations

import torch

from omni_serve.engines.ar.kv_cache import block_hashes
from omni_serve.engines.ar.sequence import ARSequence
from omni_serve.engines.batch import BatchProgram
from omni_serve.engines.sampling import Sampler, SamplingParams
from omni_serve.families.qwen3_asr.messages import (
    AudioEmbeds, AudioEncoded, AudioFeatures, TranscribeCall, TranscribeDone, TranscriptTokens,
)
from omni_serve.models.qwen3_asr import Qwen3ASRLM


class EncodeProgram(BatchProgram):
    def __init__(self):
        self.features: AudioFeatures | None = None

    def feed(self, item: AudioFeatures) -> None:
        self.features = item

    def ready(self) -> bool:
        return self.features is not None and not self.done

    def work(self):
        return ("audio",), (self.features.features, self.features.frames)

    def work_size(self) -> float:
        return float(self.features.features.shape[-1])  # mel frames: the call's cost grows with them

    def complete(self, embeds: torch.Tensor) -> list[AudioEmbeds | AudioEncoded]:
        self.done = True
        self.features = None
        return [AudioEmbeds(embeds=embeds), AudioEncoded(audio_tokens=embeds.shape[0])]


class TranscribeSequence(ARSequence):
    def __init__(self, model: Qwen3ASRLM, call: TranscribeCall, block_size: int, stream_interval: int = 1):
        super().__init__(model.row_size, model.position_rows, model.dtype)
        self.model, self.call = model, call
        # tokens per TranscriptTokens after the first (0: all of them when the window ends)
        self.interval = stream_interval if call.stream else 0
        self.unsent: list[int] = []
        self.sampler = Sampler(SamplingParams(temperature=call.temperature, seed=call.seed))
        self.prompt_len = len(call.input_ids)
        self.max_rows = self.prompt_len + call.max_tokens
        self.audio: torch.Tensor | None = None
        self.generated: list[int] = []
        # rows before the first audio row are token embeddings only: shareable between requests
        first_audio = call.input_ids.index(model.audio_token_id) if model.audio_token_id in call.input_ids else 0
        self.prefix_hashes = block_hashes(call.input_ids[:first_audio], block_size)

    def feed(self, item: AudioEmbeds) -> None:
        self.audio = item.embeds

    def ready(self) -> bool:
        return not self.done and (self.num_rows > 0 and self.num_pending() > 0 or self.audio is not None)

    def poll(self) -> None:
        if self.num_rows == 0 and self.audio is not None:  # built on the engine's thread, with its torch threads
            self.append(*self.model.prompt_rows(self.call.input_ids, self.audio))
            self.audio = None

    def on_computed(self, start, end, hidden, logits) -> list[TranscriptTokens | TranscribeDone]:
        if logits is None:
            return []
        token = self.sampler.select(logits, self.generated)
        if token in self.model.eos_token_ids:
            return self._finish("stop")
        self.generated.append(token)
        self.unsent.append(token)
        if len(self.generated) >= self.call.max_tokens:
            return self._finish("length")
        self.append(self.model.embed(torch.tensor([token])), torch.tensor([[self.num_rows]]))
        if self.interval and (len(self.generated) == 1 or len(self.unsent) >= self.interval):
            return self._send()
        return []

    def _send(self) -> list[TranscriptTokens]:
        out = [TranscriptTokens(token_ids=self.unsent)] if self.unsent else []
        self.unsent = []
        return out

    def _finish(self, reason: str) -> list[TranscriptTokens | TranscribeDone]:
        self.done = True
        return self._send() + [TranscribeDone(prompt_tokens=self.prompt_len, generated_tokens=len(self.generated),
                                              finish_reason=reason)]
