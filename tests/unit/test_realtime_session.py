"""A realtime session on the Qwen2.5-Omni graph in one process (``LocalGraph``: the real frontend, runners and engines,
no Ray), driven through an in-memory WebSocket: the GA events in order and each one as the official client parses it,
a response equal to the chat reply to the same history, spoken turns cut by Silero VAD, barge-in, cancel, tools,
and bad client events answered with error events on a connection that stays open."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from omni_serve.api import protocol as P
from omni_serve.families.qwen2_5_omni import FAMILY
from omni_serve.graph.frontend import RequestContext
from omni_serve.graph.local import LocalGraph
from omni_serve.bench.realtime import speechlike

SEED = 7


class FakeWebSocket:
    """The server side of a WebSocket, in memory: the test sends client events, reads server events. Like a socket,
    it pushes back: the server's sends wait while 16 events are unread, so a response cannot run ahead of its
    reader."""

    def __init__(self, query: dict | None = None):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.events: asyncio.Queue = asyncio.Queue(maxsize=16)
        self.query_params = query or {}
        self.closed = None

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send_json(self, event: dict) -> None:
        json.dumps(event)  # what goes on the wire must be JSON
        await self.events.put(event)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = (code, reason)

    def send(self, event: dict | str) -> None:
        self.inbox.put_nowait({"type": "websocket.receive",
                               "text": event if isinstance(event, str) else json.dumps(event)})

    async def until(self, kind: str, timeout: float = 120) -> list[dict]:
        """Every event up to and including the next one of type ``kind``."""
        out = []
        while True:
            event = await asyncio.wait_for(self.events.get(), timeout)
            out.append(event)
            if event["type"] == kind:
                return out


@pytest.fixture(scope="module")
def graph(omni_tiny_dir):
    g = LocalGraph(FAMILY, {"checkpoint": omni_tiny_dir, "stages.talker.params.max_codec_tokens": 24,
                            "stages.code2wav.params.num_steps": 2, "stages.thinker.params.default_max_tokens": 12})
    yield g
    asyncio.run(g.aclose())


def _conforms(events: list[dict]) -> None:
    """Each event parses as the official client's ``RealtimeServerEvent`` (its GA union)."""
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(RealtimeServerEvent)
    for event in events:
        parsed = adapter.validate_python(event)
        assert parsed.type == event["type"]


async def _session(graph, ws: FakeWebSocket, record=None):
    task = asyncio.create_task(graph.frontend.realtime_session(ws, RequestContext(60, record=record)))
    created = await ws.until("session.created")
    return task, created[-1]


async def _close(ws: FakeWebSocket, task) -> None:
    ws.inbox.put_nowait({"type": "websocket.disconnect"})
    await asyncio.wait_for(task, 30)


def _chat_reply(graph, messages: list, **kw) -> P.ChatCompletionResponse:
    req = P.ChatCompletionRequest.model_validate({"model": graph.spec.model_name, "messages": messages, **kw})

    async def run():
        return await graph.frontend.complete(await graph.frontend.prepare(req))
    return run()


