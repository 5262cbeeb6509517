#!/usr/bin/env bash
# Cross-node benchmarks on the multi-node harness (scripts/multinode_cluster.py; root), in one invocation:
#   1. the data plane between two nodes (producer on worker1, consumer on worker2) and within one (both on worker1),
#      each connector at 1, 16 and 64 MiB against memcpy                               -> OUT/transport_{cross,same}
#   2. Qwen2.5-Omni (small checkpoint) with its stages spread over two nodes, then on one node  -> OUT/omni_{spread,one-node}
#   3. Qwen-Image (small checkpoint), the same two layouts                             -> OUT/image_{spread,one-node}
# Every node shares this machine's cores: the layouts differ in how data moves, not in compute (docs/multinode.md).
# Usage: benchmarks/multinode/run.sh [OUT_DIR] (default bench_multinode/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:-bench_multinode}")
BIN=${VENV:-.venv}/bin
PY=$PWD/$BIN/python
HARNESS="$PY scripts/multinode_cluster.py"
N=${N:-8}
mkdir -p "$OUT"
[ -f checkpoints/qwen2_5_omni-small/spk_dict.pt ] || "$BIN/omni-serve" make-checkpoint qwen2_5_omni --size small checkpoints/qwen2_5_omni-small
[ -f checkpoints/qwen_image-small/omni_serve_checkpoint.json ] || "$BIN/omni-serve" make-checkpoint qwen_image --size small checkpoints/qwen_image-small

$HARNESS down
trap '$HARNESS down' EXIT
$HARNESS up --workers 2 --python "$PY" --resources '[{"omni_ingress": 10}, {"omni_a": 10}, {"omni_b": 10}]'
HEAD=10.77.0.10 W1=10.77.0.11 W2=10.77.0.12

for pair in "cross $W2" "same $W1"; do
  set -- $pair
  backends=mooncake,mooncake_store,ray,nearest
  [ "$1" = same ] && backends=shm,$backends
  $HARNESS exec head -- "$PWD/$BIN/omni-serve" bench transport --address "$HEAD:6379" --producer-node "$W1" \
    --consumer-node "$2" --backends "$backends" --sizes 1MiB,16MiB,64MiB --out "$OUT/transport_$1"
done

for layout in spread one-node; do
  $PY benchmarks/multinode/deploy_layout.py qwen2_5_omni benchmarks/qwen2_5_omni/small.yaml "$layout"
  "$BIN/omni-serve" bench --url "http://$HEAD:8000" --checkpoint checkpoints/qwen2_5_omni-small --num-requests "$N" \
    --concurrency 1,4 --max-tokens 32 --min-tokens 32 --max-codec-tokens 384 --num-steps 10 --baseline none \
    --out "$OUT/omni_$layout"
  $HARNESS exec head -- "$PY" -c "import ray; from ray import serve; ray.init('$HEAD:6379'); serve.delete('qwen2_5_omni')"
done

for layout in spread one-node; do
  $PY benchmarks/multinode/deploy_layout.py qwen_image benchmarks/qwen_image/small.yaml "$layout"
  "$BIN/omni-serve" bench --mode image --url "http://$HEAD:8000" --checkpoint checkpoints/qwen_image-small \
    --num-requests "$N" --concurrency 1,4 --size 128x128 --steps 20 --baseline none --cache-modes none \
    --out "$OUT/image_$layout"
  $HARNESS exec head -- "$PY" -c "import ray; from ray import serve; ray.init('$HEAD:6379'); serve.delete('qwen_image')"
done
echo "reports in $OUT"
