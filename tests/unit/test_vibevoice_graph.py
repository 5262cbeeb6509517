"""The VibeVoice graph in one process (``LocalGraph``: the lm stage's runner and engine, the frontend, no Ray) on the
tiny checkpoint, against transformers' ``generate`` on the same checkpoint: speech in a preset voice, in a cloned
(uploaded) voice and with two speakers, alone and eight in flight, equals ``generate``'s audio seeded the same (to the
pcm16 reply's rounding); a swapped script or voice is far off; the SSE stream carries the same audio as the file;
bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf
import torch

SR = 24000
TOKENS = 8  # speech tokens per request (max_speech_seconds below): 8 x 3200 samples
ARGS = {"max_speech_seconds": TOKENS / 7.5, "stages.lm.engine.torch_threads": 1}
TEXTS = ["Hello world, this is a test.", "The cat sat by the river.", "Good morning to you all."]
# pcm16 rounding (half a step) and the engine's float rounding against generate (tests/unit/test_vibevoice_lm.py)
TOL = 0.5 / 32768 + 2e-4


def clip(hz: float, seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * np.random.default_rng(seed).standard_normal(t.size)).astype(
        np.float32)


def wav_b64(samples: np.ndarray) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, SR, format="WAV", subtype="FLOAT")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def graph(vibevoice_tiny_dir, tmp_path_factory):
    from omni_serve.families.vibevoice import FAMILY
    from omni_serve.graph.local import LocalGraph

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = LocalGraph(FAMILY, {"checkpoint": vibevoice_tiny_dir, **ARGS,
                            "voices.dir": str(tmp_path_factory.mktemp("voices"))})
    asyncio.run(g.frontend.start())  # the voice database (a replica's ASGI lifespan starts it)
    yield g
    asyncio.run(g.frontend.close())
    asyncio.run(g.aclose())
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def generate(vibevoice_tiny_dir):
    """generate's audio for (turns, speaker -> clip, seed), seeded as the graph seeds a request."""
    from transformers import AutoModelForTextToWaveform, AutoProcessor

    processor = AutoProcessor.from_pretrained(vibevoice_tiny_dir)
    model = AutoModelForTextToWaveform.from_pretrained(vibevoice_tiny_dir).eval()

    def run(turns, voices, seed):
        seen, messages = set(), []
        for speaker, text in turns:
            content = [{"type": "text", "text": text}]
            if speaker not in seen:
                seen.add(speaker)
                content.append({"type": "audio", "audio": voices[speaker]})
            messages.append({"role": speaker, "content": content})
        inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                               processor_kwargs={"sampling_rate": SR})
        torch.manual_seed(seed)
        return model.generate(**inputs, max_new_tokens=TOKENS)[0][0].numpy()
    return run


def speech(graph, body: dict, ctx=None):
    from omni_serve.api.audio_protocol import SpeechRequest
    from omni_serve.graph.frontend import RequestContext

    async def main():
        req = SpeechRequest(**{"model": "vibevoice", **body})
        reply = await graph.frontend.audio_speech(req, ctx or RequestContext(120))
        if hasattr(reply, "chunks"):
            return b"".join([c async for c in reply.chunks])
        return [line async for line in reply.lines]
    return main()


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768


def test_speech_equals_generate_alone_and_eight_in_flight(graph, generate):
    presets = graph.frontend.presets
    cloned = clip(180.0, 1.2, 5)
    cases = [  # (request body, turns, speaker -> clip, seed)
        ({"input": TEXTS[0], "voice": "alice", "seed": 1}, [("0", TEXTS[0])], {"0": presets["alice"][1]}, 1),
        ({"input": TEXTS[1], "voice": "x", "voice_reference": wav_b64(cloned), "seed": 2},
         [("0", TEXTS[1])], {"0": cloned}, 2),
        ({"input": f"Speaker 0: {TEXTS[2]}\nSpeaker 1: {TEXTS[0]}", "voice": "-", "seed": 3,
          "speaker_voices": {"0": "bob", "1": "Alice"}},
         [("0", TEXTS[2]), ("1", TEXTS[0])], {"0": presets["bob"][1], "1": presets["alice"][1]}, 3),
        ({"input": TEXTS[0], "voice": "bob", "seed": 4}, [("0", TEXTS[0])], {"0": presets["bob"][1]}, 4),
    ]
    # eight in flight: the four again with other seeds (each must still equal its own generate)
    cases += [({**body, "seed": seed + 10}, turns, voices, seed + 10) for body, turns, voices, seed in cases]

    async def together():
        return await asyncio.gather(*(speech(graph, {**body, "response_format": "pcm"}) for body, *_ in cases))

    alone = [asyncio.run(speech(graph, {**body, "response_format": "pcm"})) for body, *_ in cases]
    many = asyncio.run(together())
    refs = [generate(turns, voices, seed) for _, turns, voices, seed in cases]
    for i, (one, batched, ref) in enumerate(zip(alone, many, refs)):
        assert ref.size == TOKENS * 3200 and pcm(one).size == ref.size, i
        assert np.abs(pcm(one) - np.clip(ref, -1, 1)).max() <= TOL, i
        assert np.abs(pcm(batched) - pcm(one)).max() <= TOL, i
    # negative controls: another script, another voice (same seed) are far off
    other_text = generate([("0", TEXTS[1])], {"0": presets["alice"][1]}, 1)
    other_voice = generate([("0", TEXTS[0])], {"0": presets["bob"][1]}, 1)
    for swapped in (other_text, other_voice):
        assert np.abs(pcm(alone[0]) - np.clip(swapped, -1, 1)).max() > 100 * TOL


