#!/usr/bin/env bash
# The issue-7 soak and overload runs (docs/reliability.md has the numbers), each on its own server:
#   1. steady: the default Omni graph on the tiny checkpoint, 4 closed-loop speech clients for SOAK_MINUTES
#      (10), replica RSS / object store / shm sampled every 10 s, growth after a 2-minute warm-up;
#   2. overload: the same graph admitting 8 requests per ingress replica, 48 clients that retry at once on
#      a 429 for OVERLOAD_MINUTES (4): offered load far above capacity; answers 429 and memory stays flat.
# The talker is capped at 256 codec tokens (5 s of audio): the random tiny model never emits its stop code,
# so the default 1024 makes every request take ~30 s here and a 10-minute run holds few requests.
# Usage: benchmarks/tools/run_soak.sh [OUT_DIR] (default soak_out/). Takes ~18 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-soak_out}
BIN=${VENV:-.venv}/bin
CKPT=checkpoints/qwen2_5_omni-tiny
PORT=${PORT:-8124}
source benchmarks/tools/serve_lib.sh

[ -f "$CKPT/spk_dict.pt" ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size tiny "$CKPT"
mkdir -p "$OUT"
ARGS=(checkpoint=$CKPT stages.talker.params.max_codec_tokens=256 sizing=off)  # one replica per stage

start_server "$OUT/serve_steady.log" "${ARGS[@]}"
"$BIN/python" benchmarks/tools/soak.py --url "http://127.0.0.1:$PORT" --minutes "${SOAK_MINUTES:-10}" \
  --warmup-minutes 2 --concurrency 4 --out "$OUT/steady" | tee "$OUT/steady.txt" || echo "steady: requests failed"
kill $SERVER; wait $SERVER 2>/dev/null || true

start_server "$OUT/serve_overload.log" "${ARGS[@]}" ingress.max_inflight_requests=8
"$BIN/python" benchmarks/tools/soak.py --url "http://127.0.0.1:$PORT" --minutes "${OVERLOAD_MINUTES:-4}" \
  --warmup-minutes 1 --concurrency 48 --retry-wait 0 --out "$OUT/overload" | tee "$OUT/overload.txt" || echo "overload: requests failed"
