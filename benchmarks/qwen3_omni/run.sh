#!/usr/bin/env bash
# The Qwen3-Omni benchmark of docs/benchmarks.md on the `small` checkpoint, in one invocation: serve the qwen3_omni
# graph (benchmarks/qwen3_omni/small.yaml) on a local Ray; text + audio at concurrency 1 and 16; the bench stops the
# server and runs transformers' Qwen3OmniMoeForConditionalGeneration.generate on the same requests, one at a time
# (quiet machine), for the ratios                                                               -> OUT/qwen3_omni
# Usage: benchmarks/qwen3_omni/run.sh [OUT_DIR] (default bench_out/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out}/qwen3_omni
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen3_omni-small
PORT=${PORT:-8123}
N=${N:-16}
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen3_omni --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --graph qwen3_omni --config benchmarks/qwen3_omni/small.yaml
"$BIN/omni-serve" bench --graph qwen3_omni --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" \
  --concurrency 1,16 --max-tokens 32 --min-tokens 32 --max-codec-tokens 128 --voice Ethan --baseline hf \
  --stop-server-pid $SERVER --out "$OUT"
wait $SERVER 2>/dev/null || true
