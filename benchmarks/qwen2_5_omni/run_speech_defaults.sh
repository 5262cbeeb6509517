#!/usr/bin/env bash
# The shipped defaults against the tuned speech configuration (docs/benchmarks.md#defaults-sized-to-the-cluster-machine-e):
# the Qwen2.5-Omni `small` checkpoint served with nothing set but the workload's talker limit (384 codec tokens), once
# with `sizing=off` (the static defaults) -> OUT/defaults_static, once as shipped (sized to the machine) -> OUT/defaults_sized,
# then with benchmarks/qwen2_5_omni/small_speech.yaml -> OUT/defaults_tuned; each speaks N texts as streamed pcm
# (greedy codec tokens) at concurrency 1 and 16 with a 0.5 s client buffer. One server at a time, on a local Ray.
# Usage: benchmarks/qwen2_5_omni/run_speech_defaults.sh [OUT_DIR] (default bench_out/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench_out}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-small
PORT=${PORT:-8123}
N=${N:-16}
SPEECH=(--mode speech --url "http://127.0.0.1:$PORT" --checkpoint "$CKPT" --num-requests "$N" --concurrency 1,16
        --min-words 12 --max-words 24 --max-codec-tokens 384 --num-steps 10 --voice Chelsie
        --client-buffer 0.5 --baseline none --no-calibration)
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/omni_serve_checkpoint.json" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small "$CKPT"
run() {  # NAME SERVE_ARGS...
  local out="$OUT/defaults_$1"; shift
  mkdir -p "$out"
  start_server "$out/serve.log" "$@"
  "$BIN/omni-serve" bench "${SPEECH[@]}" --out "$out"
  kill $SERVER; wait $SERVER 2>/dev/null || true
  "$BIN/ray" stop --force > /dev/null 2>&1 || true
}
DEFAULTS=(--config benchmarks/qwen2_5_omni/defaults.yaml)
run static "${DEFAULTS[@]}" sizing=off
run sized "${DEFAULTS[@]}"
run tuned --config benchmarks/qwen2_5_omni/small_speech.yaml
