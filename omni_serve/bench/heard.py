"""What the listeners of a bench run heard: every stream's audio played back with one client buffer.

Contract: ``heard(streams, buffer_s)`` takes each successful stream's audio arrivals (``[seconds from the request's
start, seconds of audio]`` per chunk; streams without audio are skipped) and plays them as
``omni_serve.playback.Playback`` does. It returns None when no stream had audio, else::

    {"client_buffer_s", "streams", "stalled_streams", "stalls", "stall_s_total",
     "stall_s": stats of each stream's silence, "chunk_gap_s": stats of every gap between chunks,
     "min_headroom_s": stats of each stream's least buffered audio at a chunk's arrival,
     "rtf_after_first": stats of each stream's real-time factor after its first chunk}

(``stats``: ``omni_serve.bench.stats.stats``, n/mean/p50/p95/p99). ``heard_rows(label, summary)`` is its line of a
report table.
"""

from __future__ import annotations

from typing import Any

from omni_serve.bench.stats import stats
from omni_serve.playback import replay

HEARD_HEADER = ["run", "buffer s", "streams", "stalled", "stalls", "stall s", "gap p95 ms", "gap p99 ms",
                "min headroom p5 ms", "RTF after 1st p50"]


def heard(streams: list[list[list[float]]], buffer_s: float) -> dict[str, Any] | None:
    figures = [replay([(t, s) for t, s in chunks], buffer_s) for chunks in streams if chunks]
    if not figures:
        return None
    headroom = sorted(f.min_headroom for f in figures if f.min_headroom is not None)
    return {
        "client_buffer_s": buffer_s, "streams": len(figures),
        "stalled_streams": sum(f.stalls > 0 for f in figures), "stalls": sum(f.stalls for f in figures),
        "stall_s_total": sum(f.stall_s for f in figures),
        "stall_s": stats([f.stall_s for f in figures]),
        "chunk_gap_s": stats([g for f in figures for g in f.gaps]),
        "min_headroom_s": stats(headroom) | {"p5": headroom[round(0.05 * (len(headroom) - 1))]} if headroom else None,
        "rtf_after_first": stats([f.rtf_after_first for f in figures]),
    }


def heard_rows(label: str, summary: dict[str, Any] | None) -> list[str] | None:
    """The report-table row of ``heard``'s summary (None: the run had no audio)."""
    if summary is None:
        return None

    def ms(block: dict | None, key: str) -> str:
        return "-" if not block else f"{block[key] * 1000:.0f}"

    rtf = summary["rtf_after_first"]
    return [label, f"{summary['client_buffer_s']:g}", str(summary["streams"]), str(summary["stalled_streams"]),
            str(summary["stalls"]), f"{summary['stall_s_total']:.2f}", ms(summary["chunk_gap_s"], "p95"),
            ms(summary["chunk_gap_s"], "p99"), ms(summary["min_headroom_s"], "p5"),
            "-" if not rtf else f"{rtf['p50']:.2f}"]
