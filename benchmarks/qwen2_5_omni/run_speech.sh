#!/usr/bin/env bash
# The speech benchmark of docs/benchmarks.md (POST /v1/audio/speech) on the Qwen2.5-Omni `small` checkpoint, in one
# invocation. Twice: serve the graph (benchmarks/qwen2_5_omni/small_speech.yaml) on a local Ray and speak N texts at
# concurrency 1 and 8 (streamed pcm, greedy codec tokens), first with stages.code2wav.params.dit_dtype=float32
# (transformers' numerics)                                                              -> OUT/speech_fp32
# then with stages.code2wav.params.dit_dtype=bfloat16; that second bench stops the server and speaks the same texts
# with transformers' generate (thinker forced to the text, one request at a time, quiet machine) -> OUT/speech_bf16
# Usage: benchmarks/qwen2_5_omni/run_speech.sh [OUT_DIR] (default bench_out/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-small
PORT=${PORT:-8123}
N=${N:-16}
CONFIG=benchmarks/qwen2_5_omni/small_speech.yaml
SPEECH=(--mode speech --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" --concurrency 1,8
        --min-words 12 --max-words 24 --max-codec-tokens 384 --num-steps 10 --voice Chelsie)
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small "$CKPT"
mkdir -p "$OUT/speech_fp32" "$OUT/speech_bf16"
start_server "$OUT/speech_fp32/serve.log" --config "$CONFIG" stages.code2wav.params.dit_dtype=float32
"$BIN/omni-serve" bench "${SPEECH[@]}" --baseline none --out "$OUT/speech_fp32"
kill $SERVER; wait $SERVER 2>/dev/null || true
"$BIN/ray" stop --force > /dev/null 2>&1 || true
start_server "$OUT/speech_bf16/serve.log" --config "$CONFIG" stages.code2wav.params.dit_dtype=bfloat16
"$BIN/omni-serve" bench "${SPEECH[@]}" --baseline hf --stop-server-pid $SERVER --out "$OUT/speech_bf16"
wait $SERVER 2>/dev/null || true
