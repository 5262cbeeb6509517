"""Prometheus metrics through Ray Serve's metrics API (``ray.serve.metrics``).

Every series carries Serve's ``deployment``, ``replica`` and ``application`` tags and is exported by each
node's Ray metrics agent (``ray.init(_metrics_export_port=...)``, ``ray start --metrics-export-port``), the
endpoint Prometheus scrapes; Ray prefixes every name with ``ray_``. ``docs/observability.md`` lists them
and ``grafana/omni_serve.json`` charts them.

- Ingress (``IngressMetrics``): per chat request a ``RequestClock`` marks first text, first audio, each
  text delta and audio seconds, and on completion observes the histograms ``omni_serve_ttft_seconds``,
  ``omni_serve_ttfp_seconds``, ``omni_serve_itl_seconds``, ``omni_serve_e2e_seconds`` and
  ``omni_serve_rtf`` (E2E / seconds of audio); ``omni_serve_requests`` counts requests by route and outcome,
  ``omni_serve_errors`` errors by route and type (OpenAI error type, or the exception class).
- Stages (``StageMetrics``): gauges sampled from the engine every ``sample_s`` (queue length, active
  requests, utilization, batch occupancy, KV blocks used/free, diffusion steps in flight) and, from the
  engine's step hook, ``omni_serve_stage_step_seconds`` and ``omni_serve_stage_batch_size``.
- Connectors (``observe_transfers``): ``omni_serve_connector_bytes`` and ``omni_serve_connector_seconds``
  per backend and operation (put/get) on the streaming path.

Recording never raises into the serving path: a metrics failure is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from omni_serve.playback import Playback

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]
STALL_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
STALL_COUNT_BUCKETS = [0.5, 1.5, 2.5, 5.5, 10.5, 20.5]  # a histogram of integers: 0, 1, 2, 3-5, 6-10, ...
RTF_BUCKETS = [0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 8, 16]
STEP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TRANSFER_BUCKETS = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5]


def _metrics():
    from ray.serve import metrics

    return metrics


class RequestClock:
    """Timestamps of one streamed request (monotonic seconds); turns them into the latency figures. Its audio is
    followed as a client with a ``buffer_s`` jitter buffer would play it (``omni_serve.playback``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, buffer_s: float = 0.5):
        self._clock = clock
        self.start = clock()
        self.first_text: float | None = None
        self.first_audio: float | None = None
        self.text_times: list[float] = []
        self.audio_seconds = 0.0
        self.playback = Playback(buffer_s, self.start)
        self.on_audio: Callable[[float], None] | None = None  # told each chunk's seconds (real-time admission)
        self.error: str | None = None  # error type, when a stream ended with an error event

    def text(self) -> None:
        now = self._clock()
        self.first_text = self.first_text if self.first_text is not None else now
        self.text_times.append(now)

    def audio(self, seconds: float) -> None:
        now = self._clock()
        self.first_audio = self.first_audio if self.first_audio is not None else now
        self.audio_seconds += seconds
        self.playback.add(now, seconds)
        if self.on_audio is not None:
            self.on_audio(seconds)

    def figures(self) -> dict[str, Any]:
        """ttft, ttfp, e2e, rtf (None when not applicable), itl (gaps between text deltas) and ``playback``, the
        listener's figures (``omni_serve.playback.PlaybackFigures``; None without audio)."""
        e2e = self._clock() - self.start
        return {
            "playback": self.playback.figures() if self.playback.first is not None else None,
            "ttft": None if self.first_text is None else self.first_text - self.start,
            "ttfp": None if self.first_audio is None else self.first_audio - self.start,
            "e2e": e2e,
            "rtf": e2e / self.audio_seconds if self.audio_seconds > 0 else None,
            "itl": [b - a for a, b in zip(self.text_times, self.text_times[1:])],
        }