def test_a_text_turn_walks_the_ga_events_and_equals_the_chat_reply(graph):
    """A user text item, then response.create: the events in GA order (each parsed by the official client) and a
    transcript and audio equal to the chat reply (pcm16) to the same history with the same seed; the reply joins the
    conversation, so a second turn's prompt holds it."""
    async def main():
        ws = FakeWebSocket({"model": graph.spec.model_name})
        task, created = await _session(graph, ws)
        assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        ws.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}},
                                                       "temperature": 0, "seed": SEED}})
        updated = await ws.until("session.updated")
        assert updated[-1]["session"]["audio"]["input"]["turn_detection"] is None
        ws.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}})
        added = await ws.until("conversation.item.done")
        ws.send({"type": "response.create"})
        events = await ws.until("response.done")
        _conforms(created and [created] + updated + added + events)
        kinds = [e["type"] for e in events]
        first = ["response.created", "response.output_item.added", "conversation.item.added",
                 "response.content_part.added"]
        assert kinds[:4] == first, kinds[:6]
        last = ["response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
                "response.output_item.done", "conversation.item.done", "response.done"]
        assert kinds[-6:] == last, kinds[-8:]
        assert set(kinds[4:-6]) == {"response.output_audio.delta", "response.output_audio_transcript.delta"}
        transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
        audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
        done = events[-1]["response"]
        assert done["usage"]["output_tokens"] > 0
        # the graph's default_max_tokens (12) ends the greedy reply: incomplete, as OpenAI reports max_output_tokens
        assert (done["status"], done["status_details"].get("reason")) == (
            ("incomplete", "max_output_tokens") if done["usage"]["output_tokens"] == 12 else ("completed", None))
        reply = await _chat_reply(graph, [{"role": "user", "content": "Say hello."}], temperature=0, seed=SEED,
                                  modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"})
        assert transcript == reply.choices[0].message.audio.transcript and transcript
        assert audio == base64.b64decode(reply.choices[0].message.audio.data)
        assert done["usage"]["input_tokens"] == reply.usage.prompt_tokens
        # a second turn: the prompt holds the first reply as the assistant's turn
        ws.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again."}]}})
        await ws.until("conversation.item.done")
        ws.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        second = await ws.until("response.done")
        text = "".join(e["delta"] for e in second if e["type"] == "response.output_text.delta")
        reply2 = await _chat_reply(graph, [{"role": "user", "content": "Say hello."},
                                           {"role": "assistant", "content": transcript},
                                           {"role": "user", "content": "Again."}], temperature=0, seed=SEED)
        assert text == reply2.choices[0].message.content
        assert second[-1]["response"]["usage"]["input_tokens"] == reply2.usage.prompt_tokens
        await _close(ws, task)
    asyncio.run(main())


def test_server_vad_commits_a_spoken_turn_and_answers_it(graph):
    """Speech-like audio streamed in 100 ms appends, then silence: VAD's speech_started / speech_stopped, the buffer
    committed as a user audio item (from prefix_padding_ms before the start), and a response to it that equals the
    chat reply to that audio."""
    async def main():
        ws = FakeWebSocket()
        task, _ = await _session(graph, ws)
        ws.send({"type": "session.update", "session": {"temperature": 0, "seed": SEED,
                                                       "audio": {"input": {"turn_detection": {
                                                           "type": "server_vad", "silence_duration_ms": 300}}}}})
        await ws.until("session.updated")
        pcm = bytes(24000) + speechlike(1.5) + bytes(48000)  # 0.5 s of silence, 1.5 s of speech, 1 s of silence
        for i in range(0, len(pcm), 4800):
            ws.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + 4800]).decode()})
        events = await ws.until("response.done")
        _conforms(events)
        kinds = [e["type"] for e in events]
        assert kinds[:5] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
        started, stopped = events[0], events[1]
        assert 300 <= started["audio_start_ms"] <= 700 and stopped["audio_end_ms"] > started["audio_start_ms"] + 800
        assert events[2]["item_id"] == started["item_id"] == stopped["item_id"]
        begin = max(0, started["audio_start_ms"] - 300)
        heard = pcm[begin * 48:stopped["audio_end_ms"] * 48]
        transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
        reply = await _chat_reply(graph, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(heard).decode(), "format": "pcm16"}}]}], temperature=0, seed=SEED,
            modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"})
        assert transcript == reply.choices[0].message.audio.transcript
        await _close(ws, task)
    asyncio.run(main())


