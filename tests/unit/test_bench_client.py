"""omni_serve.bench.client against a fake server (httpx.MockTransport): SSE parsing, TTFT/TTFP/ITL extraction,
token counting and error accounting. No Ray, no sockets, no timing assertions beyond event order."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from omni_serve.api import protocol as P
from omni_serve.api.sse import SSE_DONE, sse_event
from omni_serve.bench.client import (
    LoadPoint, StreamAccumulator, chat_url, discover_model, models_url, run_load, warmup,
)
from omni_serve.bench.records import RequestRecord
from omni_serve.bench.report import summarize
from omni_serve.bench.workload import WorkloadConfig, build_workload

PCM = b"\x01\x00" * 2400  # 0.1 s of pcm16 at 24 kHz


def _chunk(delta: P.ChatCompletionDelta | None = None, finish=None, usage=None, choices=True) -> str:
    return sse_event(P.ChatCompletionChunk(
        id="chatcmpl-x", model="qwen2.5-omni",
        choices=[P.ChatCompletionChunkChoice(delta=delta or P.ChatCompletionDelta(), finish_reason=finish)]
        if choices else [], usage=usage))


def server_events(texts=("Hel", "lo", " world"), audio=True, usage=True, done=True) -> list[str]:
    """The event sequence omni_serve's frontend streams for one request."""
    events = [_chunk(P.ChatCompletionDelta(role="assistant", content=None if audio else ""))]
    # OpenAI's shape: with audio the text comes as delta.audio.transcript pieces, else as delta.content
    events += [_chunk(P.ChatCompletionDelta(audio=P.DeltaAudio(id="audio_x", transcript=t)) if audio
                      else P.ChatCompletionDelta(content=t)) for t in texts]
    if audio:
        events.append(_chunk(P.ChatCompletionDelta(audio=P.DeltaAudio(id="audio_x",
                                                                      data=base64.b64encode(PCM).decode()))))
    events.append(_chunk(finish="stop"))
    if usage:
        events.append(_chunk(choices=False, usage=P.UsageInfo(prompt_tokens=7, completion_tokens=4, total_tokens=11)))
    if done:
        events.append(SSE_DONE)
    return events


def _stream(events: list[str], delay: float = 0.0):
    async def gen():
        for e in events:
            if delay:
                await asyncio.sleep(delay)
            yield e.encode()
    return gen()


def _sse_response(events, delay=0.0) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_stream(events, delay))


def _run(handler, requests, point=None, **kw):
    return asyncio.run(run_load("http://fake:8000", requests, "qwen2.5-omni", point or LoadPoint(concurrency=2),
                                transport=httpx.MockTransport(handler), progress_every=0, **kw))


def test_urls():
    assert chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert models_url("http://h:1") == "http://h:1/v1/models"


def test_accumulator_extracts_ttft_ttfp_itl_and_usage():
    rec = RequestRecord(index=0)
    acc = StreamAccumulator(rec, t_start=10.0)
    events = server_events()
    times = [10.1, 10.2, 10.5, 10.6, 11.0, 11.1, 11.2, 11.3]  # role, 3 texts, audio, finish, usage, done
    for event, t in zip(events, times):
        assert event.startswith("data: ")
        acc.feed(event[len("data: "):], t)
    acc.finish(11.4)
    assert rec.ok and rec.error is None
    assert rec.ttft_s == pytest.approx(0.2)  # the empty role chunk does not count
    assert rec.itl_s == pytest.approx([0.3, 0.1])
    assert rec.ttfp_s == pytest.approx(1.0)
    assert rec.e2e_s == pytest.approx(1.4)
    assert rec.audio_seconds == pytest.approx(0.1)
    assert rec.output_tokens == 4 and rec.token_source == "usage"
    assert rec.text_deltas == 3 and rec.text_chars == len("Hello world")
    assert rec.finish_reason == "stop"


