"""VibeVoice's lm stage on the AR engine (``omni_serve.models.vibevoice``, ``vibevoice_sequence``) against
transformers' ``VibeVoiceForConditionalGeneration.generate`` on the tiny checkpoint, without Ray: one request and six
in flight (different scripts, one and two speakers, voices, seeds, lengths, guidance and diffusion steps, joining at
different steps) give ``generate``'s tokens and, to float rounding (``LATENT_TOL``, ``AUDIO_TOL``), its speech
latents and waveform, each request alone under ``torch.manual_seed(seed)``; a forced token pattern exercises audio
eos/bos and the eos stop, and shows the token scores after CFG (the uncond-token pass) are generate's; a swapped
script or voice fails the same comparison by far; a KV cache small enough to preempt, and side-branch KV lost after
every step, change nothing; voices encoded once and reused still draw each request's noise; abort frees the
engine's blocks and the side branches' state, and a side cache too small for a request fails it clearly.

Why a tolerance: the engine computes the same operations on other batch shapes (paged decode attention instead of
SDPA over a DynamicCache, the side branches' rows of all requests in one product, the diffusion head, decoder and
encoder over every speaking request), which round differently (~1e-6 a token, growing slowly through the feedback
loop); a swapped input moves the latents by > 0.1."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_serve.checkpoints.vibevoice import AUDIO_BOS, AUDIO_EOS, EOS, HOP_LENGTH, SAMPLE_RATE

# measured on this suite: latents <= 8e-5 (latents reach ~5), audio <= 3e-5 (rms ~0.1); on the small checkpoint
# after 75 tokens, latents <= 6e-4 (benchmarks/tools/vibevoice_lm_bench.py). A swap moves latents by > SWAP_MIN.
LATENT_TOL = 5e-4
AUDIO_TOL = 2e-4
SWAP_MIN = 0.1
TEXTS = ["Hello world, this is a test.", "The cat sat by the river.", "A quick brown fox jumps over it.",
         "Good morning to you all."]


def _voice(seed: int = 0, hz: float = 220.0, seconds: float = 1.5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


VOICES = [_voice(0, 220.0, 1.5), _voice(1, 330.0, 1.0), _voice(2, 150.0, 2.2), _voice(3, 260.0, 0.7)]

# (turns, voice per speaker, seed, max_new_tokens, overrides); 1 and 2 swap 0's script and voice
CASES = [
    ([("0", TEXTS[0])], {"0": 0}, 0, 8, {}),
    ([("0", TEXTS[1])], {"0": 0}, 0, 8, {}),
    ([("0", TEXTS[0])], {"0": 1}, 0, 8, {}),
    ([("0", TEXTS[2]), ("1", TEXTS[3]), ("0", TEXTS[1])], {"0": 2, "1": 3}, 3, 6, {}),
    ([("0", TEXTS[3])], {"0": 3}, 4, 5, {"guidance_scale": 1.0, "num_diffusion_steps": 5}),
    ([("0", TEXTS[2])], {"0": 1}, 5, 10, {"guidance_scale": 2.0, "num_diffusion_steps": 4}),
]


@pytest.fixture(scope="module")
def loaded(vibevoice_tiny_dir):
    from transformers import AutoModelForTextToWaveform, AutoProcessor

    from omni_serve.models.vibevoice import VibeVoiceLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's small ops run far slower on two threads when the cores are shared
    try:
        hf = AutoModelForTextToWaveform.from_pretrained(vibevoice_tiny_dir).eval()
        yield AutoProcessor.from_pretrained(vibevoice_tiny_dir), hf, VibeVoiceLM(vibevoice_tiny_dir)
    finally:
        torch.set_num_threads(threads)


def _messages(turns, voices):
    seen, messages = set(), []
    for speaker, text in turns:
        content = [{"type": "text", "text": text}]
        if speaker not in seen:
            seen.add(speaker)
            content.append({"type": "audio", "audio": voices[speaker]})
        messages.append({"role": speaker, "content": content})
    return messages


_REFERENCES: dict = {}


def _reference(loaded, case, logits_processor=None, sample=True):
    """(generated ids, speech latents [k, 64], audio [k * 3200]) of ``generate`` alone, seeded."""
    from transformers import LogitsProcessorList

    key = (CASES.index(case) if case in CASES else repr(case), id(logits_processor), sample)
    if key in _REFERENCES:
        return _REFERENCES[key]
    processor, hf, _ = loaded
    turns, voices, seed, new, overrides = case
    inputs = processor.apply_chat_template(
        _messages(turns, {s: VOICES[v] for s, v in voices.items()}), tokenize=True, return_dict=True,
        return_tensors="pt", processor_kwargs={"sampling_rate": SAMPLE_RATE})
    latents, sample_latent = [], hf._sample_audio_latent
    hf._sample_audio_latent = lambda *a, **k: latents.append(sample_latent(*a, **k)) or latents[-1]
    extra = {"logits_processor": LogitsProcessorList([logits_processor])} if logits_processor else {}
    try:
        torch.manual_seed(seed)
        out = hf.generate(**inputs, max_new_tokens=new, return_dict_in_generate=True, sample=sample, **overrides,
                          **extra)
    finally:
        del hf._sample_audio_latent
    prompt_len = inputs["input_ids"].shape[1]
    result = (out.sequences[0, prompt_len:].tolist(), torch.cat(latents).squeeze(1), out.audio[0][0])
    _REFERENCES[key] = result
    return result


def _request(model, case, **extra):
    from omni_serve.models.vibevoice import SpeechRequest

    turns, voices, seed, new, overrides = case
    voices = {s: (VOICES[v] if isinstance(v, int) else v) for s, v in voices.items()}
    return SpeechRequest(prompt=model.prompt(turns, voices), seed=seed, max_new_tokens=new, **overrides, **extra)


async def _serve(model, requests, config=None, joins=None):
    """Run ``requests`` on one engine; request ``i`` starts once request 0 has sent ``joins[i]`` chunks. Returns
    (sequences, outputs per request, engine stats)."""
    from omni_serve.engines.ar import ARConfig, AREngine
    from omni_serve.models.vibevoice import SpeechChunk
    from omni_serve.models.vibevoice_sequence import VibeVoiceSequence

    engine = AREngine("lm", model, config or ARConfig(), torch_threads=1)
    seqs = [VibeVoiceSequence(model, r) for r in requests]
    joins = joins or [0] * len(requests)
    chunks, ended = [0] * len(requests), [False] * len(requests)
    changed = asyncio.Condition()

    async def run(i):
        async with changed:
            await changed.wait_for(lambda: chunks[0] >= joins[i] or ended[0])
        outs = []
        try:
            async for out in engine.generate(f"r{i}", seqs[i]):
                outs.append(out)
                chunks[i] += isinstance(out, SpeechChunk)
                async with changed:
                    changed.notify_all()
        finally:
            ended[i] = True
            async with changed:
                changed.notify_all()
        return outs

    try:
        outputs = await asyncio.gather(*(run(i) for i in range(len(requests))))
        return seqs, outputs, engine.stats()
    finally:
        await engine.cleanup()


def _result(outs):
    from omni_serve.models.vibevoice import SpeechChunk, SpeechDone

    chunks = [o for o in outs if isinstance(o, SpeechChunk)]
    assert [c.index for c in chunks] == list(range(len(chunks)))  # none repeated or lost
    assert all(c.samples.shape == (HOP_LENGTH,) and c.samples.dtype == torch.float32 for c in chunks)
    done = outs[-1]
    assert isinstance(done, SpeechDone) and done.speech_tokens == len(chunks)
    return torch.stack([c.latent for c in chunks]), torch.cat([c.samples for c in chunks]), done


def _assert_matches(seq, outs, reference, what):
    tokens, latents, audio = reference
    assert seq.generated == tokens, what
    got_latents, got_audio, _ = _result(outs)
    assert got_latents.shape == latents.shape and got_audio.shape == audio.shape, what
    assert (got_latents - latents).abs().max() < LATENT_TOL, what
    assert (got_audio - audio).abs().max() < AUDIO_TOL, what
    return got_latents


def test_prompts_are_the_processors(loaded):
    from omni_serve.models.vibevoice import EncodedVoice, parse_script

    processor, _, model = loaded
    for turns, voices, *_ in (CASES[0], CASES[3]):
        clips = {s: VOICES[v] for s, v in voices.items()}
        expected = processor.apply_chat_template(_messages(turns, clips), tokenize=True, return_dict=True,
                                                 return_tensors="pt", processor_kwargs={"sampling_rate": SAMPLE_RATE})
        prompt = model.prompt(turns, clips)
        assert prompt.input_ids == expected["input_ids"][0].tolist()
        assert prompt.speakers == list(dict.fromkeys(s for s, _ in turns))
        # a voice encoded earlier takes the same placeholders
        embedded = {s: EncodedVoice(torch.zeros(model.voice_frames(c.size), model.latent_size))
                    for s, c in clips.items()}
        assert model.prompt(turns, embedded).input_ids == prompt.input_ids
    assert parse_script("Speaker 0: Hi there.\nSpeaker 1: Hello!\n  again") == [("0", "Hi there."),
                                                                                ("1", "Hello! again")]
    assert parse_script("Just text.") == [("0", "Just text.")]
    assert model.prompt("Speaker 0: Hi.", {0: VOICES[0]}).input_ids == model.prompt([("0", "Hi.")],
                                                                                   {"0": VOICES[0]}).input_ids
    for turns, voices in (([("0", "Hi")], {}), ([("0", "Hi")], {"0": VOICES[0], "1": VOICES[1]}),
                          ([("0", "  ")], {"0": VOICES[0]}), ([("0", "Hi")], {"0": np.zeros(0, np.float32)}),
                          ([], {})):
        with pytest.raises(ValueError):
            model.prompt(turns, voices)


def test_one_request_equals_generate(loaded):
    _, _, model = loaded
    case = CASES[0]
    (seq,), (outs,), _ = asyncio.run(_serve(model, [_request(model, case)]))
    _assert_matches(seq, outs, _reference(loaded, case), "alone")
    assert outs[-1].finish_reason == "length" and outs[-1].generated_tokens == 8
    assert outs[-1].prompt_tokens == len(model.prompt(case[0], {"0": VOICES[0]}).input_ids)
    assert model.side_stats()["states"] == 0 and model.side_stats()["branch_blocks_used"] == 0


class _Force:
    """A logits processor forcing token ``plan[i]`` at the i-th generated position; it keeps the scores it was
    given (after the token CFG, so they show the uncond-token pass)."""

    def __init__(self, prompt_len: int, plan: dict[int, int]):
        self.prompt_len, self.plan, self.seen = prompt_len, plan, []

    def __call__(self, input_ids, scores):
        self.seen.append(scores[0].clone())
        forced = self.plan.get(input_ids.shape[1] - self.prompt_len)
        if forced is None:
            return scores
        out = torch.full_like(scores, float("-inf"))
        out[:, forced] = 0.0
        return out


def test_audio_eos_bos_and_the_eos_stop_follow_generate(loaded):
    processor, _, model = loaded
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in (AUDIO_BOS, AUDIO_EOS, EOS)}
    case = ([("0", TEXTS[1])], {"0": 2}, 11, 12, {})
    request = _request(model, case)
    plan = {1: ids[AUDIO_EOS], 3: ids[AUDIO_BOS], 6: ids[EOS]}
    request.logits_processor = force = _Force(request.prompt.num_tokens, plan)
    (seq,), (outs,), _ = asyncio.run(_serve(model, [request]))
    reference_force = _Force(request.prompt.num_tokens, plan)
    reference = _reference(loaded, case, reference_force)
    assert reference[0][-1] == ids[EOS] and len(reference[0]) == 7
    _assert_matches(seq, outs, reference, "forced")
    assert outs[-1].finish_reason == "stop" and outs[-1].speech_tokens == 4 and outs[-1].generated_tokens == 7
    # the token scores after CFG (log-softmax mix with the uncond-token pass) are generate's
    got, expected = torch.stack(force.seen), torch.stack(reference_force.seen)
    assert got.shape == expected.shape == (7, model.config.vocab_size)
    assert torch.allclose(got, expected, atol=1e-3, rtol=0)


def test_six_in_flight_each_equal_generate_alone_and_swaps_fail(loaded):
    from omni_serve.engines.ar import ARConfig

    _, _, model = loaded
    seqs, outputs, stats = asyncio.run(_serve(model, [_request(model, c) for c in CASES], ARConfig(),
                                              joins=[0, 0, 1, 2, 3, 5]))
    assert stats["followup_calls"] < stats["followups"]  # followups were batched across requests
    got = [_assert_matches(s, o, _reference(loaded, c), f"case {i}")
           for i, (s, o, c) in enumerate(zip(seqs, outputs, CASES))]
    # negative controls: request 0 against the references of its swapped script (1) and voice (2)
    for swapped in (1, 2):
        assert (got[0] - _reference(loaded, CASES[swapped])[1]).abs().max() > SWAP_MIN
    assert model.side_stats()["states"] == 0 and model.side_stats()["branch_blocks_used"] == 0


def test_preemption_gives_the_same_outputs(loaded):
    from omni_serve.engines.ar import ARConfig

    _, _, model = loaded
    cases = [CASES[0], CASES[3], CASES[5]]
    config = ARConfig(num_kv_blocks=40, block_size=4, max_batch_tokens=64)
    seqs, outputs, stats = asyncio.run(_serve(model, [_request(model, c) for c in cases], config))
    assert stats["preemptions"] > 0, stats
    for s, o, c in zip(seqs, outputs, cases):
        _assert_matches(s, o, _reference(loaded, c), f"preempted {c[0]}")
    assert stats["kv_blocks_used"] == 0
    assert model.side_stats()["states"] == 0 and model.side_stats()["branch_blocks_used"] == 0


def test_side_branches_lost_between_steps_are_recomputed(loaded):
    """Every request's side-branch KV evicted after every engine step (what a short ``branch_kv_blocks`` does to
    requests outside a step): each follow-up recomputes the uncond and negative rows from the stored ids and rows."""
    from omni_serve.engines.ar import ARConfig, AREngine
    from omni_serve.models.vibevoice_sequence import VibeVoiceSequence

    _, _, model = loaded
    cases = [CASES[3], CASES[5]]
    before = model.side_stats()["branch_evictions"]

    def evict_all(batch, seconds):  # the engine's step observer: called on its worker thread after each step
        while model.branches.evict_one():
            pass

    async def main():
        engine = AREngine("lm", model, ARConfig(), torch_threads=1)
        engine.on_step = evict_all
        seqs = [VibeVoiceSequence(model, _request(model, c)) for c in cases]

        async def run(i):
            return [o async for o in engine.generate(f"e{i}", seqs[i])]

        try:
            return seqs, await asyncio.gather(*(run(i) for i in range(len(seqs))))
        finally:
            await engine.cleanup()

    seqs, outputs = asyncio.run(main())
    assert model.side_stats()["branch_evictions"] - before >= 10
    for s, o, c in zip(seqs, outputs, cases):
        _assert_matches(s, o, _reference(loaded, c), f"evicted {c[0]}")


def test_registered_voices_equal_generate_with_the_clips(loaded):
    """A voice encoded once and reused: its sigma-VAE noise is still drawn per request from the request's seed, in
    generate's order, so the request equals generate given the clip; with sample off it equals generate's
    ``sample=False``; a registered voice next to a clip (a two-speaker script) too, to rounding."""
    _, _, model = loaded
    registered = model.encode_voices([VOICES[1]])[0]
    assert registered.frames == model.voice_frames(VOICES[1].size)
    cases = [([("0", TEXTS[3])], {"0": 1}, 7, 6, {}), ([("0", TEXTS[3])], {"0": 1}, 8, 6, {}),
             ([("0", TEXTS[0]), ("1", TEXTS[2])], {"0": 2, "1": 1}, 9, 5, {})]
    requests = [_request(model, (c[0], {s: (registered if v == 1 else v) for s, v in c[1].items()}, *c[2:]))
                for c in cases]
    requests[1].sample_voice = False
    seqs, outputs, _ = asyncio.run(_serve(model, requests))
    for i, (seq, outs, case) in enumerate(zip(seqs, outputs, cases)):
        _assert_matches(seq, outs, _reference(loaded, case, sample=i != 1), f"registered voice {i}")


def test_abort_frees_the_engine_blocks_and_the_side_state(loaded):
    from omni_serve.engines.ar import ARConfig, AREngine
    from omni_serve.models.vibevoice_sequence import VibeVoiceSequence

    _, _, model = loaded

    async def main():
        engine = AREngine("lm", model, ARConfig(), torch_threads=1)
        try:
            gen = engine.generate("long", VibeVoiceSequence(model, _request(model, ([("0", TEXTS[0])], {"0": 0}, 1,
                                                                                     200, {}))))
            await gen.__anext__()
            await gen.__anext__()
            busy = engine.stats()["kv_blocks_used"], model.side_stats()
            await gen.aclose()
            for _ in range(300):
                if engine.stats()["kv_blocks_used"] == 0 and model.side_stats()["states"] == 0:
                    break
                await asyncio.sleep(0.01)
            return busy, engine.stats(), model.side_stats()
        finally:
            await engine.cleanup()

    (blocks, side), stats, after = asyncio.run(main())
    assert blocks > 0 and side["states"] == 1 and side["branch_blocks_used"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["active"] == 0
    assert after["states"] == 0 and after["branch_blocks_used"] == 0


def test_side_branch_blocks_are_evicted_from_requests_outside_the_step_and_refused_clearly(loaded):
    from omni_serve.models.vibevoice_head import NEGATIVE, UNCOND, BranchKV, BranchSegment

    kv = BranchKV(1, 1, 4, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    evicted = []
    kv.on_evict = evicted.append
    batch, refused = kv.plan([BranchSegment("a", UNCOND, 0, 5), BranchSegment("a", NEGATIVE, 0, 4)])
    assert batch is not None and not refused and kv.num_used_blocks == 3
    batch, refused = kv.plan([BranchSegment("b", UNCOND, 0, 3), BranchSegment("b", NEGATIVE, 0, 3)])
    assert not refused and evicted == ["a"] and kv.num_used_blocks == 2 and not kv.holds("a")
    batch, refused = kv.plan([BranchSegment("b", UNCOND, 3, 1), BranchSegment("c", UNCOND, 0, 9)])
    assert refused == ["c"] and kv.holds("b") and not kv.holds("c") and batch.write_slots.numel() == 1

    # through the engine: a side cache too small for one request fails that request with a clear error
    from omni_serve.engines.ar import ARConfig

    _, _, model = loaded
    saved = model.branches
    model.branches = BranchKV(model.num_layers, model.num_kv_heads, model.head_dim, num_blocks=1, block_size=4,
                              dtype=model.dtype, device=model.device)
    model.branches.on_evict = saved.on_evict
    try:
        with pytest.raises(RuntimeError, match="branch_kv_blocks"):
            asyncio.run(_serve(model, [_request(model, CASES[0])], ARConfig()))
    finally:
        model.branches = saved
    assert model.side_stats()["states"] == 0
