"""Result shapes shared by every bench runner (HTTP client, HF baseline, transformers CB) and the report.

Contract:

* ``RequestRecord``: one request's outcome. Durations are seconds measured from the request's own start
  (``start_s`` is its start relative to the run's start). A failed request has ``ok=False`` and ``error``
  set (plus ``status`` when an HTTP status was received); it is always kept in ``RunResult.records`` and
  counted, never dropped, and it is left out of latency percentiles. A 429 (the server at capacity) is a
  *rejected* request (``rejected``), counted apart from failures (``num_errors``, ``num_rejected``); a client
  that sends it again after ``Retry-After`` records the 429s it got (``rejections``) and the time before its
  admitted try (``waited_s``), from which its latencies count.
  ``audio_chunks`` are the audio's arrivals (seconds from the request's start, seconds of audio), which the
  report plays back (``omni_serve.playback``) with the run's ``client_buffer_s`` for stalls and gaps.
* ``RunResult``: one load point of one system (``system``: ``engine`` / ``engine_vllm``, the served graph with a
  native / vLLM thinker; ``engine_text`` / ``vllm``, the thinker alone on each; baselines ``hf`` and ``cb``),
  with its records, the run's wall time (first request start to last request end) and free-form ``notes``
  that the report prints (e.g. how tokens were counted, that TTFT equals E2E for a non-streaming run).
* Both round-trip through plain dicts (``to_dict``/``from_dict``) so a JSON report can be re-read.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

#: How ``RequestRecord.output_tokens`` was obtained. Exact sources first.
TOKEN_SOURCES = ("token_ids", "usage", "generate", "cb", "deltas")
EXACT_TOKEN_SOURCES = ("token_ids", "usage", "generate", "cb")


@dataclass
class RequestRecord:
    index: int
    ok: bool = False
    start_s: float = 0.0  # request start, relative to the run start
    e2e_s: float | None = None  # start -> last byte (or -> failure, for failed requests)
    ttft_s: float | None = None  # start -> first non-empty text delta
    ttfp_s: float | None = None  # start -> first non-empty audio delta
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive non-empty text deltas
    output_tokens: int | None = None
    token_source: str | None = None  # one of TOKEN_SOURCES
    text_deltas: int = 0
    text_chars: int = 0
    text_sha1: str | None = None  # digest of the full output text (greedy parity checks across systems)
    audio_seconds: float = 0.0
    audio_chunks: list[list[float]] = field(default_factory=list)  # [arrival from the request's start, seconds]
    finish_reason: str | None = None
    status: int | None = None  # HTTP status, when one was received
    error: str | None = None
    retry_after_s: float = 0.0  # a 429's Retry-After
    rejections: int = 0  # 429s this request got (sent again after each, with retry_rejected)
    waited_s: float = 0.0  # from the first try to the start of the last (ttft/ttfp/e2e count from there)

    @property
    def rejected(self) -> bool:
        """The server said it is at capacity (429): not served, and not a failure."""
        return not self.ok and self.status == 429

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**d)


@dataclass
class RunResult:
    label: str  # e.g. "engine c=4", "hf", "cb c=16"
    system: str  # "engine" | "engine_vllm" | "engine_text" | "vllm" | "hf" | "cb"
    mode: str = "omni"  # "omni" (text + optional audio over HTTP / Omni generate) or "text" (thinker only)
    concurrency: int | None = None  # closed loop: requests in flight; open loop: optional cap (None = no cap)
    request_rate: float | None = None  # open loop: Poisson arrivals per second; None = closed loop
    wall_s: float = 0.0
    streaming: bool = True  # False: TTFT/TTFP are the E2E latency (no partial output observed)
    client_buffer_s: float = 0.5  # the listener's jitter buffer its audio is played with (omni_serve.playback)
    records: list[RequestRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def num_errors(self) -> int:
        """Failed requests; a 429 the server answered at capacity is *rejected*, not failed."""
        return sum(not r.ok and not r.rejected for r in self.records)

    @property
    def num_rejected(self) -> int:
        return sum(r.rejected for r in self.records)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["records"] = [r.to_dict() for r in self.records]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunResult":
        d = dict(d)
        d["records"] = [RequestRecord.from_dict(r) for r in d.get("records", [])]
        return cls(**d)


def finish_token_record(rec: "RequestRecord", t0: float, stamps: list[float], tokens: list[int],
                        text: list[str]) -> None:
    """Fill an in-process engine run's record (``engine_text``, ``vllm_text``): timings from the per-token
    arrival ``stamps`` (``time.perf_counter()``; ``t0`` the request's start), exact token counts, and the length
    and digest of the decoded text."""
    rec.e2e_s = (stamps[-1] if stamps else time.perf_counter()) - t0
    if stamps:
        rec.ttft_s = stamps[0] - t0
        rec.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
    rec.output_tokens, rec.token_source, rec.text_deltas = len(tokens), "generate", len(tokens)
    full = "".join(text)
    rec.text_chars, rec.text_sha1 = len(full), hashlib.sha1(full.encode("utf-8")).hexdigest()
