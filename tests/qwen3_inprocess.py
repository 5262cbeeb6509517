"""The Qwen3-Omni graph in one process on the real runners and engines (no Ray), wired from its declaration.

``InProcessQwen3Omni`` is a ``LocalGraph`` of the ``qwen3_omni`` family (every edge on the in-process connector)
plus the calls the frontend would send for a preprocessed prompt; ``reference`` runs transformers' ``generate``
on the same inputs and returns what the graph must reproduce (text tokens, codec frames, waveform).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_serve.engines.ar import ARConfig
from omni_serve.graph.local import LocalGraph
from omni_serve.families.qwen3_omni import FAMILY
from omni_serve.families.qwen3_omni.messages import (
    AudioDelta, CodecDelta, Code2WavCall, EncoderCall, MediaInputs, MediaLayout, SamplingSettings, TalkerCall,
    TalkerPrompt, TextDelta, ThinkerCall,
)
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from omni_serve.models.qwen3_omni_layout import load_config

AR_STAGES = ("thinker", "thinker_prefill", "thinker_decode", "talker")
VOICE = "ethan"


@dataclass
class Result:
    tokens: list[int]
    frames: list[list[int]]
    wav: np.ndarray | None


def input_processor(checkpoint: str) -> OmniInputProcessor:
    return OmniInputProcessor(checkpoint)


def reference(model, x, thinker_tokens: int, talker_tokens: int) -> Result:
    """Greedy ``Qwen3OmniMoeForConditionalGeneration.generate``; the frames are those it hands code2wav."""
    if not hasattr(model.talker.config, "audio_config"):
        # transformers 5.23's talker M-RoPE reads audio_config.n_window for a video's audio (use_audio_in_video)
        # and its config has none (generate raises); the audio tower's is the one meant, as the server uses
        # (omni_serve.models.qwen3_omni.talker_rope_config).
        model.talker.config.audio_config = model.config.thinker_config.audio_config
    caught = []
    decode = model.code2wav.chunked_decode
    model.code2wav.chunked_decode = lambda codes, **kw: (caught.append(codes), decode(codes, **kw))[1]
    try:
        out = model.generate(**x.reference_kwargs(), speaker=VOICE, thinker_max_new_tokens=thinker_tokens,
                             thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=talker_tokens)
    finally:
        del model.code2wav.chunked_decode
    if not caught:  # no speech: generate returned the thinker's output alone
        return Result(out[0, x.input_ids.shape[1]:].tolist(), [], None)
    seq, wav = out
    return Result(seq[0, x.input_ids.shape[1]:].tolist(), caught[0][0].T.tolist(), wav.reshape(-1).numpy())


class InProcessQwen3Omni:
    def __init__(self, checkpoint: str, ar: ARConfig | None = None, talker_tokens: int = 40,
                 thinker_layout: str = "aggregated", **overrides):
        ar = (ar or ARConfig()).model_dump()
        self.graph = LocalGraph(FAMILY, {
            "checkpoint": checkpoint, "thinker_layout": thinker_layout,
            **{f"stages.{s}.engine.ar": ar for s in AR_STAGES},
            "stages.talker.params.max_codec_tokens": talker_tokens, **overrides,
        })
        self.config = load_config(checkpoint)
        engines = self.graph.engines
        self.thinker = engines[self.graph.spec.text_stage()]
        self.thinker_prefill = engines.get("thinker_prefill")
        self.talker = engines["talker"]
        self.code2wav = engines["code2wav"]

    async def close(self):
        await self.graph.aclose()

    async def run(self, rid: str, x, thinker_tokens: int, seed: int = 1, audio: bool = True,
                  forced_reply: list[int] | None = None) -> Result:
        """One greedy request for the preprocessed prompt ``x``. ``forced_reply``: the thinker's reply is forced (speech)."""
        c, spec, stages = self.config, self.graph.spec, self.graph.stages
        media, layout = x.has_media, MediaLayout.of(x)
        calls = {}
        if media:
            await stages.put(rid, "ingress_encoder", MediaInputs.of(x))
            calls["encoder"] = EncoderCall(request_id=rid)
        talker = TalkerPrompt(voice_token=c.tts_bos_token_id, tts_end_token=c.tts_eos_token_id,
                              tts_pad_token=c.tts_pad_token_id)
        thinker = ThinkerCall(
            request_id=rid, input_ids=x.input_ids[0].tolist(), max_new_tokens=thinker_tokens,
            sampling=SamplingSettings(temperature=0.0, seed=seed), stop_token_ids=[c.im_end_token_id],
            media_layout=layout, expects_media=media, talker=talker if audio else None,
            forced_reply=forced_reply)
        calls.update({stage: thinker for stage in spec.thinker_stages()})
        if audio:
            calls["talker"] = TalkerCall(request_id=rid, voice=VOICE, seed=seed, temperature=0.0,
                                         media_layout=layout, return_frames=True)
            calls["code2wav"] = Code2WavCall(request_id=rid, voice=VOICE, seed=seed)
        tokens, frames, wavs = [], [], []
        async for _, out in stages.stream(rid, calls, timeout_s=300):
            if isinstance(out, TextDelta):
                tokens.extend(out.token_ids)
            elif isinstance(out, CodecDelta):
                frames.extend(out.frames)
            elif isinstance(out, AudioDelta):
                wavs.append(np.frombuffer(out.samples, dtype="<f4"))
        return Result(tokens, frames, np.concatenate(wavs) if wavs else None)