class _Guarded:
    """Runs metric updates, logging the first failure instead of raising into the serving path."""

    def __init__(self, name: str):
        self._name, self._failed = name, False

    def run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            if not self._failed:
                self._failed = True
                log.exception("%s metrics: recording failed (further failures are not logged)", self._name)


class IngressMetrics(_Guarded):
    def __init__(self):
        super().__init__("ingress")
        m = _metrics()
        self.ttft = m.Histogram("omni_serve_ttft_seconds", description="Time to first text token.",
                                boundaries=LATENCY_BUCKETS, tag_keys=("route",))
        self.ttfp = m.Histogram("omni_serve_ttfp_seconds", description="Time to first audio (packet).",
                                boundaries=LATENCY_BUCKETS, tag_keys=("route",))
        self.itl = m.Histogram("omni_serve_itl_seconds", description="Gap between streamed text deltas.",
                               boundaries=ITL_BUCKETS, tag_keys=("route",))
        self.e2e = m.Histogram("omni_serve_e2e_seconds", description="Request latency, first byte in to last out.",
                               boundaries=LATENCY_BUCKETS, tag_keys=("route",))
        self.rtf = m.Histogram("omni_serve_rtf", description="Real-time factor: E2E / seconds of audio produced.",
                               boundaries=RTF_BUCKETS, tag_keys=("route",))
        self.audio_gap = m.Histogram("omni_serve_audio_chunk_gap_seconds", description=(
            "Time between consecutive audio chunks of a stream."), boundaries=LATENCY_BUCKETS, tag_keys=("route",))
        self.stalls = m.Histogram("omni_serve_audio_stalls", description=(
            "Stalls per audio stream: chunks that arrived after the client's buffer ran dry (playback.client_buffer_s "
            "of the graph)."), boundaries=STALL_COUNT_BUCKETS, tag_keys=("route",))
        self.stall_s = m.Histogram("omni_serve_audio_stall_seconds", description=(
            "Silence per audio stream: its stalls' lateness in all (0 for a stream that never stalled)."),
            boundaries=STALL_BUCKETS, tag_keys=("route",))
        self.rtf_after_first = m.Histogram("omni_serve_audio_rtf_after_first", description=(
            "Real-time factor after the first chunk: time from the first audio to the last / audio after the first "
            "chunk (< 1: produced faster than it plays)."), boundaries=RTF_BUCKETS, tag_keys=("route",))
        self.requests = m.Counter("omni_serve_requests", description="Requests by route and outcome.",
                                  tag_keys=("route", "outcome"))
        self.errors = m.Counter("omni_serve_errors", description="Failed requests by route and error type.",
                                tag_keys=("route", "type"))

    def finished(self, route: str, clock: RequestClock) -> None:
        def record():
            f = clock.figures()
            tags = {"route": route}
            self.e2e.observe(f["e2e"], tags=tags)
            for name in ("ttft", "ttfp", "rtf"):
                if f[name] is not None:
                    getattr(self, name).observe(f[name], tags=tags)
            for gap in f["itl"]:
                self.itl.observe(gap, tags=tags)
            heard = f["playback"]
            if heard is not None:
                for gap in heard.gaps:
                    self.audio_gap.observe(gap, tags=tags)
                self.stalls.observe(heard.stalls, tags=tags)
                self.stall_s.observe(heard.stall_s, tags=tags)
                if heard.rtf_after_first is not None:
                    self.rtf_after_first.observe(heard.rtf_after_first, tags=tags)
            self.requests.inc(tags={"route": route, "outcome": "ok"})
        self.run(record)

    def failed(self, route: str, error_type: str, outcome: str) -> None:
        self.run(lambda: (self.errors.inc(tags={"route": route, "type": error_type}),
                          self.requests.inc(tags={"route": route, "outcome": outcome})))