def test_accumulator_prefers_streamed_token_ids_then_falls_back_to_deltas():
    rec = RequestRecord(index=0)
    acc = StreamAccumulator(rec, 0.0)
    acc.feed(json.dumps({"choices": [{"delta": {"content": "a"}, "token_ids": [1, 2]}]}), 1.0)
    acc.feed(json.dumps({"choices": [{"delta": {"content": "b"}, "token_ids": [3]}]}), 2.0)
    acc.feed(json.dumps({"choices": [], "usage": {"completion_tokens": 99}}), 2.5)
    acc.feed("[DONE]", 3.0)
    acc.finish(3.0)
    assert rec.output_tokens == 3 and rec.token_source == "token_ids"

    rec2 = RequestRecord(index=1)
    acc2 = StreamAccumulator(rec2, 0.0)
    for i, e in enumerate(server_events(usage=False)):
        acc2.feed(e[6:], float(i))
    acc2.finish(9.0)
    assert rec2.ok and rec2.output_tokens == 3 and rec2.token_source == "deltas"


def test_streaming_run_against_fake_server():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        body = json.loads(request.content)
        seen.append(body)
        return _sse_response(server_events(), delay=0.002)

    reqs = build_workload(WorkloadConfig(num_requests=5, max_tokens=8, audio=True))
    run = _run(handler, reqs)
    assert len(seen) == 5
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in seen)
    assert all(b["modalities"] == ["text", "audio"] and b["audio"]["format"] == "pcm16" for b in seen)
    assert sorted(b["seed"] for b in seen) == sorted(r.seed for r in reqs)
    assert run.system == "engine" and run.concurrency == 2 and run.streaming
    assert [r.index for r in run.records] == list(range(5))
    assert run.num_errors == 0 and run.wall_s > 0
    for rec in run.records:
        assert rec.ok and rec.status == 200
        assert rec.ttft_s is not None and rec.ttfp_s is not None
        assert 0 < rec.ttft_s <= rec.ttfp_s <= rec.e2e_s
        assert len(rec.itl_s) == 2
        assert rec.audio_seconds == pytest.approx(0.1)
        assert rec.output_tokens == 4 and rec.token_source == "usage"
    assert not run.notes  # exact counts: nothing to flag


def test_errors_are_counted_never_dropped():
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        i = json.loads(request.content)["messages"][0]["content"]
        calls["n"] += 1
        kind = kinds[i]
        if kind == "400":
            return httpx.Response(400, json={"error": {
                "message": "Unknown voice 'Bob'", "type": "invalid_request_error", "param": "audio.voice",
                "code": "invalid_value"}})
        if kind == "500-text":
            return httpx.Response(500, text="upstream exploded")
        if kind == "midstream":
            events = server_events()[:2] + [sse_event({"error": {"message": "Stage talker failed: oops",
                                                                  "type": "internal_error", "code": "internal_error"}}),
                                            SSE_DONE]
            return _sse_response(events)
        if kind == "truncated":
            return _sse_response(server_events(done=False))
        if kind == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        return _sse_response(server_events())

    reqs = build_workload(WorkloadConfig(num_requests=6, audio=True))
    kinds = dict(zip((r.prompt for r in reqs), ["ok", "400", "500-text", "midstream", "truncated", "connect"]))
    run = _run(handler, reqs, point=LoadPoint(concurrency=3))
    assert calls["n"] == 6
    assert len(run.records) == 6 and run.num_errors == 5
    by_index = {r.index: r for r in run.records}
    assert by_index[0].ok
    assert by_index[1].status == 400 and by_index[1].error == "HTTP 400: Unknown voice 'Bob'"
    assert by_index[2].status == 500 and by_index[2].error == "HTTP 500: upstream exploded"
    assert by_index[3].status == 200 and "Stage talker failed: oops" in by_index[3].error
    assert by_index[3].ttft_s is not None  # partial output before the failure is still timed
    assert by_index[4].error == "stream ended without data: [DONE]"
    assert by_index[5].status is None and by_index[5].error.startswith("transport error: ConnectError")
    assert all(not r.ok for i, r in by_index.items() if i)


