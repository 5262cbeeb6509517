#!/usr/bin/env bash
# The GLM-Image benchmark (issue 19), end to end, on the `small` checkpoint (docs/glm_image.md has the numbers):
# serve the graph with benchmarks/glm_image/small.yaml on a local Ray; SIZE (default 128x128), STEPS (default 20)
# denoising steps with the pipeline's CFG (1.5), at concurrency 1 and 8; then stop the server and run diffusers'
# GlmImagePipeline one request at a time on the same requests (same command, quiet machine) for the ratios; then
# (still quiet) time each stage alone for the compute ceiling and set the run against it (OUT/ceiling.json).
# Usage: benchmarks/glm_image/run.sh [OUT_DIR] (default bench_glm_image/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_glm_image}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/glm_image-small
PORT=${PORT:-8125}
N=${N:-32}
SIZE=${SIZE:-128x128}
STEPS=${STEPS:-20}
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint glm_image --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --graph glm_image --config benchmarks/glm_image/small.yaml
"$BIN/omni-serve" bench --mode image --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" \
  --concurrency 1,8 --size "$SIZE" --steps "$STEPS" --true-cfg-scale 1.5 --threads 2 --cache-modes none --stop-server-pid $SERVER \
  --out "$OUT"
wait $SERVER 2>/dev/null || true
"$BIN/python" benchmarks/glm_image/ceiling.py "$CKPT" --size "${SIZE%x*}" --steps "$STEPS" --guidance 1.5 --batch 8 \
  --baseline-requests 0 --bench-report "$OUT/image_bench_report.json" --out "$OUT/ceiling.json"
