#!/usr/bin/env bash
# System packages omni_serve needs beyond Python packages (run by `make setup`; idempotent).
# - libibverbs1: the Mooncake Transfer Engine links it even for TCP (the 'mooncake' and 'mooncake_store'
#   data-plane connectors).
# - iproute2 (`ip`): the multi-node test harness (scripts/multinode_cluster.py) builds its nodes' network
#   namespaces with it; util-linux's `unshare`/`nsenter` come with every Debian/Ubuntu.
# - postgresql (`initdb`, `pg_ctl`): the job store's tests (tests/unit/test_job_store.py) start a throwaway
#   PostgreSQL server of their own (tests/postgres.py); nothing is configured or started here.
# Installed with apt on Debian/Ubuntu when missing.
set -euo pipefail
[[ "$(uname -s)" == Linux ]] || exit 0
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
command -v ip >/dev/null || missing+=(iproute2)
command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
[[ ${#missing[@]} -eq 0 ]] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "omni_serve: ${missing[*]} missing and there is no apt-get; install them with your package manager" \
       "(Mooncake connectors, multi-node tests, job store tests)" >&2
  exit 0
fi
SUDO=""
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "omni_serve: ${missing[*]} missing; run 'apt-get install ${missing[*]}' as root" >&2
    exit 0
  fi
fi
echo "omni_serve: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
