"""The Omni stages wired in one process on the real engines (no Ray): encoder -> thinker -> talker -> code2wav.

Edges are asyncio queues standing in for the data plane; everything else (programs, AR engines with their
paged KV caches and continuous batching, step engines) is what the served graph runs. With
``thinker_layout="disaggregated"`` the thinker is a prefill engine handing each prompt's KV to a decode
engine (``self.thinker``), as the disaggregated graph spec deploys it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from omni_serve.checkpoints.qwen2_5_omni import TOKEN_ID
from omni_serve.engines.ar import ARConfig, AREngine
from omni_serve.engines.sampling import SamplingParams
from omni_serve.engines.batch import BatchEngine
from omni_serve.engines.stepper import StepEngine
from omni_serve.graphs.qwen2_5_omni.code2wav import Code2WavCompute, Code2WavRequest, Code2WavStream
from omni_serve.graphs.qwen2_5_omni.programs import (
    EncoderProgram, TalkerRequest, TalkerSequence, ThinkerRequest, ThinkerRole, ThinkerSequence,
)

MEDIA_TOKENS = (TOKEN_ID["<|AUDIO|>"], TOKEN_ID["<|IMAGE|>"], TOKEN_ID["<|VIDEO|>"])


@dataclass
class Result:
    tokens: list[int]
    codes: list[int]
    wav: object


async def _queue_items(q: asyncio.Queue):
    while (item := await q.get()) is not None:
        yield item


class InProcessOmni:
    def __init__(self, proc, enc, thk, tlk, c2w, ar: ARConfig | None = None, steps: int = 3,
                 thinker_layout: str = "aggregated"):
        self.proc, self.enc, self.thk, self.tlk, self.c2w = proc, enc, thk, tlk, c2w
        self.ar = ar or ARConfig()
        self.encoder = StepEngine("encoder")
        self.disaggregated = thinker_layout == "disaggregated"
        self.thinker_prefill = AREngine("thinker_prefill", thk, self.ar) if self.disaggregated else None
        self.thinker = AREngine("thinker_decode" if self.disaggregated else "thinker", thk, self.ar)
        self.talker = AREngine("talker", tlk, self.ar)
        self.steps = steps
        self.code2wav = BatchEngine("code2wav", Code2WavCompute(c2w, steps, 0.5, -1.0))

    async def close(self):
        for e in (self.encoder, self.thinker_prefill, self.thinker, self.talker, self.code2wav):
            if e is not None:
                await e.cleanup()

    async def run(self, rid: str, x, thinker_tokens: int, talker_tokens: int, seed: int,
                  audio: bool = True, first_chunk: int = 1) -> Result:
        media = {}
        if x.input_features is not None or x.pixel_values is not None:
            async def one():
                yield {"input_features": x.input_features, "feature_attention_mask": x.feature_attention_mask,
                       "pixel_values": x.pixel_values, "image_grid_thw": x.image_grid_thw}
            async for out in self.encoder.generate(rid, EncoderProgram(self.enc), one()):
                media = out["downstream"]
        req = ThinkerRequest(
            input_ids=x.input_ids[0].tolist(), max_new_tokens=thinker_tokens,
            sampling=SamplingParams(temperature=0), stop_token_ids=(TOKEN_ID["<|im_end|>"],),
            image_grid_thw=None if x.image_grid_thw is None else x.image_grid_thw.tolist(),
            audio_seqlens=None if x.audio_seqlens is None else x.audio_seqlens.tolist(),
            expects_media=bool(media), talker_voice_token=TOKEN_ID["<|spk_chelsie|>"] if audio else None,
            talker_tokens=(self.tlk.config.tts_text_end_token_id, self.tlk.config.tts_text_pad_token_id),
            media_token_ids=MEDIA_TOKENS, first_chunk_size=first_chunk, block_size=self.ar.block_size)
        if self.disaggregated:
            prefill = ThinkerSequence(self.thk, self.proc.tokenizer, req, role=ThinkerRole.PREFILL)
            if media:
                prefill.feed(media)
            handoff = [out["downstream"] async for out in self.thinker_prefill.generate(rid, prefill)]
            thinker = ThinkerSequence(self.thk, self.proc.tokenizer, req, role=ThinkerRole.DECODE)
            thinker.feed(handoff[0])
        else:
            thinker = ThinkerSequence(self.thk, self.proc.tokenizer, req)
            if media:
                thinker.feed(media)
        tokens, codes, wavs = [], [], []
        to_talker, to_c2w = asyncio.Queue(), asyncio.Queue()

        async def run_thinker():
            try:
                async for out in self.thinker.generate(rid, thinker):
                    tokens.extend(out["token_ids"])
                    if "downstream" in out:
                        await to_talker.put(out["downstream"])
            finally:
                await to_talker.put(None)

        async def run_talker():
            talker = TalkerSequence(self.tlk, TalkerRequest(max_new_tokens=talker_tokens, sampling=SamplingParams(
                temperature=0, repetition_penalty=1.05, suppress_tokens=(self.tlk.codec_bos,))))
            try:
                async for out in self.talker.generate(rid, talker, _queue_items(to_talker)):
                    codes.extend(out["codes"])
                    await to_c2w.put(out["downstream"])
            finally:
                await to_c2w.put(None)

        async def run_code2wav():
            program = Code2WavStream(self.c2w, Code2WavRequest("Chelsie", seed, self.steps))
            async for out in self.code2wav.generate(rid, program, _queue_items(to_c2w)):
                wavs.append(out["audio"])

        if audio:
            await asyncio.gather(run_thinker(), run_talker(), run_code2wav())
        else:
            await run_thinker()
        return Result(tokens, codes, np.concatenate(wavs) if wavs else None)
