"""The AVX-512 and AMX kernels tested on any CPU: the kernel tests run again against a build whose AVX-512
F/BW/VL/VNNI/BF16 intrinsics are emulated in portable C (SIMDe, tests/kernels/emulated/) and whose AMX tiles are
emulated as Intel defines them (emulated/amx_tiles.h: a tile shape the hardware would refuse aborts), so a change to
that code is checked on an AVX2-only or AMX-less machine too instead of waiting for a session on one that has it (the
CPU changes between sessions). A second build emulates AVX-512 F/BW/VL/VNNI without BF16 or AMX (Skylake-SP, Cascade
Lake, Ice Lake: the AVX-512 CPUs most clouds rent), whose code paths no AMD or AMX CPU runs. Correctness only: the
emulated kernels run 10-100x slower than native ones.
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
    # the AMX tests last: they set the AMX row threshold, which the others run without (their bf16 linears stay on
    # vdpbf16ps at every row count, as on AMX-less CPUs)
    for name in (
        "test_cpu_native.py",
        "test_prefill_attention.py",
        "test_quant_kernels.py",
        "test_head_screen.py",
        "test_amx_linear.py",
    )
]
NOT_EMULATED = [
    # asks torch's oneDNN whether this CPU has bf16 (AMX), which emulated kernels do not change
    f"{KERNEL_TESTS}/test_cpu_native.py::test_packed_bf16_linear_unpacks_and_matches_onednn[True]",
    # build for other targets (-march=x86-64, haswell), which the emulating compiler passes through unchanged:
    # the same run as in the plain suite, and half of this test's time (~40 s)
    f"{KERNEL_TESTS}/test_cpu_native.py::test_argmax_rows_other_builds_agree",
    f"{KERNEL_TESTS}/test_cpu_native.py::test_portable_build_without_avx2_agrees",
]


# what each emulated build may skip: nothing for want of AVX-512, VNNI or AMX with every extension; only what needs
# BF16 or AMX (and the int8 kernel another one replaces) without them
ALLOWED_SKIPS = {
    "all": re.compile(r"^(?!.*(AVX-512|VNNI|AMX))"),
    "avx512": re.compile(r"BF16|AMX|another kernel runs the int8 products"),
}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc, the native kernels' compiler")
@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="the emulated build is compiled for AVX2 + FMA + F16C"
)
@pytest.mark.skipif(
    not SIMDE.is_file(), reason="needs SIMDe's headers (Debian: apt-get install libsimde-dev)"
)
@pytest.mark.parametrize("variant", ALLOWED_SKIPS)
def test_kernel_tests_pass_with_avx512_emulated(tmp_path, variant):
    env = {
        **os.environ,
        "CC": str(EMULATED / "cc"),
        "LLMD_EMULATE": variant,
        "LLMDEPLOY_CACHE_DIR": str(tmp_path),  # the build key does not see CC: keep the native build apart
        "LLMDEPLOY_NATIVE_KERNELS": "1",
        "LLMDEPLOY_AMX_MIN_ROWS": "0",
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TEST_FILES]
    cmd += [arg for test in NOT_EMULATED for arg in ("--deselect", test)]
    proc = subprocess.run(
        cmd, cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=900
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", proc.stdout, flags=re.MULTILINE)
    assert all(ALLOWED_SKIPS[variant].search(reason) for reason in skips), report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed[1]) > 250, report
    if variant == "avx512":  # the build really lacks BF16: its bf16 kernels' tests were skipped
        assert any("BF16" in reason for reason in skips), report


AMX_PROBE = r"""
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include "amx_tiles.h"
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static uint16_t bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }
int main(int argc, char **argv) {
    cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
    const int rows_a = argc > 1 ? 3 : 2; /* "bad": A's 3 rows against C's 2: TDPBF16PS must fault */
    c.rows[0] = 2; c.colsb[0] = 8;        /* C: 2 x 2 float32 */
    c.rows[1] = rows_a; c.colsb[1] = 8;   /* A: rows x 2 pairs of bf16 */
    c.rows[2] = 2; c.colsb[2] = 8;        /* B: 2 pair-rows x 2 columns */
    _tile_loadconfig(&c);
    uint16_t a[3][4], b[2][4];
    const float av[3][4] = {{1, 2, 3, 4}, {0.5f, -1, 2, 8}, {0, 0, 0, 0}};
    const float bv[2][4] = {{1, 10, 100, 1000}, {-1, 0.25f, 4, -2}};
    for (int i = 0; i < 12; i++) a[i / 4][i % 4] = bf16(av[i / 4][i % 4]);
    for (int i = 0; i < 8; i++) b[i / 4][i % 4] = bf16(bv[i / 4][i % 4]);
    float out[2][2] = {{0.5f, 0}, {0, 0}};
    _tile_loadd(0, out, 8); _tile_loadd(1, a, 8); _tile_loadd(2, b, 8);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, out, 8);
    _tile_release();
    printf("%g %g %g %g\n", out[0][0], out[0][1], out[1][0], out[1][1]);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_emulated_amx_computes_tdpbf16ps_and_refuses_what_the_hardware_would(tmp_path):
    """The emulation the AMX tests trust: C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], and a tile
    shape TDPBF16PS would #UD on aborts with the reason instead of computing something."""
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(AMX_PROBE)
    subprocess.run(["gcc", "-O1", f"-I{EMULATED}", str(src), "-o", str(exe)], check=True, timeout=60)
    ok = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    # row 0: 0.5 + 1*1 + 2*10 + 3*(-1) + 4*0.25 = 19.5; 1*100 + 2*1000 + 3*4 + 4*(-2) = 2104
    # row 1: 0.5*1 + (-1)*10 + 2*(-1) + 8*0.25 = -9.5; 0.5*100 + (-1)*1000 + 2*4 + 8*(-2) = -958
    assert [float(v) for v in ok.stdout.split()] == [19.5, 2104.0, -9.5, -958.0]
    bad = subprocess.run([str(exe), "bad"], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "#UD: TDPBF16PS shapes do not fit" in bad.stderr
