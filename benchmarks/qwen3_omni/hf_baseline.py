"""The qwen3_omni bench's transformers baseline: ``Qwen3OmniMoeForConditionalGeneration.generate`` one request at a
time, each request prepared and generated as ``benchmarks.qwen2_5_omni.hf_baseline`` describes, with this graph's
defaults.

Contract: ``Qwen3HFBaseline(HFBaselineConfig)``, run through ``run_hf_baseline(..., baseline=Qwen3HFBaseline)``.
"""

from __future__ import annotations

from benchmarks.qwen2_5_omni.hf_baseline import HFBaseline, HFBaselineConfig


class Qwen3HFBaseline(HFBaseline):
    """``Qwen3OmniMoeForConditionalGeneration.generate`` with the qwen3_omni graph's defaults: talker sampling
    from its ``TalkerParams`` (the code predictor samples as generate does), code2wav as generate runs it."""

    model_class = "Qwen3OmniMoeForConditionalGeneration"

    def _load(self, cfg: HFBaselineConfig) -> None:
        import torch
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from omni_serve.families.qwen3_omni.params import TalkerParams
        from omni_serve.families.qwen3_omni.spec import SPEECH_SYSTEM_PROMPT
        from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor

        self.talker = TalkerParams()
        self.max_codec_tokens = cfg.max_codec_tokens or self.talker.max_codec_tokens
        self.system_prompt = cfg.system_prompt or SPEECH_SYSTEM_PROMPT
        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            cfg.checkpoint, local_files_only=True, dtype=torch.float32).eval()
        c = self.model.config
        self.inputs = OmniInputProcessor(cfg.checkpoint)
        self.voices = {name.lower(): name.lower() for name in c.talker_config.speaker_id}

    def speech_kwargs(self, voice: str, sample: bool) -> dict:
        t = self.talker
        kw = dict(speaker=voice, return_audio=True, talker_max_new_tokens=self.max_codec_tokens,
                  talker_do_sample=sample, talker_repetition_penalty=t.repetition_penalty)
        if sample:
            kw.update(talker_temperature=t.temperature, talker_top_k=t.top_k, talker_top_p=t.top_p)
        return kw

    def audio_notes(self) -> list[str]:
        return [f"talker max_new_tokens={self.max_codec_tokens}; code2wav chunked_decode as generate runs it"]
