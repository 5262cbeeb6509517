#!/usr/bin/env bash
# The Qwen-Image benchmark, end to end, on the `small` checkpoint (docs/qwen_image.md has the numbers):
#   for each dtype in DTYPES (default "float32 bfloat16") and image size in SIZES (default "128x128 64x64"): serve
#   the graph with benchmarks/qwen_image/small.yaml and every stage in that dtype on a local Ray; 20 steps, true CFG,
#   at concurrency 1 and 8, plus cache-dit DBCache and TaylorSeer runs at concurrency 8 with PSNR against the
#   uncached images; then stop the server and run diffusers' QwenImagePipeline in the same dtype, one request at a
#   time, on the same requests (same command, quiet machine) for the ratios. Then the ceiling report of each dtype
#   (benchmarks/qwen_image/ceiling.py) against its 128x128 run.
# Usage: benchmarks/qwen_image/run.sh [OUT_DIR] (default bench_image/; one sub-folder per dtype and size).
# Takes ~12 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_image}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen_image-small
PORT=${PORT:-8124}
N=${N:-32}
SIZES=${SIZES:-128x128 64x64}
DTYPES=${DTYPES:-float32 bfloat16}
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen_image --size small "$CKPT"
for DTYPE in $DTYPES; do
  for SIZE in $SIZES; do
    DIR="$OUT/$DTYPE/$SIZE"
    mkdir -p "$DIR"
    start_server "$DIR/serve.log" --graph qwen_image --config benchmarks/qwen_image/small.yaml \
      stages.text_encoder.engine.dtype=$DTYPE stages.dit.engine.dtype=$DTYPE stages.vae.engine.dtype=$DTYPE
    "$BIN/omni-serve" bench --mode image --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" \
      --concurrency 1,8 --size "$SIZE" --steps 20 --negative-prompt " " --true-cfg-scale 4.0 --threads 2 \
      --baseline-dtype "$DTYPE" --cache-modes dbcache,taylorseer --cache-threshold 0.75 --stop-server-pid $SERVER \
      --out "$DIR"
    wait $SERVER 2>/dev/null || true
  done
  if [ -f "$OUT/$DTYPE/128x128/image_bench_report.json" ]; then
    "$BIN/python" benchmarks/qwen_image/ceiling.py "$CKPT" --dtype "$DTYPE" \
      --bench-report "$OUT/$DTYPE/128x128/image_bench_report.json" --out "$OUT/$DTYPE/ceiling.json"
  fi
done
