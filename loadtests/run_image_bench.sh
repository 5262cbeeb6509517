#!/usr/bin/env bash
# The issue-4 benchmark, end to end, on the `small` Qwen-Image checkpoint (docs/qwen_image.md has the numbers):
#   for each image size in SIZES (default "128x128 64x64"): serve the graph with loadtests/qwen_image_small.yaml
#   on a local Ray; 20 steps, true CFG, at concurrency 1 and 8, plus a cache-dit DBCache run at concurrency 8
#   with PSNR against the uncached images; then stop the server and run diffusers' QwenImagePipeline one
#   request at a time on the same requests (same command, quiet machine) for the ratios.
# Usage: loadtests/run_image_bench.sh [OUT_DIR] (default bench_image/; one sub-folder per size).
# Takes ~8 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_image}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen_image-small
PORT=${PORT:-8124}
N=${N:-16}
SIZES=${SIZES:-128x128 64x64}
source loadtests/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen_image --size small "$CKPT"
for SIZE in $SIZES; do
  mkdir -p "$OUT/$SIZE"
  start_server "$OUT/$SIZE/serve.log" --graph qwen_image --config loadtests/qwen_image_small.yaml
  "$BIN/omni-serve" bench --mode image --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" \
    --concurrency 1,8 --size "$SIZE" --steps 20 --negative-prompt " " --true-cfg-scale 4.0 --threads 2 \
    --cache-modes dbcache,taylorseer --cache-threshold 0.75 --stop-server-pid $SERVER --out "$OUT/$SIZE"
  wait $SERVER 2>/dev/null || true
done
