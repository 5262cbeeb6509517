#!/usr/bin/env bash
# System libraries omni_serve needs beyond Python packages (run by `make setup`; idempotent).
# - libibverbs1: the Mooncake Transfer Engine links it even for TCP (the 'mooncake' and 'mooncake_store'
#   data-plane connectors). Installed with apt on Debian/Ubuntu when missing.
set -euo pipefail
[[ "$(uname -s)" == Linux ]] || exit 0
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "omni_serve: libibverbs1 is missing and there is no apt-get; install it with your package manager" \
       "to use the Mooncake connectors" >&2
  exit 0
fi
SUDO=""
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "omni_serve: libibverbs1 is missing; run 'apt-get install libibverbs1' as root for the Mooncake connectors" >&2
    exit 0
  fi
fi
echo "omni_serve: installing libibverbs1 (Mooncake Transfer Engine dependency)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
