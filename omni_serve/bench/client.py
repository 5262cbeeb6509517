"""Async HTTP load generator for OpenAI-compatible streaming chat completions.

Contract:

* ``send_one(client, chat_url, request, model)`` posts one ``stream: true`` request and returns a
  ``RequestRecord``; it never raises for request failures. Timing (``time.perf_counter``): TTFT is the first
  non-empty ``delta.content`` or ``delta.audio.transcript``, TTFP the first non-empty ``delta.audio.data``, ITL
  the gaps between consecutive non-empty text deltas, E2E the end of the stream; each audio delta's arrival and
  length is kept (``audio_chunks``) for the report's playback figures. Audio seconds are decoded pcm16 bytes
  ``/ 2 / 24000`` (streamed audio is raw pcm16, 24 kHz mono). Output tokens, best source first:
  ``choices[].token_ids`` if the server streams them (``token_ids``), the final usage chunk's
  ``completion_tokens`` (``usage``), else the number of non-empty text deltas (``deltas``: approximate).
* Failures are records with ``ok=False``: a non-200 status (``status`` + the OpenAI error message), an
  ``{"error": ...}`` event inside the stream, a stream that ends without ``data: [DONE]``, a transport
  error or a timeout. A 429 is a *rejected* record (``RequestRecord.rejected``); ``until_admitted`` sends it
  again after its ``Retry-After`` as a client would, which ``run_load(retry_rejected=True)`` does for every
  request.
* ``run_load(...)`` runs one load point: closed loop (``request_rate=None``: keep ``concurrency`` requests
  in flight) or open loop (Poisson arrivals at ``request_rate``/s from ``arrival_seed``; ``concurrency``,
  if given, caps requests in flight). ``run_sweep`` runs several points one after another.
* Pass ``transport`` (e.g. ``httpx.MockTransport``) to run against a fake server.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, TypeVar

import httpx

from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.workload import BenchRequest

log = logging.getLogger(__name__)

R = TypeVar("R")  # a request's record: RequestRecord, or the speech bench's SpeechRecord
Q = TypeVar("Q")  # a request of a closed loop (an image or a video request)

PCM16_RATE = 24000  # streamed audio: little-endian int16, 24 kHz, mono


def chat_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> the chat-completions endpoint."""
    base = url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


def models_url(url: str) -> str:
    return chat_url(url)[: -len("/chat/completions")] + "/models"


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds from the run start) of ``n`` requests at ``rate``/s; the first at 0."""
    if rate <= 0:
        raise ValueError("request_rate must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


class StreamAccumulator:
    """Folds SSE ``data:`` payloads of one streamed completion into a ``RequestRecord``.

    ``feed(data, t)`` takes the payload text (after ``data:``) and its arrival time ``t`` (perf_counter
    seconds); ``finish(t_end)`` completes the record. Kept separate from the HTTP code so it is testable.
    """

    def __init__(self, record: RequestRecord, t_start: float):
        self.rec = record
        self.t0 = t_start
        self.done = False
        self.last_text_t: float | None = None
        self.usage_tokens: int | None = None
        self.token_ids: int | None = None
        self.audio_bytes = 0
        self.text = hashlib.sha1()

    def feed(self, data: str, t: float) -> None:
        data = data.strip()
        if not data:
            return
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self._fail(f"unparseable stream event: {data[:120]!r}")
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            err = event["error"]
            msg = err.get("message") if isinstance(err, dict) else str(err)
            code = err.get("code") if isinstance(err, dict) else None
            self._fail(f"stream error{f' ({code})' if code else ''}: {msg}")
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids = (self.token_ids or 0) + len(ids)
            if choice.get("finish_reason"):
                self.rec.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            audio = delta.get("audio")
            # OpenAI's shape: an audio reply's text comes as delta.audio.transcript pieces (content null)
            text = delta.get("content") or (audio.get("transcript") if isinstance(audio, dict) else None)
            if text:
                if self.last_text_t is None:
                    self.rec.ttft_s = t - self.t0
                else:
                    self.rec.itl_s.append(t - self.last_text_t)
                self.last_text_t = t
                self.rec.text_deltas += 1
                self.rec.text_chars += len(text)
                self.text.update(text.encode("utf-8"))
            if isinstance(audio, dict) and audio.get("data"):
                try:
                    n = len(base64.b64decode(audio["data"]))
                except (ValueError, TypeError):
                    self._fail("undecodable base64 audio in the stream")
                    continue
                if n and self.rec.ttfp_s is None:
                    self.rec.ttfp_s = t - self.t0
                if n:
                    self.rec.audio_chunks.append([t - self.t0, n / 2 / PCM16_RATE])
                self.audio_bytes += n

    def _fail(self, message: str) -> None:
        if self.rec.error is None:
            self.rec.error = message

    def finish(self, t_end: float) -> RequestRecord:
        rec = self.rec
        rec.e2e_s = t_end - self.t0
        rec.audio_seconds = self.audio_bytes / 2 / PCM16_RATE
        rec.text_sha1 = self.text.hexdigest()
        if self.token_ids is not None:
            rec.output_tokens, rec.token_source = self.token_ids, "token_ids"
        elif self.usage_tokens is not None:
            rec.output_tokens, rec.token_source = self.usage_tokens, "usage"
        else:
            rec.output_tokens, rec.token_source = rec.text_deltas, "deltas"
        if rec.error is None and not self.done:
            rec.error = "stream ended without data: [DONE]"
        rec.ok = rec.error is None
        return rec


def _error_message(status: int, body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {status}: {err['message']}"
    except (json.JSONDecodeError, AttributeError):
        pass
    return f"HTTP {status}: {text[:300]}"


async def send_one(client: httpx.AsyncClient, url: str, req: BenchRequest, model: str, *, t_run: float | None = None,
                   include_usage: bool = True, return_token_ids: bool = False) -> RequestRecord:
    """Send one streamed request to ``url`` (the chat-completions endpoint) and time it."""
    rec = RequestRecord(index=req.index)
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run if t_run is not None else 0.0
    acc = StreamAccumulator(rec, t0)
    body = req.body(model, stream=True, include_usage=include_usage, return_token_ids=return_token_ids)
    try:
        async with client.stream("POST", url, json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = _error_message(resp.status_code, await resp.aread())
                rec.e2e_s = time.perf_counter() - t0
                if resp.status_code == 429:
                    rec.retry_after_s = retry_after(resp.headers.get("retry-after"))
                return rec
            await read_sse(resp, acc.feed)
    except httpx.TimeoutException as exc:
        rec.error = f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        rec.error = f"transport error: {type(exc).__name__}: {exc}"[:300]
    return acc.finish(time.perf_counter())


def retry_after(header: str | None) -> float:
    """A 429's ``Retry-After`` in seconds (1 s when absent or unreadable; at most 60)."""
    try:
        return min(max(float(header), 0.0), 60.0) if header else 1.0
    except ValueError:
        return 1.0


