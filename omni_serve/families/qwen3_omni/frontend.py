"""Ingress side of the Qwen3-Omni graph: the Omni kit's chat frontend (``omni_serve.kits.omni.frontend``: the
OpenAI surface, validation, streaming and cancellation) on a Qwen3-Omni checkpoint.

What differs is read from the checkpoint: the processor (``Qwen3OmniMoeProcessor``, with its own audio token
arithmetic), the voices (``talker_config.speaker_id``: name -> codec speaker id), and the
talker's inputs (the tts bos/eos/pad tokens; the talker call carries the voice and the prompt's media layout,
for the talker's M-RoPE). Codec ids returned with ``return_token_ids`` are the frames flattened, frame by frame.
"""

from __future__ import annotations

from omni_serve.graph.messages import Message
from omni_serve.kits.omni.frontend import OmniFrontend, Prepared
from omni_serve.families.qwen3_omni.messages import CodecDelta, TalkerCall, TalkerPrompt
from omni_serve.families.qwen3_omni.spec import SPEECH_SYSTEM_PROMPT
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from omni_serve.models.qwen3_omni_layout import load_config, voices


class Qwen3OmniFrontend(OmniFrontend):
    default_system_prompt = SPEECH_SYSTEM_PROMPT

    def _load_checkpoint(self, checkpoint: str) -> None:
        cfg = load_config(checkpoint)
        self.config = cfg
        self.thinker_cfg, self.talker_cfg = cfg.thinker_config, cfg.talker_config
        self.inputs = OmniInputProcessor(checkpoint, video_fps=self.spec.video.fps)  # Qwen3OmniMoeProcessor
        # voice names as the checkpoint spells them, capitalised for the API (matched case-insensitively)
        self.voices = {name.capitalize(): sid for name, sid in voices(cfg).items()}

    def _talker_prompt(self, voice: str) -> TalkerPrompt:
        c = self.config
        return TalkerPrompt(voice_token=c.tts_bos_token_id, tts_end_token=c.tts_eos_token_id,
                            tts_pad_token=c.tts_pad_token_id)

    def _talker_call(self, p: Prepared) -> Message:
        return TalkerCall(request_id=p.request_id, voice=p.voice.lower(), seed=p.seed,
                          temperature=p.thinker.sampling.temperature, media_layout=p.thinker.media_layout,
                          return_frames=p.return_token_ids, paced=p.plays)

    @staticmethod
    def _codec_ids(out: Message) -> list[int] | None:
        return [c for frame in out.frames for c in frame] if isinstance(out, CodecDelta) else None
