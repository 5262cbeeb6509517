"""The lm stage's program: ``SpeakSequence``, the adapter's ``VibeVoiceSequence`` (``omni_serve.models.
vibevoice_sequence``: ``generate``'s per-token loop, each token's model work batched across the engine step) fed by
the graph: it waits for the speakers' reference clips (``VoiceClips``, from the ingress), and sends each speech
token's audio as ``SpeechAudio`` and the end as ``SpeechFinished``."""

from __future__ import annotations

import numpy as np

from omni_serve.families.vibevoice.messages import SpeakCall, SpeechAudio, SpeechFinished, VoiceClips
from omni_serve.models.vibevoice import SpeechChunk, SpeechPrompt, SpeechRequest, VibeVoiceLM
from omni_serve.models.vibevoice_sequence import VibeVoiceSequence


class SpeakSequence(VibeVoiceSequence):
    def __init__(self, model: VibeVoiceLM, call: SpeakCall):
        prompt = SpeechPrompt(input_ids=call.input_ids, speakers=call.speakers, voices=[])
        super().__init__(model, SpeechRequest(prompt=prompt, seed=call.seed, max_new_tokens=call.max_new_tokens,
                                              guidance_scale=call.guidance_scale,
                                              num_diffusion_steps=call.num_diffusion_steps))
        self.voices_in = False

    def feed(self, item: VoiceClips) -> None:
        if len(item.clips) != len(self.req.prompt.speakers):
            raise ValueError(f"{len(item.clips)} voice clips for {len(self.req.prompt.speakers)} speakers")
        self.req.prompt.voices = [np.asarray(c.float().numpy(), dtype=np.float32) for c in item.clips]
        self.voices_in = True

    def ready(self) -> bool:
        return self.voices_in and super().ready()

    def poll(self) -> None:
        if self.voices_in:
            super().poll()

    def on_followup(self, result) -> list:
        out = []
        for o in super().on_followup(result):
            if isinstance(o, SpeechChunk):
                samples = o.samples.detach().float().cpu().numpy().astype("<f4").reshape(-1)
                out.append(SpeechAudio(index=o.index, samples=samples.tobytes()))
            else:
                out.append(SpeechFinished(prompt_tokens=o.prompt_tokens, generated_tokens=o.generated_tokens,
                                          speech_tokens=o.speech_tokens, finish_reason=o.finish_reason))
        return out