def test_speech_during_a_response_cancels_it_and_cancel_frees_the_stages(graph, monkeypatch):
    """Barge-in: speech while a response runs ends it with status cancelled (reason turn_detected), its message item
    incomplete, and no stage holds the request; response.cancel does the same with client_cancelled. The client
    reads nothing while the speech is judged: the cancel must not wait for it to read (its socket pushes back)."""
    from omni_serve.kits.omni.realtime import RealtimeSession

    recorded, stops = [], []
    stop = RealtimeSession._stop

    def spied_stop(self, reason: str) -> None:  # the session's own _stop, noted
        stops.append(reason)
        stop(self, reason)
    monkeypatch.setattr(RealtimeSession, "_stop", spied_stop)

    async def main():
        ws = FakeWebSocket()
        task, _ = await _session(graph, ws, record=lambda clock, error: recorded.append((error, clock)))
        # a long reply (up to 3000 tokens: ~2300 events, the socket holds 16): still running when the speech comes
        ws.send({"type": "session.update", "session": {"max_output_tokens": 3000, "temperature": 0, "audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300, "create_response": False}}}}})
        await ws.until("session.updated")
        ws.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}})
        await ws.until("conversation.item.done")
        ws.send({"type": "response.create"})
        events = await ws.until("response.output_audio_transcript.delta")  # the reply runs in the stages
        # then the speech, and the client stops reading until VAD has judged it: the reply waits on the socket
        # however long VAD takes (Silero shares this process's cores and GIL with every stage here)
        ws.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(speechlike(0.6)).decode()})

        async def judged():
            while not stops:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(judged(), 120)
        assert stops == ["turn_detected"]
        events += await ws.until("response.done")
        assert "input_audio_buffer.speech_started" in [e["type"] for e in events], [e["type"] for e in events][-8:]
        done = events[-1]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected", \
            (done["status"], done.get("status_details"), done.get("usage"))
        assert all(item["status"] == "incomplete" for item in done["output"])
        _conforms(events)
        assert await _idle(graph)
        ws.send({"type": "response.create"})
        await ws.until("response.created")
        ws.send({"type": "response.cancel"})
        done = (await ws.until("response.done"))[-1]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
        assert await _idle(graph)
        await _close(ws, task)
    asyncio.run(main())
    # the route's metrics counted both responses
    assert [e for e, _ in recorded] == ["cancelled", "cancelled"]


async def _idle(graph) -> bool:
    """Whether every stage holds no request."""
    for _ in range(300):
        health = await graph.frontend.health()
        if all(not v.get("active") for v in health.values()):
            return True
        await asyncio.sleep(0.1)
    return False


def test_a_forced_call_round_trips_as_function_call_items(graph):
    """A named tool_choice: a text-only response whose output is one function_call item (arguments.delta/done, the
    arguments following the schema); its function_call_output and a response.create answer with text."""
    tool = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}

    async def main():
        ws = FakeWebSocket()
        task, _ = await _session(graph, ws)
        ws.send({"type": "session.update", "session": {"tools": [tool], "temperature": 0,
                                                       "audio": {"input": {"turn_detection": None}}}})
        refused = await ws.until("error")  # tools with 'auto' would have the talker speak a call
        assert refused[-1]["error"]["param"] == "session.tools"
        ws.send({"type": "session.update", "session": {"tools": [tool], "temperature": 0, "output_modalities": ["text"],
                                                       "audio": {"input": {"turn_detection": None}}}})
        await ws.until("session.updated")
        ws.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]}})
        await ws.until("conversation.item.done")
        ws.send({"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "get_weather"},
                                                         "max_output_tokens": 160}})
        events = await ws.until("response.done")
        _conforms(events)
        done = events[-1]["response"]
        (call,) = done["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")
        kinds = [e["type"] for e in events]
        assert kinds.index("response.function_call_arguments.delta") < kinds.index(
            "response.function_call_arguments.done") < kinds.index("response.output_item.done")
        ws.send({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call["call_id"], "output": "{\"sky\": \"clear\"}"}})
        await ws.until("conversation.item.done")
        ws.send({"type": "response.create", "response": {"tool_choice": "none", "output_modalities": ["text"]}})
        answer = await ws.until("response.done")
        assert answer[-1]["response"]["status"] in ("completed", "incomplete")
        assert any(e["type"] == "response.output_text.delta" for e in answer)
        await _close(ws, task)
    asyncio.run(main())


