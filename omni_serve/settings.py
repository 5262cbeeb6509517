"""Every environment variable omni_serve reads, in one place (all named ``OMNI_SERVE_*``)."""

from __future__ import annotations

import os

#: Ray namespace for omni_serve's named actors (the data-plane directory).
RAY_NAMESPACE = os.environ.get("OMNI_SERVE_RAY_NAMESPACE", "omni_serve")
#: Seconds a data-plane payload may wait for its consumer before it is freed.
DATA_TTL_S = float(os.environ.get("OMNI_SERVE_DATA_TTL_S", "120"))
#: tmpfs directory of the shared-memory connector's segments (same node only).
SHM_DIR = os.environ.get("OMNI_SERVE_SHM_DIR", "/dev/shm")
#: Bytes of shared-memory segments one producing process may hold at once (unread payloads + free pool).
SHM_POOL_BYTES = int(os.environ.get("OMNI_SERVE_SHM_POOL_BYTES", str(4 << 30)))
#: API keys of the HTTP API (comma-separated), besides ``ingress.api_keys`` and ``ingress.api_key_file``.
API_KEY_ENV = "OMNI_SERVE_API_KEY"