def test_the_sse_stream_carries_the_file_in_pieces(graph):
    body = {"input": TEXTS[2], "voice": "alice", "seed": 9, "response_format": "pcm"}
    whole = asyncio.run(speech(graph, body))
    lines = asyncio.run(speech(graph, {**body, "stream_format": "sse"}))
    events = [json.loads(line[len("data: "):]) for line in lines]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole
    assert events[-1]["usage"]["output_tokens"] == TOKENS


@pytest.mark.parametrize("body, param", [
    ({"model": "tts-1"}, "model"),
    ({"voice": "nobody"}, "voice"),
    ({"voice_reference": "not base64!"}, "voice_reference"),
    ({"voice_reference": wav_b64(clip(200.0, 31.0, 0))}, "voice_reference"),  # over max_voice_seconds
    ({"voice_reference": base64.b64encode(b"RIFF not a wav").decode()}, "voice_reference"),
    ({"voice_reference": wav_b64(np.zeros(SR, dtype=np.float32))}, "voice_reference"),  # silence
    ({"input": "Speaker 0: hi\nSpeaker 1: there"}, "speaker_voices"),
    ({"input": "Speaker 0: hi\nSpeaker 1: there", "speaker_voices": {"0": "alice"}}, "speaker_voices"),
    ({"input": "\n".join(f"Speaker {i}: hi" for i in range(5))}, "input"),
    ({"temperature": 0.5}, "temperature"),
])
def test_bad_input_is_a_400_naming_the_field(graph, body, param):
    from omni_serve.api.errors import OpenAIError

    body = {"input": "hello", "voice": "alice", **body}
    with pytest.raises(OpenAIError) as err:
        asyncio.run(speech(graph, body))
    assert err.value.status_code == 400 and err.value.param == param, str(err.value)


def test_a_registered_voice_speaks_as_its_clip_and_belongs_to_its_key(graph):
    from omni_serve.api.audio_protocol import VoiceCreateForm, VoicePage, VoiceRef
    from omni_serve.api.errors import OpenAIError
    from omni_serve.graph.frontend import RequestContext
    from starlette.datastructures import UploadFile

    f = graph.frontend
    mine, theirs = RequestContext(60, headers={"authorization": "Bearer a"}), RequestContext(
        60, headers={"authorization": "Bearer b"})
    voice = clip(240.0, 1.1, 7)
    buf = io.BytesIO()
    sf.write(buf, voice, SR, format="WAV", subtype="FLOAT")

    async def register(name, ctx):
        return await f.voices_create(VoiceCreateForm(name=name, file=UploadFile(io.BytesIO(buf.getvalue()))), ctx)

    made = asyncio.run(register("Narrator", mine))
    assert made.id == "narrator" and made.seconds == pytest.approx(1.1, abs=1e-3) and not made.preset
    listed = asyncio.run(f.voices_list(VoicePage(), mine)).data
    assert [(v.id, v.preset) for v in listed] == [("alice", True), ("bob", True), ("narrator", False)]
    assert [v.id for v in asyncio.run(f.voices_list(VoicePage(), theirs)).data] == ["alice", "bob"]
    body = {"input": TEXTS[1], "voice": "NARRATOR", "seed": 6, "response_format": "pcm"}
    by_name = asyncio.run(speech(graph, body, mine))
    by_clip = asyncio.run(speech(graph, {**body, "voice_reference": wav_b64(voice)}, mine))
    assert by_name == by_clip  # the registered clip is the uploaded one, sample for sample
    with pytest.raises(OpenAIError) as err:  # another key does not see it
        asyncio.run(speech(graph, body, theirs))
    assert err.value.param == "voice"
    for name, code in (("narrator", "voice_exists"), ("alice", None)):
        with pytest.raises(OpenAIError) as err:
            asyncio.run(register(name, mine))
        assert err.value.status_code == 400 and (code is None or err.value.code == code)
    with pytest.raises(OpenAIError) as err:
        asyncio.run(f.voices_delete(VoiceRef(name="narrator"), theirs))
    assert err.value.status_code == 404
    assert asyncio.run(f.voices_delete(VoiceRef(name="Narrator"), mine)).deleted
    assert [v.id for v in asyncio.run(f.voices_list(VoicePage(), mine)).data] == ["alice", "bob"]
