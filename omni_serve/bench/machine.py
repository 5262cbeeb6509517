"""Which machine and which kernel paths a benchmark ran on, so numbers from AVX2, AVX-512 and AMX CPUs are never
compared blind.

Contract: ``machine_info(url)`` returns ``{"cpu": ..., "stages": ...}``: ``cpu`` is this process' CPU as
``omni_kernels.cpu_capability()`` sees it (ISA, bfloat16/AMX instructions, whether the prepacked product runs in
float32 and bfloat16, and why not); ``stages`` maps each stage of the server at ``url`` (its ``/health``) to the
kernel paths its replica took (``omni_kernels.kernel_paths()``: e.g. ``linear.bfloat16`` -> the prepacked oneDNN
product, or ``F.linear`` with the reason). A server that cannot be reached leaves ``stages`` empty and says why
under ``stages_error``; the bench goes on. ``describe(info)`` summarises it in a few lines, ``machine_section(info)``
as the closing section of a report's table.
"""

from __future__ import annotations

from typing import Any


def machine_info(url: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    from omni_kernels import cpu_capability

    info: dict[str, Any] = {"cpu": cpu_capability().as_dict(), "stages": {}}
    if url:
        import httpx

        try:
            stages = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).json().get("stages", {})
            info["stages"] = {name: s.get("kernels", {}).get("paths", {}) for name, s in stages.items()}
        except (httpx.HTTPError, ValueError) as exc:
            info["stages_error"] = f"{type(exc).__name__}: {exc}"
    return info


def describe(info: dict[str, Any] | None) -> str:
    """One line for the CPU and one per stage that recorded kernel paths ("" without ``info``)."""
    if not info:
        return ""
    cpu = info["cpu"]
    packed = ", ".join(f"{dtype} {'yes' if ok else 'no'}" for dtype, ok in cpu["packed"].items())
    lines = [f"cpu: {cpu['cpu_name'] or 'unknown'}, ATen ISA {cpu['isa']}, avx512_bf16 "
             f"{'yes' if cpu['avx512_bf16'] else 'no'}, AMX {'yes' if cpu['amx'] else 'no'}; prepacked products: "
             f"{packed}" + (f" (ONEDNN_MAX_CPU_ISA={cpu['onednn_max_cpu_isa']})" if cpu["onednn_max_cpu_isa"] else "")]
    for stage, paths in sorted(info.get("stages", {}).items()):
        if paths:
            lines.append(f"stage {stage}: " + "; ".join(
                f"{what} -> {p['path']}" + (f" ({p['reason']})" if p.get("reason") else "")
                for what, p in sorted(paths.items())))
    if info.get("stages_error"):
        lines.append(f"stage kernel paths unknown: {info['stages_error']}")
    return "\n".join(lines)


def machine_section(info: dict[str, Any] | None) -> list[str]:
    """The report table's closing "Machine and kernel paths" lines (none without ``info``)."""
    text = describe(info)
    return ["", "Machine and kernel paths", *(f"  {line}" for line in text.splitlines())] if text else []
