#!/usr/bin/env bash
# The Wan text-to-video benchmark (issue 42), end to end, on the `small` checkpoint (the numbers:
# docs/benchmarks.md#wan-text-to-video): serve the graph with benchmarks/wan/small.yaml on a local Ray, its jobs under
# OUT/jobs (emptied first); N (default 12) jobs of SIZE (default 128x128), FRAMES (default 17) frames at 16 fps, STEPS
# (default 20) steps with CFG 5 (the empty negative prompt), at each concurrency of CONCURRENCY (default 1,4): create,
# poll, download the MP4. Then stop the server and run diffusers' WanPipeline one request at a time on the same
# requests, 2 threads (same command, quiet machine), for the ratios; then (still quiet) time each stage alone for the
# compute ceiling and set the run against it (OUT/ceiling.json).
# Usage: benchmarks/wan/run.sh [OUT_DIR] (default bench_out/wan). Takes ~6 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out/wan}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/wan-small
PORT=${PORT:-8126}
N=${N:-12}
SIZE=${SIZE:-128x128}
FRAMES=${FRAMES:-17}
STEPS=${STEPS:-20}
CONCURRENCY=${CONCURRENCY:-1,4}
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint wan --size small "$CKPT"
mkdir -p "$OUT"
rm -rf "$OUT/jobs"  # no job of an earlier run is left queued for this server
start_server "$OUT/serve.log" --graph wan --config benchmarks/wan/small.yaml "jobs.dir=$(cd "$OUT" && pwd)/jobs"
"$BIN/omni-serve" bench --mode video --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" \
  --concurrency "$CONCURRENCY" --size "$SIZE" --num-frames "$FRAMES" --fps 16 --steps "$STEPS" --guidance-scale 5 \
  --threads 2 --stop-server-pid $SERVER --out "$OUT"
wait $SERVER 2>/dev/null || true
"$BIN/python" benchmarks/wan/ceiling.py "$CKPT" --size "$SIZE" --frames "$FRAMES" --fps 16 --steps "$STEPS" \
  --guidance 5 --batch "${CONCURRENCY##*,}" --bench-report "$OUT/video_bench_report.json" --out "$OUT/ceiling.json"
