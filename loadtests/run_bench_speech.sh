#!/usr/bin/env bash
# The speech benchmark of docs/benchmarks.md (POST /v1/audio/speech) on the Qwen2.5-Omni `small` checkpoint, in one
# invocation: serve the graph (loadtests/qwen2_5_omni_small.yaml) on a local Ray; speak N texts at concurrency 1 and
# 8 (streamed pcm, greedy codec tokens); the bench then stops the server and speaks the same texts with
# transformers' generate (thinker forced to the text, one request at a time, quiet machine)   -> OUT/speech
# Usage: loadtests/run_bench_speech.sh [OUT_DIR] (default bench_out/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out}/speech
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-small
PORT=${PORT:-8123}
N=${N:-16}
source loadtests/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --config loadtests/qwen2_5_omni_small.yaml
"$BIN/omni-serve" bench --mode speech --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" \
  --concurrency 1,8 --min-words 12 --max-words 24 --max-codec-tokens 384 --num-steps 10 --voice Chelsie \
  --baseline hf --stop-server-pid $SERVER --out "$OUT"
wait $SERVER 2>/dev/null || true
