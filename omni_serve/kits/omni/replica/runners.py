"""Stage runners of the Omni encoder and thinker stages (hosted by ``omni_serve.deployments.stage.StageDeployment``).

Each runner runs on the engine and adapter its stage declaration names and, per request, builds the program from
the stage's call (plain ids and settings, no tensors), reads its input edge and writes its output edge. In the
disaggregated thinker layout the thinker is two stages: ``ThinkerPrefillRunner`` (reads ``encoder_thinker``,
writes the prompt hand-off on ``thinker_prefill_thinker_decode``) and ``ThinkerDecodeRunner`` (reads that
hand-off, writes ``thinker_talker`` and yields the text). A family's graph names ``EncoderRunner`` directly and
subclasses the thinker runners with its thinker program.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

from omni_serve.engines.sampling import SamplingParams
from omni_serve.graph.runner import StageRunner
from omni_serve.kits.omni.messages import EncoderCall, PrefillDone, ThinkerCall
from omni_serve.kits.omni.replica import thinker as P


HANDOFF = "thinker_prefill_thinker_decode"


class EncoderRunner(StageRunner):
    async def run(self, engine, call: EncoderCall) -> AsyncIterator:
        program = P.EncoderProgram(self.model)
        async for out in self.drive(engine, call.request_id, program):
            yield out


class ThinkerRunner(StageRunner):
    """The thinker in the aggregated layout; its subclasses are the two halves of the disaggregated one. A family
    subclasses each, naming its thinker program (``sequence``)."""

    role = P.ThinkerRole.AGGREGATED
    sequence: type[P.OmniThinkerSequence]  # the program: each family's runners name theirs

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.checkpoint)
        self.media_token_ids = self.model.media_token_ids
        self._grammars = None  # GrammarCompiler, made on the first constrained request
        self._grammars_lock = threading.Lock()

    def thinker_request(self, call: ThinkerCall) -> P.ThinkerRequest:
        edge, s = self.spec.edge_spec("thinker_talker"), call.sampling
        stops = tuple(call.stop_token_ids)
        talker = call.talker
        return P.ThinkerRequest(
            input_ids=call.input_ids, max_new_tokens=call.max_new_tokens,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                    presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                    logit_bias=tuple(map(tuple, s.logit_bias)),
                                    min_new_tokens=s.min_new_tokens, stop_token_ids=stops),
            stop_token_ids=stops, stop=tuple(call.stop), media_layout=call.media_layout,
            expects_media=call.expects_media,
            talker_voice_token=None if talker is None else talker.voice_token,
            talker_tokens=(0, 0) if talker is None else (talker.tts_end_token, talker.tts_pad_token),
            chunk_size=edge.chunk_size, first_chunk_size=edge.first_chunk_size,
            media_token_ids=self.media_token_ids, block_size=self.engine_spec.ar.block_size,
            forced_reply=tuple(call.forced_reply or ()), logprobs=s.logprobs,
            constraint=self._constraint(s, stops[0])
            if (s.json_schema or s.grammar) and self.role is not P.ThinkerRole.PREFILL else None,
        )

    def _constraint(self, s, end_token: int):
        """A request's constraint (its Lark grammar, or its JSON schema's); the tokenizer is wrapped for the grammar
        engine once per replica."""
        from omni_serve.engines.constraints import GrammarCompiler

        with self._grammars_lock:  # requests' threads (see run) may come together
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model.vocab_size, end_token)
        return self._grammars.constraint(s.grammar or GrammarCompiler.json_grammar(s.json_schema))

    async def run(self, engine, call: ThinkerCall) -> AsyncIterator:
        # a JSON schema's grammar is compiled off the event loop (CPU work: milliseconds, up to a second for large
        # schemas), so the replica's other requests keep streaming meanwhile
        constrained = call.sampling.json_schema or call.sampling.grammar
        req = await asyncio.to_thread(self.thinker_request, call) if constrained else self.thinker_request(call)
        program = self.sequence(self.model, self.tokenizer, req, role=self.role)
        rid = call.request_id
        if self.role is P.ThinkerRole.DECODE:
            program.feed(await self.io.read_one(HANDOFF, rid))
        elif req.expects_media:
            program.feed(await self.io.read_one("encoder_thinker", rid))
        if self.role is P.ThinkerRole.PREFILL:
            writes = HANDOFF
        else:
            writes = "thinker_talker" if call.talker is not None else None
        async for out in self.drive(engine, rid, program, reads=None, writes=writes):  # input fed above
            yield out
        if self.role is P.ThinkerRole.PREFILL:
            yield PrefillDone(prompt_tokens=program.prompt_len)


class ThinkerPrefillRunner(ThinkerRunner):
    """Disaggregated layout, first half: the prompt's KV, handed to ``thinker_decode``."""

    role = P.ThinkerRole.PREFILL


class ThinkerDecodeRunner(ThinkerRunner):
    """Disaggregated layout, second half: adopts the prefilled prompt and generates."""

    role = P.ThinkerRole.DECODE
