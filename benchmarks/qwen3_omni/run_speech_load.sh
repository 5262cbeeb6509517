#!/usr/bin/env bash
# Speech under load on Qwen3-Omni (docs/speech_under_load.md, docs/benchmarks.md#qwen3-omni-speech-under-load): what
# listeners hear from the `small` checkpoint as the load grows. Serves benchmarks/qwen3_omni/small.yaml on a local
# Ray and speaks N texts as streamed pcm (greedy codec frames, 128 each: 10.24 s of audio) at concurrency 1,4,8,16 and
# as Poisson arrivals at RATE/s (in flight capped by 16), reporting per point TTFP p50/p95/p99, the streams that
# stalled for a 0.5 s client buffer, chunk gaps, RTF after the first chunk and audio seconds per second. Once per
# admission policy:
#   POLICIES="none queue" (default): playback.admission.policy=<policy>         -> OUT/qwen3_speech_load_<policy>
# A 429 is sent again after its Retry-After, as a client would.
# Usage: benchmarks/qwen3_omni/run_speech_load.sh [OUT_DIR [OVERRIDE...]] (default bench_out/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out}
shift || true
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen3_omni-small
PORT=${PORT:-8123}
N=${N:-16}
RATE=${RATE:-1}
POLICIES=${POLICIES:-none queue}
SPEECH=(--graph qwen3_omni --mode speech --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N"
        --concurrency "${CONCURRENCY:-1,4,8,16}" --request-rate "$RATE" --min-words 12 --max-words 24
        --max-codec-tokens 128 --voice Ethan --client-buffer 0.5 --baseline none --no-calibration)
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen3_omni --size small "$CKPT"
for policy in $POLICIES; do
  mkdir -p "$OUT/qwen3_speech_load_$policy"
  start_server "$OUT/qwen3_speech_load_$policy/serve.log" --graph qwen3_omni --config benchmarks/qwen3_omni/small.yaml \
    "playback.admission.policy=$policy" "$@"
  "$BIN/omni-serve" bench "${SPEECH[@]}" --out "$OUT/qwen3_speech_load_$policy"
  kill $SERVER; wait $SERVER 2>/dev/null || true
  "$BIN/ray" stop --force > /dev/null 2>&1 || true
done
