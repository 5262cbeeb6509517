#!/usr/bin/env bash
# The Qwen3-ASR transcription benchmark, end to end, on the `small` checkpoint (the numbers:
# docs/benchmarks.md#qwen3-asr-transcription): serve the graph with benchmarks/qwen3_asr/small.yaml on a local Ray;
# N (default 32) seeded clips of AUDIO_S (default 10) seconds, language forced (en), uploaded to
# POST /v1/audio/transcriptions with stream=true at each concurrency of CONCURRENCY (default 1,8); then the first
# 8 again as verbose_json (not timed) for their window tokens. Then stop the server and run transformers'
# Qwen3ASRForConditionalGeneration.generate one request at a time on the same clips, on THREADS (default 2) torch
# threads with the stages' OpenMP settings (same command, quiet machine), for the ratios and the agreement; then
# (still quiet) time each stage alone for the compute ceiling and set the run against it (OUT/ceiling.json).
# Usage: benchmarks/qwen3_asr/run.sh [OUT_DIR] (default bench_out/qwen3_asr). Takes ~4 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out/qwen3_asr}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen3_asr-small
CONFIG=benchmarks/qwen3_asr/small.yaml
PORT=${PORT:-8127}
N=${N:-32}
AUDIO_S=${AUDIO_S:-10}
CONCURRENCY=${CONCURRENCY:-1,8}
THREADS=${THREADS:-2}
MAX_TOKENS=$(sed -n 's/^max_tokens: *\([0-9]*\).*/\1/p' "$CONFIG")  # the served max_tokens: the baseline's too
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen3_asr --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --graph qwen3_asr --config "$CONFIG"
# the baseline gets the served stages' OpenMP settings (omni_serve.graph.spec.STAGE_ENV): on a shared machine two
# spinning OpenMP threads make one generate call up to 20x slower now and then, which would flatter the engine
OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 "$BIN/omni-serve" bench --mode transcription \
  --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" --concurrency "$CONCURRENCY" \
  --audio-seconds "$AUDIO_S" --language en --max-tokens "$MAX_TOKENS" --threads "$THREADS" \
  --stop-server-pid $SERVER --out "$OUT"
wait $SERVER 2>/dev/null || true
"$BIN/python" benchmarks/qwen3_asr/ceiling.py "$CKPT" --audio-seconds "$AUDIO_S" --max-tokens "$MAX_TOKENS" \
  --batch "${CONCURRENCY##*,}" --config "$CONFIG" --bench-report "$OUT/transcription_bench_report.json" \
  --out "$OUT/ceiling.json"
