"""``omni-serve bench --mode realtime``: spoken turns over ``/v1/realtime`` (WebSocket), against the same turns through
``POST /v1/chat/completions`` one at a time.

Contract: ``run_realtime_bench(cfg)`` runs, at every ``concurrency`` C, C sessions at once, each doing ``turns``
spoken turns: it streams an utterance (``--utterance`` WAV, else a fixed speech-like clip that Silero VAD hears as
speech, ``tests``-free: ``omni_serve.bench.realtime.speechlike``) at real time in ``chunk_ms`` appends, then silence
until the response is done (server VAD commits the turn and answers it). Per turn it records: end of speech to the
first response audio (the wall time between the last speech append and the first ``response.output_audio.delta``,
which includes VAD's ``silence_duration_ms``) and VAD stop to first audio (from ``speech_stopped``), the audio's
arrivals (played back with a ``client_buffer_s`` client: stalls and gaps, ``omni_serve.bench.heard``) and, with
``barge_in``, an interruption: after the first audio of the turn the session speaks again, and the time from
``input_audio_buffer.speech_started`` to ``response.done`` (cancelled) is the barge-in latency (a response that ends
before VAD hears the interruption is a missed barge-in, counted). A pause inside the utterance that VAD takes for its
end starts a response that the utterance's rest cancels before any audio: a VAD split, counted; the turn is the
response to the whole utterance. An answer refused at the real-time capacity (``rate_limit_exceeded``, under the
graph's ``playback.admission``) is asked for again a second later with ``response.create``, as a client would
(``retry``), and counted; the turn's latency counts from the end of speech, the waits included. The reference: each
utterance as a streamed chat request (``input_audio`` pcm16, text + pcm16 audio out, the same seed and greedy),
one at a time, timed from sending to the first audio chunk (upload included). Writes
``realtime_bench_report.json`` to ``out`` and returns the report (``format_report`` prints it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omni_serve.bench.heard import heard
from omni_serve.bench.machine import machine_info, machine_section
from omni_serve.bench.stats import stats

log = logging.getLogger(__name__)
RATE = 24000
RETRY_AFTER_S = 1.0  # an answer refused at the capacity is asked for again this much later (``retry``)
VOWELS = ((730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410))


class RealtimeBenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the running server (http://...; the WebSocket is ws://.../v1/realtime).")
    model: str | None = Field(None, description="Model name; default: the first of /v1/models.")
    concurrency: list[int] = Field(default_factory=lambda: [1, 4], description="Sessions at once, one run each.")
    turns: int = Field(2, ge=1, description="Spoken turns per session.")
    utterance: str | None = Field(None, description="A WAV file spoken each turn (default: the speech-like clip).")
    utterance_s: float = Field(1.5, gt=0, description="Length of the speech-like clip.")
    chunk_ms: int = Field(100, ge=20, le=1000, description="Audio per input_audio_buffer.append, sent at real time.")
    silence_duration_ms: int = Field(500, ge=100, description="The sessions' server_vad silence_duration_ms "
                                     "(OpenAI's default; at 300 Silero splits the speech-like clip now and then).")
    max_output_tokens: int = Field(32, ge=1, description="Text tokens per response.")
    barge_in: bool = Field(True, description="Interrupt each session's last turn and time the cancel.")
    reference: bool = Field(True, description="Also run the turns as chat requests one at a time.")
    client_buffer_s: float = Field(0.5, ge=0, description="The listening client's buffer (stalls assume it).")
    retry: bool = Field(True, description=(
        "Ask again (response.create, 1 s later) for an answer refused at the real-time capacity "
        "(rate_limit_exceeded), as a client would; counted. Off: the turn fails."))
    seed: int = Field(0, description="Sampling seed of every response.")
    out: str = Field("bench_realtime", description="Report directory.")
    timeout_s: float = Field(300.0, gt=0, description="Per-turn timeout.")


@dataclass
class Turn:
    ok: bool = False
    speech_end_to_audio_s: float | None = None
    vad_stop_to_audio_s: float | None = None
    audio_chunks: list[list[float]] = field(default_factory=list)  # [arrival from the response's start, seconds]
    barge_in_s: float | None = None  # speech_started -> response.done (cancelled)
    barge_in_missed: bool = False  # the response ended before VAD heard the interruption
    splits: int = 0  # responses the VAD started within the utterance (a pause it took for the end), cut by its rest
    refused: int = 0  # answers refused at the real-time capacity (and asked for again with ``retry``)
    error: str | None = None


def speechlike(seconds: float, seed: int = 2, f0: float = 110.0) -> bytes:
    """pcm16 at 24 kHz: vowels from a glottal pulse train through three formant resonators at a syllable rate,
    which Silero VAD judges to be speech (no recording ships with the bench)."""
    from scipy.signal import lfilter

    rng = np.random.default_rng(seed)
    n, syllable = int(seconds * RATE), int(0.22 * RATE)
    out = np.zeros(n)
    for pos in range(0, n, syllable):
        m = min(syllable, n - pos)
        formants = VOWELS[rng.integers(len(VOWELS))]
        pitch = f0 * (1 + 0.1 * np.sin(np.linspace(0, np.pi, m))) * (1 + 0.02 * rng.standard_normal())
        pulses = (np.diff(np.floor(np.cumsum(pitch / RATE)), prepend=0) > 0).astype(float)
        source = lfilter([1], [1, -0.97], pulses) + 0.02 * rng.standard_normal(m)
        voiced = 0
        for k, f in enumerate(formants):
            r = np.exp(-np.pi * (80 + 40 * k) / RATE)
            voiced = voiced + lfilter([1 - r], [1, -2 * r * np.cos(2 * np.pi * f / RATE), r * r], source)
        out[pos:pos + m] = voiced * np.sin(np.linspace(0, np.pi, m)) ** 0.6
    return ((0.3 * out / np.abs(out).max()) * 32767).astype("<i2").tobytes()


def _utterance(cfg: RealtimeBenchConfig) -> bytes:
    if cfg.utterance is None:
        return speechlike(cfg.utterance_s)
    import soundfile as sf
    from scipy.signal import resample_poly

    samples, rate = sf.read(cfg.utterance, dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    if rate != RATE:
        mono = resample_poly(mono, RATE, rate)
    return (np.clip(mono, -1, 1) * 32767).astype("<i2").tobytes()


class _Session:
    def __init__(self, ws):
        self.ws = ws

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self) -> dict:
        return json.loads(await self.ws.recv())

    async def speak(self, pcm: bytes, chunk_ms: int, ended: asyncio.Future) -> None:
        """Append ``pcm`` at real time, set ``ended`` to the wall time of its last append, then append silence
        until cancelled (the line stays open, as a microphone's)."""
        step, t0 = chunk_ms * 48, time.perf_counter()
        k = 0
        for k, i in enumerate(range(0, len(pcm), step)):
            await self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
            await asyncio.sleep(max(0.0, t0 + (k + 1) * chunk_ms / 1000 - time.perf_counter()))
        ended.set_result(time.perf_counter())
        silence = base64.b64encode(bytes(step)).decode()
        while True:
            k += 1
            await self.send({"type": "input_audio_buffer.append", "audio": silence})
            await asyncio.sleep(max(0.0, t0 + (k + 1) * chunk_ms / 1000 - time.perf_counter()))


async def _turn(s: _Session, utterance: bytes, cfg: RealtimeBenchConfig, interrupt: bool) -> Turn:
    """One spoken turn, events read while it is spoken. Silero may take a pause inside the utterance for its end and
    start a response that the rest of the utterance then cancels (a barge-in before any audio): that is a split,
    counted, and the turn waits for the response to the whole utterance. An answer refused at the real-time capacity
    is asked for again ``RETRY_AFTER_S`` later (with ``retry``) and counted. With ``interrupt`` the session speaks
    again at the first audio; a response that ends before VAD hears it is a missed barge-in, not a failure."""
    turn = Turn()
    loop = asyncio.get_running_loop()
    ended = loop.create_future()
    speakers = [asyncio.create_task(s.speak(utterance, cfg.chunk_ms, ended))]
    stopped = start = heard_at = None
    limited = False
    try:
        async with asyncio.timeout(cfg.timeout_s):
            while True:
                e = await s.recv()
                kind, now = e["type"], time.perf_counter()
                if kind == "input_audio_buffer.speech_stopped":
                    stopped = now
                elif kind == "response.created":
                    start = now
                elif kind == "response.output_audio.delta":
                    seconds = len(base64.b64decode(e["delta"])) / 2 / RATE
                    if not turn.audio_chunks:
                        # an answer to a split utterance may start before its last append: no latency to count
                        turn.speech_end_to_audio_s = now - ended.result() if ended.done() else None
                        turn.vad_stop_to_audio_s = now - stopped if stopped else None
                        if interrupt:
                            speakers[0].cancel()
                            speakers.append(asyncio.create_task(s.speak(utterance, cfg.chunk_ms, loop.create_future())))
                    turn.audio_chunks.append([now - (start or now), seconds])
                elif kind == "input_audio_buffer.speech_started" and turn.audio_chunks and interrupt:
                    heard_at = now
                elif kind == "response.done":
                    status = e["response"]["status"]
                    if status == "failed" and limited and not turn.audio_chunks:
                        turn.refused += 1
                        limited, start = False, None
                        if cfg.retry:
                            speakers.append(asyncio.create_task(_ask_again(s, RETRY_AFTER_S)))
                            continue
                    if status == "cancelled" and not turn.audio_chunks:
                        turn.splits += 1
                        stopped = start = None
                        continue
                    if interrupt and turn.audio_chunks:
                        if status == "cancelled" and heard_at:
                            turn.barge_in_s = now - heard_at
                        else:
                            turn.barge_in_missed = status in ("completed", "incomplete")
                        turn.ok = turn.barge_in_s is not None or turn.barge_in_missed
                        turn.error = None if turn.ok else f"not cancelled: {status}"
                    else:
                        turn.ok = status in ("completed", "incomplete") and bool(turn.audio_chunks)
                        turn.error = None if turn.ok else f"status {status}, {len(turn.audio_chunks)} chunks"
                    return turn
                elif kind == "error":
                    limited = limited or e["error"].get("code") == "rate_limit_exceeded"
                    if not limited:
                        log.warning("realtime bench: error event %s", e["error"])
    except Exception as exc:  # noqa: BLE001 - a failed turn is a record
        turn.error = repr(exc)
        return turn
    finally:
        for speaker in speakers:
            speaker.cancel()
        await asyncio.gather(*speakers, return_exceptions=True)


async def _session(cfg: RealtimeBenchConfig, model: str, utterance: bytes) -> list[Turn]:
    from websockets.asyncio.client import connect

    url = cfg.url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + f"/v1/realtime?model={model}"
    async with connect(url, max_size=None) as ws:
        s = _Session(ws)
        assert (await s.recv())["type"] == "session.created"
        await s.send({"type": "session.update", "session": {
            "temperature": 0, "seed": cfg.seed, "max_output_tokens": cfg.max_output_tokens,
            "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                   "silence_duration_ms": cfg.silence_duration_ms}}}}})
        while (await s.recv())["type"] != "session.updated":
            pass
        turns = []
        for k in range(cfg.turns):
            interrupt = cfg.barge_in and k == cfg.turns - 1 and cfg.turns > 1
            turns.append(await _turn(s, utterance, cfg, interrupt))
            # drain what the interruption left (its own turn's response) before the next turn
            if interrupt:
                await _drain(s, cfg.timeout_s)
        return turns


async def _ask_again(s: _Session, after_s: float) -> None:
    await asyncio.sleep(after_s)
    await s.send({"type": "response.create"})


async def _drain(s: _Session, timeout_s: float) -> None:
    """Reads up to the end of the response to the interruption (a split's cancelled responses before it)."""
    try:
        async with asyncio.timeout(min(timeout_s, 30)):
            while True:
                e = await s.recv()
                if e["type"] == "response.done" and e["response"]["status"] != "cancelled":
                    return
    except TimeoutError:
        pass


async def _reference(cfg: RealtimeBenchConfig, model: str, utterance: bytes, n: int) -> list[Turn]:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(utterance).decode(), "format": "pcm16"}}]}], "stream": True, "temperature": 0,
        "seed": cfg.seed, "max_tokens": cfg.max_output_tokens, "modalities": ["text", "audio"],
        "audio": {"format": "pcm16"}}
    turns = []
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        for _ in range(n):
            turn, t0 = Turn(), time.perf_counter()
            async with client.stream("POST", f"{cfg.url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    audio = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("audio") or {}
                    if audio.get("data"):
                        now = time.perf_counter() - t0
                        if not turn.audio_chunks:
                            turn.speech_end_to_audio_s = now
                        turn.audio_chunks.append([now, len(base64.b64decode(audio["data"])) / 2 / RATE])
            turn.ok = r.status_code == 200 and bool(turn.audio_chunks)
            turns.append(turn)
    return turns


def _summary(label: str, turns: list[Turn], buffer_s: float, wall_s: float) -> dict:
    ok = [t for t in turns if t.ok]
    answered = [t for t in ok if t.barge_in_s is None]
    return {"run": label, "turns": len(turns), "failed": len(turns) - len(ok), "wall_s": round(wall_s, 3),
            "speech_end_to_audio_s": stats([t.speech_end_to_audio_s for t in ok if t.speech_end_to_audio_s]),
            "vad_stop_to_audio_s": stats([t.vad_stop_to_audio_s for t in ok if t.vad_stop_to_audio_s]),
            "barge_in_s": stats([t.barge_in_s for t in ok if t.barge_in_s is not None]),
            "barge_in_missed": sum(t.barge_in_missed for t in ok),
            "vad_splits": sum(t.splits for t in turns),
            "refused": sum(t.refused for t in turns),
            "playback": heard([t.audio_chunks for t in answered], buffer_s),
            "errors": sorted({t.error for t in turns if t.error})[:5]}


def run_realtime_bench(cfg: RealtimeBenchConfig) -> dict:
    import httpx

    model = cfg.model or httpx.get(f"{cfg.url}/v1/models", timeout=30).json()["data"][0]["id"]
    utterance = _utterance(cfg)
    report: dict = {"config": cfg.model_dump(), "machine": machine_info(cfg.url), "runs": []}
    if cfg.reference:
        t0 = time.perf_counter()
        ref = asyncio.run(_reference(cfg, model, utterance, max(4, cfg.turns)))
        report["runs"].append(_summary("chat_c1_reference", ref, cfg.client_buffer_s, time.perf_counter() - t0))
    for c in cfg.concurrency:
        async def run_point():
            return await asyncio.gather(*[_session(cfg, model, utterance) for _ in range(c)], return_exceptions=True)
        t0 = time.perf_counter()
        sessions = asyncio.run(run_point())
        turns = [t for s in sessions if not isinstance(s, BaseException) for t in s]
        turns += [Turn(error=repr(s)) for s in sessions if isinstance(s, BaseException)]
        report["runs"].append(_summary(f"realtime_c{c}", turns, cfg.client_buffer_s, time.perf_counter() - t0))
        log.info("realtime bench: concurrency %d done", c)
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "realtime_bench_report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    report["path"] = path
    return report


def format_report(report: dict) -> str:
    def ms(block, key="p50") -> str:
        return "-" if not block else f"{block[key] * 1000:.0f}"

    lines = ["run | turns | failed | speech end -> audio p50/p95 ms | VAD stop -> audio p50/p95 ms | "
             "barge-in p50/p95 ms (missed) | VAD splits | refused | stalled streams | gap p95 ms"]
    for r in report["runs"]:
        p = r["playback"] or {}
        lines.append(" | ".join([
            r["run"], str(r["turns"]), str(r["failed"]),
            f"{ms(r['speech_end_to_audio_s'])}/{ms(r['speech_end_to_audio_s'], 'p95')}",
            f"{ms(r['vad_stop_to_audio_s'])}/{ms(r['vad_stop_to_audio_s'], 'p95')}",
            f"{ms(r['barge_in_s'])}/{ms(r['barge_in_s'], 'p95')} ({r['barge_in_missed']})",
            str(r["vad_splits"]), str(r["refused"]),
            str(p.get("stalled_streams", "-")), ms(p.get("chunk_gap_s"), "p95")]))
    lines += machine_section(report["machine"])
    lines.append(f"\nwrote {report['path']}")
    return "\n".join(lines)
