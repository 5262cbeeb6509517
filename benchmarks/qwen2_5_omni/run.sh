#!/usr/bin/env bash
# The benchmark of docs/benchmarks.md, end to end, on the `small` checkpoint, in one invocation:
#   1. serve the graph with the native thinker (benchmarks/qwen2_5_omni/small.yaml) on a local Ray; text + audio at
#      concurrency 1 and 16; the bench stops the server                                   -> OUT/omni_native
#   2. serve it with the thinker on vLLM (benchmarks/qwen2_5_omni/small_vllm.yaml); the same requests; then the
#      bench stops the server and runs transformers' sequential generate on the same requests (once, quiet
#      machine) for the ratios                                                             -> OUT/omni_vllm
#      both reports merged: both thinker backends vs the hf baseline, and vLLM vs native   -> OUT/omni
#      then the graph's compute ceiling (benchmarks/qwen2_5_omni/ceiling.py) and each run against it -> OUT/omni/ceiling.json
#   3. text only (no server) at concurrency 1 and 32: the thinker on the native engine and on vLLM vs transformers'
#      continuous batching                                                                 -> OUT/text
# Usage: benchmarks/qwen2_5_omni/run.sh [OUT_DIR] (default bench_out/). Needs the vLLM environment (`make vllm-env`;
# OMNI_SERVE_VLLM_PYTHON, default .venv-vllm/bin/python).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-small
PORT=${PORT:-8123}
N=${N:-16}
export OMNI_SERVE_VLLM_PYTHON=${OMNI_SERVE_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}
source benchmarks/tools/serve_lib.sh

[ -x "$OMNI_SERVE_VLLM_PYTHON" ] || { echo "no vLLM environment at $OMNI_SERVE_VLLM_PYTHON: run make vllm-env"; exit 1; }
[ -f "$CKPT/spk_dict.pt" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small "$CKPT"
mkdir -p "$OUT"
OMNI=(--checkpoint "$CKPT" --num-requests "$N" --concurrency 1,16 --max-tokens 32 --min-tokens 32
      --max-codec-tokens 384 --num-steps 10)

start_server "$OUT/serve_native.log" --config benchmarks/qwen2_5_omni/small.yaml
"$BIN/omni-serve" bench --url "http://127.0.0.1:$PORT" "${OMNI[@]}" --thinker-backend native --baseline none \
  --stop-server-pid $SERVER --out "$OUT/omni_native"
wait $SERVER 2>/dev/null || true

start_server "$OUT/serve_vllm.log" --config benchmarks/qwen2_5_omni/small_vllm.yaml
"$BIN/omni-serve" bench --url "http://127.0.0.1:$PORT" "${OMNI[@]}" --thinker-backend vllm --baseline hf \
  --stop-server-pid $SERVER --out "$OUT/omni_vllm"
wait $SERVER 2>/dev/null || true
"$BIN/python" -m omni_serve.bench.report merge "$OUT/omni" "$OUT/omni_native" "$OUT/omni_vllm"
# still on the quiet machine: each stage alone, the ceiling it sets, and the runs above as a fraction of it
"$BIN/python" benchmarks/qwen2_5_omni/ceiling.py "$CKPT" --batch 16 --bench-report "$OUT/omni/bench_report.json" \
  --out "$OUT/omni/ceiling.json"

"$BIN/omni-serve" bench --mode text --checkpoint "$CKPT" --num-requests 64 --concurrency 1,32 \
  --max-tokens 64 --min-tokens 64 --thinker-backend native,vllm --vllm-python "$OMNI_SERVE_VLLM_PYTHON" \
  --baseline cb --out "$OUT/text"
