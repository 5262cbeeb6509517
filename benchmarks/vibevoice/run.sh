#!/usr/bin/env bash
# The VibeVoice speech benchmark, end to end, on the `small` checkpoint (the numbers:
# docs/benchmarks.md#vibevoice-speech): serve the graph with benchmarks/vibevoice/small.yaml on a local Ray; N
# (default 16) seeded texts of 12-24 words in the preset voice alice, each with its own seed, streamed as pcm from
# POST /v1/audio/speech at each concurrency of CONCURRENCY (default 1,8). Then stop the server and have transformers'
# VibeVoiceForConditionalGeneration.generate speak the same texts, voice and seeds one at a time with the served
# max_speech_seconds as its max_new_tokens, on one thread (its fastest: THREADS; same command, quiet machine, the
# stage's OpenMP settings), for the ratios; then (still quiet) time the lm stage alone at batch 1, 4 (a replica's
# share of 8) and 8 for the compute ceiling and set the run against it (OUT/ceiling.json).
# Usage: benchmarks/vibevoice/run.sh [OUT_DIR] (default bench_out/vibevoice). Takes ~8 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out/vibevoice}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/vibevoice-small
CONFIG=benchmarks/vibevoice/small.yaml
PORT=${PORT:-8128}
N=${N:-16}
CONCURRENCY=${CONCURRENCY:-1,8}
THREADS=${THREADS:-1}  # generate's best here: 2 threads ran it 3-4x slower on this shared box (small.yaml)
MAX_SPEECH_S=$(sed -n 's/^max_speech_seconds: *\([0-9.]*\).*/\1/p' "$CONFIG")  # the served bound: the baseline's too
source benchmarks/tools/serve_lib.sh

[ -d "$CKPT/voices" ] || "$BIN/omni-serve" make-checkpoint vibevoice --size small "$CKPT"
mkdir -p "$OUT"
start_server "$OUT/serve.log" --graph vibevoice --config "$CONFIG"
# the baseline gets the served stage's OpenMP settings (omni_serve.graph.spec.STAGE_ENV)
OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 "$BIN/omni-serve" bench --graph vibevoice --mode speech \
  --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" --concurrency "$CONCURRENCY" \
  --voice alice --max-speech-seconds "$MAX_SPEECH_S" --warmup 2 --threads "$THREADS" --stop-server-pid $SERVER \
  --out "$OUT"
wait $SERVER 2>/dev/null || true
OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 "$BIN/python" benchmarks/vibevoice/ceiling.py "$CKPT" \
  --config "$CONFIG" --batch "${CONCURRENCY##*,}" --bench-report "$OUT/speech_bench_report.json" \
  --out "$OUT/ceiling.json"
