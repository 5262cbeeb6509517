#!/usr/bin/env bash
# The image-edit benchmark, end to end, on the `small` Qwen-Image-Edit checkpoint (docs/qwen_image.md has the
# numbers): serve the qwen_image_edit graph with benchmarks/qwen_image_edit/small.yaml on a local Ray; N edits
# (each of its own 256x256 input image, conditioned at ~1 MP as the pipeline does), 128x128 out, STEPS steps with
# true CFG, at concurrency 1 and 4; then stop the server and run diffusers' QwenImageEditPipeline one request at
# a time on the same requests (same command, quiet machine). No cache-dit run: 5 steps leave it nothing to skip.
# Usage: benchmarks/qwen_image_edit/run.sh [OUT_DIR] (default bench_edit/). Takes ~10 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_edit}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen_image_edit-small
PORT=${PORT:-8125}
N=${N:-8}
STEPS=${STEPS:-5}
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen_image_edit --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --graph qwen_image_edit --config benchmarks/qwen_image_edit/small.yaml
"$BIN/omni-serve" bench --mode image --endpoint edits --input-size 256x256 --url "http://127.0.0.1:$PORT" \
  --checkpoint "$CKPT" --num-requests "$N" --concurrency 1,4 --size 128x128 --steps "$STEPS" \
  --negative-prompt " " --true-cfg-scale 4.0 --threads 2 --cache-modes none \
  --stop-server-pid $SERVER --out "$OUT"
wait $SERVER 2>/dev/null || true