async def until_admitted(send: Callable[[], Awaitable[R]], timeout_s: float, retry: bool = True) -> R:
    """``send()`` (a record with ``rejected``, ``retry_after_s``, ``e2e_s``, ``rejections``, ``waited_s``), and
    with ``retry`` again after each 429's ``Retry-After`` (as a client would) until admitted or ``timeout_s`` has
    passed since the first try. The record returned counts the 429s (``rejections``) and the time before its
    last try (``waited_s``). The chat bench's and the speech bench's one retry loop."""
    t0, rejections = time.perf_counter(), 0
    while True:
        rec = await send()
        spent = time.perf_counter() - t0
        if not (retry and rec.rejected) or spent + rec.retry_after_s > timeout_s:
            rec.rejections, rec.waited_s = rejections + rec.rejected, max(spent - (rec.e2e_s or 0.0), 0.0)
            return rec
        rejections += 1
        await asyncio.sleep(rec.retry_after_s)


async def discover_model(url: str, transport: httpx.AsyncBaseTransport | None = None) -> str | None:
    """The first model id listed at ``/v1/models``; None when it cannot be read."""
    try:
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            resp = await client.get(models_url(url))
            data = resp.json().get("data") or []
            return data[0]["id"] if resp.status_code == 200 and data else None
    except Exception:  # noqa: BLE001 - discovery is best effort
        return None


@dataclass
class LoadPoint:
    concurrency: int | None = 1  # closed loop: in flight; open loop: optional cap
    request_rate: float | None = None  # None: closed loop

    def label(self, system: str = "engine") -> str:
        if self.request_rate is None:
            return f"{system} c={self.concurrency}"
        cap = f" cap={self.concurrency}" if self.concurrency else ""
        return f"{system} rate={self.request_rate:g}/s{cap}"


def progress_logger(label: str, total: int, every: int) -> Callable[[RequestRecord], None]:
    """A callback that logs every ``every`` finished requests (and at the end)."""
    state = {"done": 0, "errors": 0, "rejected": 0, "t0": time.perf_counter()}

    def on_done(rec: RequestRecord) -> None:
        state["done"] += 1
        state["errors"] += not rec.ok and not rec.rejected
        state["rejected"] += rec.rejections
        n = state["done"]
        if every > 0 and (n % every == 0 or n == total):
            log.info("%s: %d/%d requests done, %d errors, %d 429s, %.1fs elapsed", label, n, total,
                     state["errors"], state["rejected"], time.perf_counter() - state["t0"])
    return on_done


