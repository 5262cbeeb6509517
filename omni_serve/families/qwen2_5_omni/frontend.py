"""Ingress side of the Qwen2.5-Omni graph: the Omni kit's chat frontend (``omni_serve.kits.omni.frontend``: the
OpenAI surface, validation, streaming and cancellation) on a Qwen2.5-Omni checkpoint.

What is this family's: the processor and voices read from the checkpoint (``spk_dict.pt``: name -> the voice's
text-bos token), the talker prompt's tokens (the talker config's tts text end/pad ids), the talker call and the
codec ids it returns (``CodecDelta.codes``).
"""

from __future__ import annotations

from omni_serve.families.qwen2_5_omni.messages import CodecDelta, TalkerCall, TalkerPrompt
from omni_serve.families.qwen2_5_omni.spec import SPEECH_SYSTEM_PROMPT
from omni_serve.graph.messages import Message
from omni_serve.kits.omni.frontend import OmniFrontend, Prepared
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from omni_serve.models.qwen2_5_omni_layout import load_config, load_speakers


class Qwen25OmniFrontend(OmniFrontend):
    default_system_prompt = SPEECH_SYSTEM_PROMPT

    def _load_checkpoint(self, checkpoint: str) -> None:
        """Set ``inputs`` (the input processor), ``thinker_cfg`` and ``voices`` (name -> what the talker needs)."""
        self.inputs = OmniInputProcessor(checkpoint, video_fps=self.spec.video.fps)
        cfg = load_config(checkpoint)
        self.thinker_cfg, self.talker_cfg = cfg.thinker_config, cfg.talker_config
        self.voices = {name: int(v["bos_token"]) for name, v in load_speakers(checkpoint).items()}

    def _talker_prompt(self, voice: str) -> TalkerPrompt:
        """The thinker token ids the talker's prompt is built from."""
        return TalkerPrompt(voice_token=self.voices[voice], tts_end_token=self.talker_cfg.tts_text_end_token_id,
                            tts_pad_token=self.talker_cfg.tts_text_pad_token_id)

    def _talker_call(self, p: Prepared) -> Message:
        return TalkerCall(request_id=p.request_id, seed=p.seed, temperature=p.thinker.sampling.temperature,
                          paced=p.plays)

    @staticmethod
    def _codec_ids(out: Message) -> list[int] | None:
        """The codec ids a talker output carries (``return_token_ids``), or None if it is not one."""
        return out.codes if isinstance(out, CodecDelta) else None
