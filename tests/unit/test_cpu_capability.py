"""``omni_kernels.capability``: the CPU's answer is the one its instruction sets imply, and every bfloat16/prepacked
path follows it.

The oracle (``expected_packed_bfloat16``) reads ``/proc/cpuinfo`` and ``ONEDNN_MAX_CPU_ISA`` itself, apart from
torch and oneDNN: where the CPU has the instructions and the capability says no (the fallback taken on a CPU that
runs the fast path), or the other way round, the test fails. ``test_fallback_paths_pass_on_a_cpu_capped_to_avx2``
runs the per-capability tests again in a process whose oneDNN and ATen are capped to AVX2 (``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``), so both branches run on every machine: the fast path where the CPU has it, the fallback
always.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest
import torch

from omni_kernels import (PackedLinear, cpu_capability, kernel_paths, pack_linears, packing_supported,
                          packing_unsupported_reason)
from omni_kernels.capability import record_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# oneDNN's ISA caps below AVX512_CORE (its bfloat16 products need AVX-512 BW/VL/DQ, or AVX2_VNNI_2's AVX-NE-CONVERT)
_CAPS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI"}


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def expected_packed_bfloat16() -> bool:
    """Whether oneDNN should run bfloat16 products here, from the CPU's flags and the ISA cap alone."""
    flags = cpu_flags()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    ne_convert = "avx_ne_convert" in flags
    if cap in _CAPS_WITHOUT_BF16:
        return False
    if cap == "AVX2_VNNI_2":
        return ne_convert
    return avx512 or ne_convert


x86_linux = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"),
                               reason="the flag oracle reads x86-64 flags from Linux's /proc/cpuinfo")


@x86_linux
def test_the_capability_is_what_the_cpu_flags_imply():
    cap = cpu_capability()
    assert cap.packed["float32"], cap.unsupported  # oneDNN runs float32 products on every x86-64 CPU
    assert cap.packed["bfloat16"] == expected_packed_bfloat16(), (sorted(cpu_flags() & {
        "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx_ne_convert"}), cap)
    assert packing_supported(torch.bfloat16) == cap.packed["bfloat16"]
    assert (packing_unsupported_reason(torch.bfloat16) is None) == cap.packed["bfloat16"]
    assert packing_unsupported_reason(torch.float16) is not None and not packing_supported(torch.float64)
    if "ONEDNN_MAX_CPU_ISA" in os.environ:
        assert cap.onednn_max_cpu_isa == os.environ["ONEDNN_MAX_CPU_ISA"]
        if not cap.packed["bfloat16"]:
            assert "ONEDNN_MAX_CPU_ISA" in cap.unsupported["bfloat16"]


@x86_linux
def test_auto_precision_picks_bfloat16_only_where_the_cpu_runs_it_faster():
    """``dit_dtype: auto`` (Qwen2.5-Omni's code2wav): bfloat16 exactly where oneDNN's bfloat16 product runs and
    the CPU has native bfloat16 dot products (flags ``avx512_bf16`` or ``amx_bf16``), else float32 with the reason;
    the choice is a kernel path. Capped to AVX2 (the run below) it is float32 on every machine."""
    from omni_kernels import bfloat16_slow_reason
    from omni_serve.families.qwen2_5_omni.replica.runners import dit_dtype

    fast = expected_packed_bfloat16() and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    assert (bfloat16_slow_reason() is None) == fast, (cpu_capability(), bfloat16_slow_reason())
    assert dit_dtype("auto", "cpu") == (torch.bfloat16 if fast else torch.float32)
    chosen = kernel_paths()["code2wav.dit_dtype"]
    assert chosen["path"] == ("bfloat16" if fast else "float32") and ("reason" in chosen) != fast, chosen
    assert dit_dtype("float32", "cpu") == torch.float32 and dit_dtype("bfloat16", "cpu") == torch.bfloat16
    assert dit_dtype("auto", "cuda") == torch.float32  # not measured on GPUs yet


def test_bfloat16_linears_take_the_path_the_cpu_supports():
    """Prepacked where the CPU runs it (and recorded so), else left as ``nn.Linear``, recorded with the reason; both
    compute what the layer computed before. ``PackedLinear`` refuses what the CPU cannot run, saying why."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16)).to(torch.bfloat16)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x).float()
        supported = packing_supported(torch.bfloat16)
        assert pack_linears(model) == (2 if supported else 0)
        assert isinstance(model[0], PackedLinear) == supported
        got = model(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02)
    path = kernel_paths()["linear.bfloat16"]
    assert path["path"].startswith("prepacked" if supported else "F.linear")
    assert ("reason" in path) == (not supported)
    if not supported:
        with pytest.raises(ValueError, match="cannot prepack a torch.bfloat16 weight here"):
            PackedLinear(torch.nn.Linear(4, 4).to(torch.bfloat16), 8)


def test_a_path_is_logged_once_and_a_change_is_recorded(caplog):
    with caplog.at_level("INFO", logger="omni_kernels.capability"):
        record_path("test.component", "fast")
        record_path("test.component", "fast")
        record_path("test.component", "slow", "because")
    assert [r.getMessage() for r in caplog.records] == ["test.component: fast",
                                                        "test.component: slow (because)"]
    assert caplog.records[1].levelname == "WARNING"
    assert kernel_paths()["test.component"] == {"path": "slow", "reason": "because"}


def test_the_bench_report_names_the_cpu_and_the_stages_paths():
    from omni_serve.bench.machine import describe, machine_info, machine_section

    info = machine_info()
    assert info["cpu"]["isa"] == torch.backends.cpu.get_cpu_capability() and info["stages"] == {}
    info["stages"] = {"code2wav": {"linear.bfloat16": {"path": "F.linear (plain library product)", "reason": "no"}}}
    text = describe(info)
    assert f"ATen ISA {info['cpu']['isa']}" in text and "bfloat16 " in text
    assert "stage code2wav: linear.bfloat16 -> F.linear (plain library product) (no)" in text
    assert machine_section(info)[1] == "Machine and kernel paths" and machine_section(None) == []
    unreachable = machine_info("http://127.0.0.1:9", timeout_s=2)  # nothing listens on the discard port
    assert unreachable["stages"] == {} and unreachable["stages_error"]


# The per-capability tests, run again on an AVX2-capped CPU. ATen's cap also makes its own kernels take their
# AVX2 versions; oneDNN's makes its bfloat16 product unavailable, as on an AVX2-only machine.
CAPPED = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
CAPPED_TESTS = [
    "tests/unit/test_cpu_capability.py::test_the_capability_is_what_the_cpu_flags_imply",
    "tests/unit/test_cpu_capability.py::test_bfloat16_linears_take_the_path_the_cpu_supports",
    "tests/unit/test_cpu_capability.py::test_auto_precision_picks_bfloat16_only_where_the_cpu_runs_it_faster",
    "tests/unit/test_kernels.py",
    "tests/unit/test_code2wav_stream.py::test_bfloat16_dit_blocks_stay_close_to_float32",
    "tests/unit/test_prepared_decoder.py",
]


@x86_linux
@pytest.mark.skipif(os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2", reason="this process is the capped run itself")
def test_fallback_paths_pass_on_a_cpu_capped_to_avx2():
    env = {**os.environ, **CAPPED}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CAPPED_TESTS],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = re.search(r"(\d+) passed", run.stdout)
    assert summary and int(summary.group(1)) >= 20, tail
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("CUDA" in line for line in skips), skips  # only GPU tests skip; every fallback test ran