@pytest.mark.parametrize(("event", "code", "param"), [
    ("{not json", "invalid_json", None),
    ({"type": "input_audio_buffer.dance"}, "invalid_event_type", "type"),
    ({"type": "input_audio_buffer.append", "audio": "@@@"}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),  # (an empty append before it)
    ({"type": "response.cancel"}, "response_cancel_not_active", None),
    ({"type": "response.create"}, "conversation_empty", None),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}}, "invalid_value",
     "session.audio.input.format.type"),
    ({"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}}, "invalid_value",
     "session.audio.output.voice"),
    ({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 1},
     "item_not_found", "item_id"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": [
        {"type": "input_audio", "audio": ""}]}}, "invalid_value", "item.content[0]"),
    ({"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "[1]"}}, "invalid_value", "item.arguments"),
    ({"type": "session.update", "session": {"audio": {"input": {"transcription": {"model": "whisper-1"}}}}},
     "invalid_value", "session.audio.input.transcription"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.1}}}}}, "invalid_value", "session.audio.input.turn_detection.threshold"),
])
def test_bad_client_events_get_an_error_event_and_the_session_goes_on(graph, event, code, param):
    async def main():
        ws = FakeWebSocket()
        task, _ = await _session(graph, ws)
        ws.send({"type": "input_audio_buffer.append", "audio": ""})  # empty audio: nothing to hear, no error
        ws.send({**event, "event_id": "evt_1"} if isinstance(event, dict) else event)
        (error,) = await ws.until("error")
        _conforms([error])
        assert error["error"]["code"] == code and error["error"].get("param") == param, error
        if isinstance(event, dict) and event["type"] != "input_audio_buffer.dance":
            assert error["error"]["event_id"] == "evt_1"
        ws.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        assert (await ws.until("session.updated"))[-1]["session"]["instructions"] == "Be brief."
        assert not task.done()
        await _close(ws, task)
    asyncio.run(main())


def test_an_unknown_model_is_an_error_and_the_connection_closes(graph):
    async def main():
        ws = FakeWebSocket({"model": "gpt-4o-realtime"})
        await asyncio.wait_for(graph.frontend.realtime_session(ws, RequestContext(60)), 10)
        (error,) = await ws.until("error")
        assert error["error"]["code"] == "model_not_found" and ws.closed[0] == 1008
    asyncio.run(main())


def _garbage(rng) -> object:
    return rng.choice([None, 0, -1, 2**70, 1.5, "", "x" * rng.randint(1, 300), [], {}, [1, "a"], {"type": "x"},
                       True, "\u0000\ud7ff", base64.b64encode(bytes(rng.randint(0, 9))).decode()])


def test_fuzzed_client_events_never_break_the_session(graph):
    """400 events of every client type with random and wrong field values (and random JSON): each is answered or
    refused with an error event, the session never ends, no response is left running, and no stage holds anything."""
    import random

    from omni_serve.api.realtime_protocol import CLIENT_EVENTS

    rng = random.Random(0)
    fields = ["session", "audio", "item", "item_id", "content_index", "audio_end_ms", "response", "response_id",
              "previous_item_id", "event_id"]

    async def main():
        ws = FakeWebSocket()
        task, _ = await _session(graph, ws)
        ws.send({"type": "session.update", "session": {"max_output_tokens": 4,
                                                       "audio": {"input": {"turn_detection": None}}}})
        await ws.until("session.updated")
        for _ in range(400):
            kind = rng.choice(sorted(CLIENT_EVENTS) + ["nope", 7])
            event = {"type": kind, **{f: _garbage(rng) for f in rng.sample(fields, rng.randint(0, 4))}}
            if rng.random() < 0.1:
                ws.send(json.dumps(event)[:rng.randint(0, 40)])  # cut JSON
            else:
                ws.send(event)
        ws.send({"type": "response.cancel"})  # whatever ran is over by now, or cancelled here
        ws.send({"type": "session.update", "session": {"instructions": "done"}})
        while True:
            event = await asyncio.wait_for(ws.events.get(), 120)
            _conforms([event])
            if event["type"] == "session.updated" and event["session"].get("instructions") == "done":
                break
        assert not task.done()
        assert await _idle(graph)
        await _close(ws, task)
    asyncio.run(main())


