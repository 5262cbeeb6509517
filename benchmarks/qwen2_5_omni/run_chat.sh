#!/usr/bin/env bash
# Qwen2.5-Omni chat (text + audio) on the `small` checkpoint with the code2wav DiT in bfloat16, in one invocation:
#   1. serve benchmarks/qwen2_5_omni/small.yaml (native thinker) with stages.code2wav.params.dit_dtype=bfloat16; 32
#      text tokens and 384 codec tokens per request at concurrency 1 and 16; the bench stops the server, then runs
#      transformers' sequential generate on the same requests on the quiet machine            -> OUT/
#   2. the graph's compute ceiling with the same DiT dtype, and both runs against it            -> OUT/ceiling.json
# This is the issue-20 acceptance measurement (docs/benchmarks.md). Usage: benchmarks/qwen2_5_omni/run_chat.sh [OUT_DIR]
# (default bench_out/chat); DIT_DTYPE=float32 measures transformers' numerics instead; extra arguments are graph
# overrides for the server.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out/chat}
shift || true
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-small
PORT=${PORT:-8123}
N=${N:-16}
DIT_DTYPE=${DIT_DTYPE:-bfloat16}
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/spk_dict.pt" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --config benchmarks/qwen2_5_omni/small.yaml \
  stages.code2wav.params.dit_dtype="$DIT_DTYPE" "$@"
"$BIN/omni-serve" bench --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" --concurrency 1,16 \
  --max-tokens 32 --min-tokens 32 --max-codec-tokens 384 --num-steps 10 --thinker-backend native --baseline hf \
  --stop-server-pid $SERVER --out "$OUT"
wait $SERVER 2>/dev/null || true
"$BIN/python" benchmarks/qwen2_5_omni/ceiling.py "$CKPT" --batch 16 --dit-dtype "$DIT_DTYPE" \
  --bench-report "$OUT/bench_report.json" --out "$OUT/ceiling.json"