async def closed_loop(items: list[Q], concurrency: int, send: Callable[[httpx.AsyncClient, Q, float], Awaitable[R]],
                      on_done: Callable[[R], None], *, timeout_s: float,
                      transport: httpx.AsyncBaseTransport | None = None) -> tuple[list[R | None], float]:
    """A closed loop over ``items``: ``concurrency`` workers on one client, each sending its next item once its last
    one answered (``await send(client, item, t_run)``, ``t_run`` the run's start on ``time.perf_counter``).

    Returns:
        Each item's record (None for an item never sent) and the run's wall seconds.
    """
    records: list[R | None] = [None] * len(items)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(transport=transport, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=min(30.0, timeout_s))) as client:
        pending = iter(enumerate(items))
        t_run = time.perf_counter()

        async def worker() -> None:
            for slot, item in pending:
                records[slot] = await send(client, item, t_run)
                on_done(records[slot])
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
        wall = time.perf_counter() - t_run
    return records, wall


async def run_load(url: str, requests: list[BenchRequest], model: str, point: LoadPoint, *,
                   arrival_seed: int = 0, timeout_s: float = 600.0, include_usage: bool = True,
                   return_token_ids: bool = False, transport: httpx.AsyncBaseTransport | None = None,
                   progress_every: int = 10, label: str | None = None, retry_rejected: bool = False) -> RunResult:
    """Run ``requests`` against ``url`` at one load point; every request yields exactly one record. With
    ``retry_rejected`` a 429 is sent again after its ``Retry-After`` (``until_admitted``)."""
    endpoint = chat_url(url)
    label = label or point.label()
    on_done = progress_logger(label, len(requests), progress_every)
    cap = point.concurrency if point.concurrency else len(requests)
    limits = httpx.Limits(max_connections=max(cap, 1) + 4, max_keepalive_connections=max(cap, 1) + 4)
    timeout = httpx.Timeout(timeout_s, connect=min(30.0, timeout_s))
    records: list[RequestRecord | None] = [None] * len(requests)

    async with httpx.AsyncClient(transport=transport, limits=limits, timeout=timeout) as client:
        t_run = time.perf_counter()

        async def one(req: BenchRequest, slot: int) -> None:
            rec = await until_admitted(
                lambda: send_one(client, endpoint, req, model, t_run=t_run, include_usage=include_usage,
                                 return_token_ids=return_token_ids), timeout_s, retry_rejected)
            records[slot] = rec
            on_done(rec)

        if point.request_rate is None:
            pending = iter(enumerate(requests))

            async def worker():
                for slot, req in pending:
                    await one(req, slot)
            await asyncio.gather(*(worker() for _ in range(min(cap, len(requests)))))
        else:
            arrivals = poisson_arrivals(len(requests), point.request_rate, arrival_seed)
            sem = asyncio.Semaphore(cap)

            async def fire(slot: int, req: BenchRequest, at: float):
                await asyncio.sleep(max(0.0, t_run + at - time.perf_counter()))
                async with sem:
                    await one(req, slot)
            await asyncio.gather(*(fire(i, r, a) for i, (r, a) in enumerate(zip(requests, arrivals))))
        wall = time.perf_counter() - t_run

    final = [r if r is not None else RequestRecord(index=req.index, error="request was never completed")
             for r, req in zip(records, requests)]
    run = RunResult(label=label, system="engine", mode="omni", concurrency=point.concurrency,
                    request_rate=point.request_rate, wall_s=wall, streaming=True, records=final)
    retried = sum(r.rejections for r in final if not r.rejected)
    if retried:
        run.notes.append(f"{retried} 429s were sent again after their Retry-After: latencies count from each "
                         "request's admitted try (waited_s: the wait before it)")
    sources = sorted({r.token_source for r in final if r.ok and r.token_source})
    if "deltas" in sources:
        run.notes.append("output tokens counted from text deltas (approximate): the server sent no usage "
                         "chunk or token ids")
    return run


def run_sweep(url: str, requests: list[BenchRequest], model: str, points: Iterable[LoadPoint],
              **kwargs: Any) -> list[RunResult]:
    """``run_load`` for each point in turn (synchronous; one event loop per point)."""
    return [asyncio.run(run_load(url, requests, model, p, **kwargs)) for p in points]


async def warmup(url: str, requests: list[BenchRequest], model: str, n: int = 1,
                 transport: httpx.AsyncBaseTransport | None = None, timeout_s: float = 600.0) -> list[RequestRecord]:
    """Send ``n`` requests one at a time, unmeasured (first-request costs stay out of the runs)."""
    out = []
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout_s, connect=30)) as client:
        for req in requests[:n]:
            out.append(await send_one(client, chat_url(url), req, model))
    return out


async def read_sse(resp, feed) -> None:
    """Each server-sent event of a streamed ``httpx`` response, as it arrives: ``feed(data, t)`` with the event's data
    lines joined and ``time.perf_counter()`` when its last line came."""
    data_lines: list[str] = []
    async for line in resp.aiter_lines():
        t = time.perf_counter()
        if line.startswith("data:"):
            data_lines.append(line[5:].lstrip(" "))
        elif not line.strip() and data_lines:  # a blank line ends an event
            feed("\n".join(data_lines), t)
            data_lines = []
    if data_lines:
        feed("\n".join(data_lines), time.perf_counter())