def test_a_cancel_right_after_create_still_ends_the_response_and_the_next_one_runs(graph):
    """response.create and response.cancel back to back (the task may not have run yet): response.created and
    response.done (cancelled) all the same, and the session takes the next response."""
    async def main():
        ws = FakeWebSocket()
        task, _ = await _session(graph, ws)
        ws.send({"type": "session.update", "session": {"output_modalities": ["text"], "max_output_tokens": 4,
                                                       "audio": {"input": {"turn_detection": None}}}})
        await ws.until("session.updated")
        ws.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}})
        await ws.until("conversation.item.done")
        ws.send({"type": "response.create", "response": {"metadata": {"client_event_id": "r1"}}})
        ws.send({"type": "response.cancel"})
        events = await ws.until("response.done")
        assert [e["type"] for e in events][0] == "response.created"
        assert events[-1]["response"]["status"] == "cancelled"
        ws.send({"type": "response.create", "response": {"metadata": {"client_event_id": "r2"}}})
        events = await ws.until("response.done")
        assert events[-1]["response"]["status"] in ("completed", "incomplete")
        assert events[0]["response"]["metadata"] == {"client_event_id": "r2"}  # echoed, as clients match on it
        await _close(ws, task)
    asyncio.run(main())


def test_audio_items_are_bounded_and_retrievable(graph):
    """A user audio item comes back whole with conversation.item.retrieve; past limits.max_media_parts audio items the
    oldest are deleted (conversation.item.deleted), so a session's memory stays bounded."""
    limit = graph.spec.limits.max_media_parts

    async def main():
        ws = FakeWebSocket()
        task, _ = await _session(graph, ws)
        ws.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await ws.until("session.updated")
        clip = base64.b64encode(speechlike(0.2)).decode()
        ids = []
        for k in range(limit + 2):
            ws.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "id": f"a{k}", "content": [{"type": "input_audio", "audio": clip}]}})
            ids.append(f"a{k}")
            await ws.until("conversation.item.done")
            if k >= limit:
                deleted = await ws.until("conversation.item.deleted")
                assert deleted[-1]["item_id"] == ids[k - limit]
        ws.send({"type": "conversation.item.retrieve", "item_id": ids[-1]})
        (retrieved,) = await ws.until("conversation.item.retrieved")
        _conforms([retrieved])
        assert retrieved["item"]["content"][0]["audio"] == clip
        await _close(ws, task)
    asyncio.run(main())


def test_an_answer_refused_at_the_capacity_keeps_its_place_when_asked_for_again(graph):
    """Admission refuses a spoken answer (another stream holds the graph): an error event (rate_limit_exceeded), the
    response failed, the session open. Asked for again, the answer enters the line as of when it was first asked
    for; once admitted, the session's next answer is a new ask."""
    from omni_serve.realtime_admission import AdmissionSpec, RealtimeAdmission

    async def main():
        admission = RealtimeAdmission(AdmissionSpec(policy="reject"), buffer_s=0.5)
        asks = []
        enter = admission.enter

        async def spy(request_id, max_wait_s=None, since=None):
            asks.append(since)
            return await enter(request_id, max_wait_s, since)
        admission.enter = spy
        kept, graph.frontend.realtime = graph.frontend.realtime, admission
        try:
            held = await enter("another stream")
            first_ask = admission.clock()
            ws = FakeWebSocket()
            task, _ = await _session(graph, ws)
            ws.send({"type": "session.update", "session": {"max_output_tokens": 4,
                                                           "audio": {"input": {"turn_detection": None}}}})
            await ws.until("session.updated")
            ws.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}})
            await ws.until("conversation.item.done")
            ws.send({"type": "response.create"})
            events = await ws.until("response.done")
            errors = [e["error"] for e in events if e["type"] == "error"]
            assert events[-1]["response"]["status"] == "failed" and errors[0]["code"] == "rate_limit_exceeded"
            held.release()
            ws.send({"type": "response.create"})
            events = await ws.until("response.done")
            assert events[-1]["response"]["status"] in ("completed", "incomplete")
            ws.send({"type": "response.create"})
            assert (await ws.until("response.done"))[-1]["response"]["status"] in ("completed", "incomplete")
            assert asks[0] is None and asks[1] is not None and asks[1] >= first_ask and asks[2] is None
            assert admission.state()["admitted"] == 0
            await _close(ws, task)
        finally:
            graph.frontend.realtime = kept
    asyncio.run(main())
