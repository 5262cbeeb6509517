"""The Omni graph in one process on the real runners and engines (no Ray), wired from its declaration.

``InProcessOmni`` is a ``LocalGraph`` of the ``qwen2_5_omni`` family (every edge on the in-process connector)
plus the calls the frontend would send for a preprocessed prompt. Everything else (runners, programs, AR
engines with their paged KV caches and continuous batching, step and batch engines) is what the served graph
runs. With ``thinker_layout="disaggregated"`` the thinker is a prefill engine handing each prompt's KV to a
decode engine (``self.thinker``), as the disaggregated graph spec deploys it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_serve.checkpoints.qwen2_5_omni import TOKEN_ID
from omni_serve.engines.ar import ARConfig
from omni_serve.graph.local import LocalGraph
from omni_serve.families.qwen2_5_omni import FAMILY
from omni_serve.families.qwen2_5_omni.messages import (
    AudioDelta, CodecDelta, Code2WavCall, EncoderCall, MediaInputs, MediaLayout, SamplingSettings, TalkerCall,
    TalkerPrompt, TextDelta, ThinkerCall,
)

AR_STAGES = ("thinker", "thinker_prefill", "thinker_decode", "talker")


@dataclass
class Result:
    tokens: list[int]
    codes: list[int]
    wav: object
    logprobs: list = None  # the thinker's TokenLogprob per token, when the run asked for them


class InProcessOmni:
    def __init__(self, checkpoint: str, ar: ARConfig | None = None, steps: int = 3, talker_tokens: int = 20,
                 thinker_layout: str = "aggregated", first_chunk: int = 1, overrides: dict | None = None):
        ar = (ar or ARConfig()).model_dump()
        self.graph = LocalGraph(FAMILY, {
            "checkpoint": checkpoint, "thinker_layout": thinker_layout,
            **{f"stages.{s}.engine.ar": ar for s in AR_STAGES},
            "stages.talker.params.max_codec_tokens": talker_tokens, "stages.code2wav.params.num_steps": steps,
            "edges.thinker_talker.first_chunk_size": first_chunk, **(overrides or {}),
        })
        engines = self.graph.engines
        self.thinker = engines[self.graph.spec.text_stage()]
        self.thinker_prefill = engines.get("thinker_prefill")
        self.talker = engines["talker"]
        talker = self.graph.runners["talker"].model.config
        self.talker_prompt = TalkerPrompt(voice_token=TOKEN_ID["<|spk_chelsie|>"],
                                          tts_end_token=talker.tts_text_end_token_id,
                                          tts_pad_token=talker.tts_text_pad_token_id)

    async def close(self):
        await self.graph.aclose()

    async def run(self, rid: str, x, thinker_tokens: int, seed: int, audio: bool = True,
                  forced_reply: list[int] | None = None, penalties: dict[str, float] | None = None,
                  logprobs: int | None = None, json_schema: str | None = None, grammar: str | None = None,
                  paced: bool = False) -> Result:
        """One greedy request for the preprocessed prompt ``x`` (``OmniInputProcessor`` output). ``forced_reply``: the
        thinker's reply is forced (speech). ``penalties``: the thinker's presence and frequency penalties (and logit_bias).
        ``logprobs``: each text token's log-probability with this many alternatives. ``json_schema``: the reply is
        constrained to JSON the schema accepts; ``grammar``: to this Lark grammar. ``paced``: the talker paces the
        reply as for a client that plays it (``playback.talker_lead_s``)."""
        spec, stages = self.graph.spec, self.graph.stages
        media = x.has_media
        calls = {}
        if media:
            await stages.put(rid, "ingress_encoder", MediaInputs.of(x))
            calls["encoder"] = EncoderCall(request_id=rid)
        thinker = ThinkerCall(
            request_id=rid, input_ids=x.input_ids[0].tolist(), max_new_tokens=thinker_tokens,
            sampling=SamplingSettings(temperature=0.0, seed=seed, logprobs=logprobs, json_schema=json_schema, grammar=grammar,
                                      **(penalties or {})),
            stop_token_ids=[TOKEN_ID["<|im_end|>"]],
            media_layout=MediaLayout.of(x), expects_media=media, talker=self.talker_prompt if audio else None,
            forced_reply=forced_reply)
        calls.update({stage: thinker for stage in spec.thinker_stages()})
        if audio:
            calls["talker"] = TalkerCall(request_id=rid, seed=seed, temperature=0.0, paced=paced)
            calls["code2wav"] = Code2WavCall(request_id=rid, voice="Chelsie", seed=seed)
        tokens, codes, wavs, lps = [], [], [], []
        async for _, out in stages.stream(rid, calls, timeout_s=300):
            if isinstance(out, TextDelta):
                tokens.extend(out.token_ids)
                lps.extend(out.logprobs or [])
            elif isinstance(out, CodecDelta):
                codes.extend(out.codes)
            elif isinstance(out, AudioDelta):
                wavs.append(np.frombuffer(out.samples, dtype="<f4"))
        return Result(tokens, codes, np.concatenate(wavs) if wavs else None, lps if logprobs is not None else None)
