#!/usr/bin/env bash
# The GPU check (docs/gpu.md): what a session with a lent GPU runs in one go; `make test` runs it on CPU with
# --dry-run so that it never rots.
#   scripts/gpu_check.sh [--dry-run] [--out DIR] [--batches 1,8,32] [--size tiny|small]
# On the GPU machine (its own python3 and CUDA torch; no .venv, no Ray): installs the wheels `make gpu-wheels`
# put in gpu-wheels/ (carried along; pip keeps the machine's torch), then runs
# omni_serve.bench.gpu_check: every gpu-marked test, one DiT step and one AR decode step timed at batch 1/8/32,
# and DIR/gpu_check.json (default gpu_check_out/). Exits non-zero when a test failed or a timing could not be taken.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
dry=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry=1; done
if [ "$dry" = 0 ]; then
  if [ -f gpu-wheels/requirements.txt ]; then
    # pip resolves against what the machine has: its torch and numpy stay, a dependency missing or too old there
    # comes from the carried wheels, and one that is in neither fails here, before anything runs.
    echo "installing the carried wheels (gpu-wheels/, resolved against the machine's own packages)"
    "$PY" -m pip install --quiet --no-index --find-links gpu-wheels -r gpu-wheels/requirements.txt
  else
    echo "no gpu-wheels/ here (make gpu-wheels, then carry it): using what $PY has"
  fi
fi
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m omni_serve.bench.gpu_check "$@"
