"""The one place a prepared or packed path is chosen over the library module (the rule of docs/prepared.md).

Contract: ``use_prepared(what, wanted, supported, switch, unsupported)`` says whether the prepared path runs: only
when its spec switch is on (``wanted``) and its ``supports()`` guard passed (``supported``). Either way the path is
recorded as ``what`` for ``/health`` (``omni_kernels.record_path``), with the reason when it is the library's:
``"<switch> is false"`` or ``unsupported``.
"""

from __future__ import annotations

from omni_kernels import record_path


def use_prepared(what: str, wanted: bool, supported: bool, switch: str, unsupported: str,
                 prepared_name: str = "prepared") -> bool:
    if not wanted:
        record_path(what, "library", f"{switch} is false")
        return False
    if not supported:
        record_path(what, "library", unsupported)
        return False
    record_path(what, prepared_name)
    return True