def test_a_429_is_sent_again_after_its_retry_after_and_counted_apart_from_failures():
    tries: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["messages"][-1]["content"]
        tries[prompt] = tries.get(prompt, 0) + 1
        if tries[prompt] <= 2:  # at capacity twice, then admitted
            return httpx.Response(429, headers={"retry-after": "0.01"}, json={"error": {
                "message": "at capacity", "type": "rate_limit_error", "code": "rate_limit_exceeded"}})
        return _sse_response(server_events())

    reqs = build_workload(WorkloadConfig(num_requests=3, audio=True))
    run = _run(handler, reqs, retry_rejected=True)
    assert all(r.ok and r.rejections == 2 and r.waited_s >= 0 and r.ttfp_s is not None for r in run.records)
    assert run.num_errors == 0 and run.num_rejected == 0
    summary = summarize(run)
    assert summary["rejections"] == 6 and summary["num_rejected"] == 0 and summary["waited_s"]["n"] == 3
    assert any("6 429s were sent again" in note for note in run.notes), run.notes

    tries.clear()  # without retries: a rejected request, not a failure
    run = _run(handler, reqs)
    assert all(r.rejected and r.rejections == 1 and r.retry_after_s == 0.01 for r in run.records)
    assert run.num_errors == 0 and run.num_rejected == 3
    summary = summarize(run)
    assert summary["num_errors"] == 0 and summary["num_rejected"] == 3 and summary["rejections"] == 3
    assert summary["errors_by_message"] == {}

    tries.clear()  # a request still refused when its time is up ends rejected
    run = _run(lambda request: httpx.Response(429, headers={"retry-after": "0.05"}), reqs[:1], retry_rejected=True,
               timeout_s=0.12)
    [rec] = run.records
    assert rec.rejected and rec.rejections >= 2 and run.num_errors == 0


def test_approximate_token_counts_are_flagged():
    run = _run(lambda req: _sse_response(server_events(usage=False, audio=False)),
               build_workload(WorkloadConfig(num_requests=2, audio=False)))
    assert all(r.token_source == "deltas" and r.output_tokens == 3 for r in run.records)
    assert any("approximate" in n for n in run.notes)


def test_open_loop_run_completes_every_request():
    run = _run(lambda req: _sse_response(server_events()), build_workload(WorkloadConfig(num_requests=8)),
               point=LoadPoint(concurrency=None, request_rate=500.0), arrival_seed=3)
    assert run.request_rate == 500.0 and run.concurrency is None
    assert len(run.records) == 8 and run.num_errors == 0
    assert run.label == "engine rate=500/s"
    starts = [r.start_s for r in run.records]
    assert all(s >= 0 for s in starts)


def test_closed_loop_keeps_at_most_c_in_flight():
    state = {"now": 0, "max": 0}

    async def gen():
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        try:
            for e in server_events():
                await asyncio.sleep(0.001)
                yield e.encode()
        finally:
            state["now"] -= 1

    run = _run(lambda req: httpx.Response(200, content=gen()), build_workload(WorkloadConfig(num_requests=9)),
               point=LoadPoint(concurrency=3))
    assert run.num_errors == 0 and len(run.records) == 9
    assert state["max"] == 3


def test_discover_model_and_warmup():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "my-omni", "object": "model"}]})
        return _sse_response(server_events())

    transport = httpx.MockTransport(handler)
    assert asyncio.run(discover_model("http://fake", transport=transport)) == "my-omni"
    down = httpx.MockTransport(lambda r: (_ for _ in ()).throw(httpx.ConnectError("down", request=r)))
    assert asyncio.run(discover_model("http://fake", transport=down)) is None
    reqs = build_workload(WorkloadConfig(num_requests=3))
    recs = asyncio.run(warmup("http://fake", reqs, "m", 2, transport=transport))
    assert len(recs) == 2 and all(r.ok for r in recs)
