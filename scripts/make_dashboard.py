#!/usr/bin/env python3
"""Write grafana/omni_serve.json, the Grafana dashboard of omni_serve's metrics (omni_serve/metrics.py).

    .venv/bin/python scripts/make_dashboard.py          # rewrite the dashboard
    .venv/bin/python scripts/make_dashboard.py --check  # exit 1 if the committed file is stale

Panels are data (``PANELS``: title, unit, PromQL queries); this script lays them out on Grafana's 24-column
grid. Every series is a Ray metric (``ray_`` prefix) with Serve's ``application``/``deployment`` tags; the
dashboard's ``$application`` variable filters them. tests/integration/test_metrics.py checks that every
metric a panel queries exists in a real scrape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "grafana", "omni_serve.json")
APP = 'application=~"$application"'


def _quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate(ray_{metric}_bucket{{{APP}}}[$__rate_interval])))",
             f"{legend}p{int(q * 100)}") for q in (0.5, 0.95)]


# (title, unit, [(PromQL, legend)]), in rows of three panels
PANELS = [
    ("Requests / s by outcome", "reqps",
     [(f"sum by (route, outcome) (rate(ray_omni_serve_requests_total{{{APP}}}[$__rate_interval]))",
       "{{route}} {{outcome}}")]),
    ("Errors / s by type", "reqps",
     [(f"sum by (route, type) (rate(ray_omni_serve_errors_total{{{APP}}}[$__rate_interval]))",
       "{{route}} {{type}}")]),
    ("E2E latency", "s", _quantiles("omni_serve_e2e_seconds")),
    ("Time to first token (TTFT)", "s", _quantiles("omni_serve_ttft_seconds")),
    ("Time to first audio (TTFP)", "s", _quantiles("omni_serve_ttfp_seconds")),
    ("Inter-token latency (ITL)", "s", _quantiles("omni_serve_itl_seconds")),
    ("Real-time factor (E2E / audio seconds)", "none", _quantiles("omni_serve_rtf")),
    ("Audio streams that stalled / s (client buffer: playback.client_buffer_s)", "none",
     [(f"sum by (route) (rate(ray_omni_serve_audio_stalls_count{{{APP}}}[$__rate_interval])) - sum by (route) "
       f"(rate(ray_omni_serve_audio_stalls_bucket{{{APP}, le=\"0.5\"}}[$__rate_interval]))", "{{route}} stalled"),
      (f"sum by (route) (rate(ray_omni_serve_audio_stall_seconds_sum{{{APP}}}[$__rate_interval]))",
       "{{route}} silence s / s")]),
    ("Gap between audio chunks", "s", _quantiles("omni_serve_audio_chunk_gap_seconds")),
    ("Real-time factor after the first audio chunk", "none", _quantiles("omni_serve_audio_rtf_after_first")),
    ("Stage replicas", "none",
     [(f"count by (deployment) (ray_omni_serve_stage_utilization{{{APP}}})", "{{deployment}}")]),
    ("Stage utilization (worker busy fraction)", "percentunit",
     [(f"avg by (deployment) (ray_omni_serve_stage_utilization{{{APP}}})", "{{deployment}}")]),
    ("Stage queue length", "none",
     [(f"sum by (deployment) (ray_omni_serve_stage_queue_length{{{APP}}})", "{{deployment}}")]),
    ("Stage active requests", "none",
     [(f"sum by (deployment) (ray_omni_serve_stage_active_requests{{{APP}}})", "{{deployment}}")]),
    ("Batch occupancy", "percentunit",
     [(f"avg by (deployment) (ray_omni_serve_stage_batch_occupancy{{{APP}}})", "{{deployment}}")]),
    ("Batch size", "none", _quantiles("omni_serve_stage_batch_size", "deployment")),
    ("Step time", "s", _quantiles("omni_serve_stage_step_seconds", "deployment")),
    ("KV blocks used / free", "none",
     [(f"sum by (deployment) (ray_omni_serve_stage_kv_blocks_used{{{APP}}})", "{{deployment}} used"),
      (f"sum by (deployment) (ray_omni_serve_stage_kv_blocks_free{{{APP}}})", "{{deployment}} free")]),
    ("Diffusion steps in flight", "none",
     [(f"sum by (deployment) (ray_omni_serve_stage_diffusion_steps_in_flight{{{APP}}})", "{{deployment}}")]),
    ("Data plane bytes / s", "Bps",
     [(f"sum by (backend, op) (rate(ray_omni_serve_connector_bytes_total{{{APP}}}[$__rate_interval]))",
       "{{backend}} {{op}}")]),
    ("Data plane latency p95", "s",
     [(f"histogram_quantile(0.95, sum by (le, backend, op) "
       f"(rate(ray_omni_serve_connector_seconds_bucket{{{APP}}}[$__rate_interval])))", "{{backend}} {{op}}")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, queries) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"x": (i % 3) * 8, "y": (i // 3) * 8, "w": 8, "h": 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(queries)],
        })
    return {
        "title": "omni_serve", "uid": "omni-serve", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["omni_serve", "ray-serve"], "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "application", "type": "query", "label": "Application", "includeAll": True, "multi": True,
             "datasource": {"type": "prometheus", "uid": "${datasource}"}, "current": {"text": "All", "value": "$__all"},
             "query": "label_values(ray_omni_serve_stage_utilization, application)", "refresh": 2},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the committed file is current")
    args = parser.parse_args()
    text = render()
    if args.check:
        with open(OUT) as f:
            if f.read() != text:
                print(f"{OUT} is stale: run scripts/make_dashboard.py", file=sys.stderr)
                return 1
        return 0
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
