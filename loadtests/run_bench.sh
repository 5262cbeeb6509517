#!/usr/bin/env bash
# The issue-3 benchmark, end to end, on the `small` checkpoint (docs/benchmarks.md has the numbers):
#   1. serve the graph with loadtests/qwen2_5_omni_small.yaml on a local Ray,
#   2. text + audio at concurrency 1 and 16; then the bench stops the server and runs transformers' sequential
#      generate on the same requests (same run, quiet machine) for the ratios,
#   3. text only at concurrency 32: the engine vs transformers' continuous batching (no server).
# Usage: loadtests/run_bench.sh [OUT_DIR] (default bench_out/). Takes ~20 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-small
PORT=${PORT:-8123}
N=${N:-16}
source loadtests/serve_lib.sh

[ -f "$CKPT/spk_dict.pt" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --config loadtests/qwen2_5_omni_small.yaml
"$BIN/omni-serve" bench --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" \
  --concurrency 1,16 --max-tokens 32 --min-tokens 32 --max-codec-tokens 384 --num-steps 10 \
  --baseline hf --stop-server-pid $SERVER --out "$OUT/omni"
wait $SERVER 2>/dev/null || true
"$BIN/omni-serve" bench --mode text --checkpoint "$CKPT" --num-requests 64 --concurrency 32 \
  --max-tokens 64 --min-tokens 64 --baseline cb --out "$OUT/text"