# engine.load()/stats() key -> gauge name and description
STAGE_GAUGES = {
    "queue_length": ("omni_serve_stage_queue_length",
                     "Requests waiting in the stage: for admission, or admitted with work ready but not running."),
    "active": ("omni_serve_stage_active_requests", "Requests admitted by the stage's engine."),
    "utilization": ("omni_serve_stage_utilization", "Busy fraction of the engine's worker (last ~5 s)."),
    "batch_occupancy": ("omni_serve_stage_batch_occupancy", "Rows per forward / batch capacity (time-averaged)."),
    "kv_blocks_used": ("omni_serve_stage_kv_blocks_used", "KV cache blocks in use (autoregressive stages)."),
    "kv_blocks_free": ("omni_serve_stage_kv_blocks_free", "KV cache blocks free (autoregressive stages)."),
    "diffusion_steps_in_flight": ("omni_serve_stage_diffusion_steps_in_flight",
                                  "Denoising steps the DiT's requests still need."),
}


def stage_sample(load: dict[str, float], stats: dict[str, Any]) -> dict[str, float]:
    """The gauge values of one engine sample (keys of ``STAGE_GAUGES`` the engine has)."""
    out = {"queue_length": load.get("queued", 0.0) + load.get("ready_waiting", 0.0),
           "active": load.get("active", 0.0), "utilization": load.get("utilization", 0.0)}
    for key in ("batch_occupancy", "diffusion_steps_in_flight"):
        if key in load:
            out[key] = load[key]
    for key in ("kv_blocks_used", "kv_blocks_free"):
        if key in stats:
            out[key] = float(stats[key])
    return out


class StageMetrics(_Guarded):
    """Gauges sampled from ``engine`` every ``sample_s`` by a daemon thread, plus the per-step histograms
    fed through ``engine.on_step``."""

    def __init__(self, stage: str, engine, sample_s: float = 2.0):
        super().__init__(f"stage {stage}")
        m = _metrics()
        self.engine = engine
        self.gauges = {key: m.Gauge(name, description=desc) for key, (name, desc) in STAGE_GAUGES.items()}
        self.step_seconds = m.Histogram("omni_serve_stage_step_seconds", description="Duration of one engine step "
                                        "(one batched forward).", boundaries=STEP_BUCKETS)
        self.batch_size = m.Histogram("omni_serve_stage_batch_size", description="Requests computed together in "
                                      "one engine step.", boundaries=BATCH_BUCKETS)
        engine.on_step = self.step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, args=(sample_s,), name=f"metrics-{stage}",
                                        daemon=True)
        self._thread.start()

    def step(self, batch: int, seconds: float) -> None:
        self.run(lambda: (self.step_seconds.observe(seconds), self.batch_size.observe(batch)))

    def sample(self) -> None:
        values = stage_sample(self.engine.load(), self.engine.stats())
        self.run(lambda: [self.gauges[k].set(v) for k, v in values.items()])

    def _sample_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self.sample()

    def close(self) -> None:
        self._stop.set()


class _TransferMetrics(_Guarded):
    def __init__(self):
        super().__init__("connector")
        m = _metrics()
        self.bytes = m.Counter("omni_serve_connector_bytes", description="Tensor bytes moved by the data plane.",
                               tag_keys=("backend", "op"))
        self.seconds = m.Histogram("omni_serve_connector_seconds", description="Data-plane put/get latency.",
                                   boundaries=TRANSFER_BUCKETS, tag_keys=("backend", "op"))

    def __call__(self, backend: str, op: str, nbytes: int, seconds: float) -> None:
        def record():
            tags = {"backend": backend, "op": op}
            if nbytes > 0:  # Ray's Counter refuses 0 (payloads of only metadata move no tensor bytes)
                self.bytes.inc(nbytes, tags=tags)
            self.seconds.observe(seconds, tags=tags)
        self.run(record)


def observe_transfers() -> None:
    """Count this process' data-plane puts/gets (bytes, latency) per backend (idempotent)."""
    from omni_serve.transport import base

    if base.transfer_observer() is None:
        base.set_transfer_observer(_TransferMetrics())
