"""The realtime bench's reading of a turn (``omni_serve.bench.realtime._turn``) on scripted server events: a VAD split
is counted and the turn waits for the answer to the whole utterance, a barge-in is timed from ``speech_started``, a
response that ends before the interruption is heard is a missed barge-in, and a failed response is a failed turn."""

from __future__ import annotations

import asyncio
import base64

from omni_serve.bench.realtime import RealtimeBenchConfig, _summary, _turn

CFG = RealtimeBenchConfig(url="http://x", chunk_ms=20, timeout_s=5)
AUDIO = {"type": "response.output_audio.delta", "delta": base64.b64encode(bytes(4800)).decode()}  # 0.1 s


def done(status: str) -> dict:
    return {"type": "response.done", "response": {"status": status}}


class Scripted:
    """A session whose server sends ``events`` in order once the utterance is spoken (with ``speak_first``; else
    from the start), the ones after an ``"after <type>"`` entry once the bench sent that type; what the bench
    sends is recorded."""

    def __init__(self, events: list[dict], speak_first: bool = True):
        self.events, self.speak_first, self.sent = list(events), speak_first, []
        self.spoken = asyncio.Event()

    async def send(self, event: dict) -> None:
        self.sent.append(event["type"])

    async def recv(self) -> dict:
        if self.speak_first:
            await self.spoken.wait()
        await asyncio.sleep(0.001)
        if isinstance(self.events[0], str):  # "after <type>": the next events wait for the bench to send it
            while self.events[0].split()[1] not in self.sent:
                await asyncio.sleep(0.001)
            self.events.pop(0)
        return self.events.pop(0)

    async def speak(self, pcm: bytes, chunk_ms: int, ended: asyncio.Future) -> None:
        ended.set_result(asyncio.get_running_loop().time())
        self.spoken.set()
        await asyncio.Event().wait()  # silence until cancelled


def run(events: list[dict], interrupt: bool = False, speak_first: bool = True, cfg: RealtimeBenchConfig = CFG):
    async def main():
        return await _turn(Scripted(events, speak_first), b"\0\0" * 480, cfg, interrupt)
    return asyncio.run(main())


def test_an_answered_turn_records_its_audio_and_latencies():
    turn = run([{"type": "input_audio_buffer.speech_stopped"}, {"type": "response.created"}, AUDIO, AUDIO,
                done("completed")])
    assert turn.ok and turn.error is None and turn.splits == 0 and len(turn.audio_chunks) == 2
    assert turn.speech_end_to_audio_s is not None and turn.vad_stop_to_audio_s is not None


def test_a_split_utterance_is_counted_and_the_turn_is_the_answer_to_the_whole():
    turn = run([{"type": "input_audio_buffer.speech_stopped"}, {"type": "response.created"},
                {"type": "input_audio_buffer.speech_started"}, done("cancelled"),  # the rest of the utterance
                {"type": "input_audio_buffer.speech_stopped"}, {"type": "response.created"}, AUDIO, done("incomplete")])
    assert turn.ok and turn.splits == 1 and len(turn.audio_chunks) == 1


def test_a_barge_in_is_timed_and_a_response_that_ends_first_is_a_missed_one():
    turn = run([{"type": "response.created"}, AUDIO, {"type": "input_audio_buffer.speech_started"},
                done("cancelled")], interrupt=True)
    assert turn.ok and turn.barge_in_s is not None and turn.barge_in_s >= 0 and not turn.barge_in_missed
    missed = run([{"type": "response.created"}, AUDIO, done("completed")], interrupt=True)
    assert missed.ok and missed.barge_in_s is None and missed.barge_in_missed
    report = _summary("x", [turn, missed], 0.5, 1.0)
    assert report["barge_in_s"]["n"] == 1 and report["barge_in_missed"] == 1 and report["failed"] == 0


def test_a_failed_response_or_one_without_audio_fails_the_turn():
    assert run([{"type": "response.created"}, done("failed")]).error == "status failed, 0 chunks"
    turn = run([{"type": "response.created"}, done("completed")])
    assert not turn.ok and turn.error == "status completed, 0 chunks"
    assert _summary("x", [turn], 0.5, 1.0)["failed"] == 1


def test_an_answer_refused_at_the_capacity_is_asked_for_again_and_counted(monkeypatch):
    monkeypatch.setattr("omni_serve.bench.realtime.RETRY_AFTER_S", 0.01)
    refusal = {"type": "error", "error": {"type": "rate_limit_error", "code": "rate_limit_exceeded", "message": "x"}}
    session = Scripted([{"type": "response.created"}, refusal, done("failed"),
                        "after response.create", {"type": "response.created"}, AUDIO, done("completed")])

    async def main():
        return await _turn(session, b"\0\0" * 480, CFG, False)
    turn = asyncio.run(main())
    assert turn.ok and turn.refused == 1 and "response.create" in session.sent
    assert _summary("x", [turn], 0.5, 1.0)["refused"] == 1
    no_retry = run([{"type": "response.created"}, refusal, done("failed")], cfg=CFG.model_copy(update={"retry": False}))
    assert not no_retry.ok and no_retry.refused == 1 and no_retry.error == "status failed, 0 chunks"
