#!/usr/bin/env bash
# Speech under load (docs/speech_under_load.md, docs/benchmarks.md): what listeners hear from the Qwen2.5-Omni
# `small` checkpoint as the load grows. Serves benchmarks/qwen2_5_omni/small_speech.yaml on a local Ray and speaks N
# texts as streamed pcm (greedy codec tokens, 384 per text) at concurrency 1,4,8,16 and as Poisson arrivals at RATE/s
# (in flight capped by 16), reporting per point TTFP p50/p95/p99, the streams that stalled for a 0.5 s client
# buffer, chunk gaps, headroom, RTF after the first chunk and audio seconds per second. Once per admission policy:
#   POLICIES="none queue" (default): playback.admission.policy=<policy>         -> OUT/speech_load_<policy>
# A 429 is sent again after its Retry-After, as a client would (the report counts them and the waits).
# Knobs: MODE=omni speaks through streamed chat instead (32 text tokens, then the reply's speech; OUT/chat_load_<policy>),
# CONCURRENCY (default 1,4,8,16), CONFIG (default benchmarks/qwen2_5_omni/small_speech.yaml; defaults.yaml is the
# shipped defaults), N, RATE.
# Usage: benchmarks/qwen2_5_omni/run_speech_load.sh [OUT_DIR [OVERRIDE...]] (default bench_out/; graph overrides
# such as stages.code2wav.params.dit_dtype=float32 go to the server).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out}
shift || true
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-small
PORT=${PORT:-8123}
N=${N:-16}
RATE=${RATE-1}  # RATE= (empty): no Poisson point
POLICIES=${POLICIES:-none queue}
CONFIG=${CONFIG:-benchmarks/qwen2_5_omni/small_speech.yaml}
MODE=${MODE:-speech}
SPEECH=(--mode "$MODE" --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N"
        --concurrency "${CONCURRENCY:-1,4,8,16}" ${RATE:+--request-rate "$RATE"} --min-words 12 --max-words 24
        --max-codec-tokens 384 --num-steps 10 --voice Chelsie --client-buffer 0.5 --baseline none --no-calibration)
NAME=speech_load
if [ "$MODE" = omni ]; then
  SPEECH+=(--max-tokens 32 --min-tokens 32 --thinker-backend native)
  NAME=chat_load
fi
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small "$CKPT"
for policy in $POLICIES; do
  mkdir -p "$OUT/${NAME}_$policy"
  start_server "$OUT/${NAME}_$policy/serve.log" --config "$CONFIG" "playback.admission.policy=$policy" "$@"
  "$BIN/omni-serve" bench "${SPEECH[@]}" --out "$OUT/${NAME}_$policy"
  kill $SERVER; wait $SERVER 2>/dev/null || true
  "$BIN/ray" stop --force > /dev/null 2>&1 || true
done
