"""The AVX-512 kernels tested on any CPU: the kernel tests run again against a build whose AVX-512 F/BW/VL/VNNI/BF16
intrinsics are emulated in portable C (SIMDe, tests/kernels/emulated/), so a change to the AVX-512 code is checked
on an AVX2-only machine too instead of waiting for a session on an AVX-512 one (the CPU changes between sessions).
Correctness only: the emulated kernels run 10-100x slower than native ones.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmdeploy.engine.cpu_dtype import cpu_flags

EMULATED = Path(__file__).with_name("emulated")
SIMDE = Path("/usr/include/simde/x86/avx512.h")
KERNEL_TESTS = Path(__file__).relative_to(Path(__file__).parents[2]).parent
TEST_FILES = [
    f"{KERNEL_TESTS}/{name}"
    for name in ("test_cpu_native.py", "test_prefill_attention.py", "test_quant_kernels.py")
]
NOT_EMULATED = [
    # asks torch's oneDNN whether this CPU has bf16 (AMX), which emulated kernels do not change
    f"{KERNEL_TESTS}/test_cpu_native.py::test_packed_bf16_linear_unpacks_and_matches_onednn[True]",
    # build for other targets (-march=x86-64, haswell), which the emulating compiler passes through unchanged:
    # the same run as in the plain suite, and half of this test's time (~40 s)
    f"{KERNEL_TESTS}/test_cpu_native.py::test_argmax_rows_other_builds_agree",
    f"{KERNEL_TESTS}/test_cpu_native.py::test_portable_build_without_avx2_agrees",
]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc, the native kernels' compiler")
@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="the emulated build is compiled for AVX2 + FMA + F16C"
)
@pytest.mark.skipif(
    not SIMDE.is_file(), reason="needs SIMDe's headers (Debian: apt-get install libsimde-dev)"
)
def test_kernel_tests_pass_with_avx512_emulated(tmp_path):
    env = {
        **os.environ,
        "CC": str(EMULATED / "cc"),
        "LLMDEPLOY_CACHE_DIR": str(tmp_path),  # the build key does not see CC: keep the native build apart
        "LLMDEPLOY_NATIVE_KERNELS": "1",
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TEST_FILES]
    cmd += [arg for test in NOT_EMULATED for arg in ("--deselect", test)]
    proc = subprocess.run(
        cmd, cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=900
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    # the AVX-512 paths ran: nothing skipped for want of AVX-512, BF16 or VNNI
    assert not re.search(r"SKIPPED .*(AVX-512|VNNI)", proc.stdout), report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed[1]) > 250, report
