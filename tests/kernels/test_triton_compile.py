"""Every Triton kernel compiles for Hopper (sm_90) without a GPU, with no register spills.

The interpreter runs kernels as Python, so it cannot catch what only the compiler rejects (dot shapes, dtype
mismatches, constexpr misuse). This compiles them ahead of time with Triton's bundled CUDA toolchain, in a
subprocess without TRITON_INTERPRET (kernels decorated under the interpreter cannot be compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POINTERS_I32 = {"BlockTables", "ContextLens", "CuSeqlensQ"}
POINTERS_I64 = {"SlotMapping", "Positions"}
POINTERS_F32 = {"PartOut", "PartLse", "CosSin"}
FLOATS = {"scale_log2", "eps"}


def compile_kernel(fn, dtype: str, constexprs: dict, **options) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name[0].isupper():  # tensors are the capitalised arguments
            kind = (
                "i32"
                if name in POINTERS_I32
                else "i64"
                if name in POINTERS_I64
                else "fp32"
                if name in POINTERS_F32
                else dtype
            )
            signature[name], attrs[(i,)] = f"*{kind}", [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:  # strides and sizes: the JIT specialises multiples of 16 the same way
            signature[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    kernel = triton.compile(
        ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options
    )
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = "LOCAL:-1"  # no resource report: fails the spill check rather than passing it silently
    if cuobjdump.exists():
        cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"llmdeploy-{os.getpid()}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
        ).stdout
        cubin.unlink()
    local = [int(tok.split(":")[1]) for tok in usage.split() if tok.startswith("LOCAL:")]
    return dict(
        kernel=fn.__name__, dtype=dtype, shared=kernel.metadata.shared, local_bytes=max(local, default=0)
    )


def dot_meta(dtype: str) -> dict:
    return dict(UPCAST=False, PRECISION="ieee" if dtype == "fp32" else "tf32")


def compile_all() -> list[dict]:
    from llmdeploy.kernels.triton_decode import _decode_kernel, _merge_kernel
    from llmdeploy.kernels.triton_kv import _store_kv_kernel
    from llmdeploy.kernels.triton_norm import _rms_norm_kernel, _rotary_kernel
    from llmdeploy.kernels.triton_prefill import _prefill_kernel

    out = []
    decode = [
        (128, 128, 8, True, "bf16"),
        (80, 128, 1, False, "bf16"),
        (64, 64, 4, True, "bf16"),
        (128, 128, 4, False, "fp32"),
    ]
    for head_dim, block_d, group, split, dtype in decode:
        meta = dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_H=16, BLOCK_D=block_d, PAGE=16, BLOCK_N=64, SPLIT=split
        )
        out.append(
            compile_kernel(_decode_kernel, dtype, {**meta, **dot_meta(dtype)}, num_warps=4, num_stages=2)
        )
    out.append(compile_kernel(_merge_kernel, "bf16", dict(HEAD_DIM=96, BLOCK_D=128, BLOCK_S=32)))
    for head_dim, block_d, block_m, dtype in (
        (128, 128, 64, "bf16"),
        (96, 128, 16, "bf16"),
        (64, 64, 64, "fp32"),
    ):
        meta = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=32, BLOCK_M=block_m, BLOCK_N=64)
        out.append(
            compile_kernel(_prefill_kernel, dtype, {**meta, **dot_meta(dtype)}, num_warps=8, num_stages=2)
        )
    heads = dict(NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=16, BLOCK_H=8, BLOCK_D=128)
    out.append(compile_kernel(_store_kv_kernel, "bf16", heads, num_warps=4))
    out.append(
        compile_kernel(
            _rms_norm_kernel, "bf16", dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True), num_warps=16
        )
    )
    rope = dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HALF=64, BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=64)
    out.append(compile_kernel(_rotary_kernel, "bf16", rope, num_warps=4))
    return out


@pytest.mark.full  # 14 s of ptxas for a GPU this machine lacks: CI's time budget (scripts/test.sh -m full)
def test_kernels_compile_for_sm90_without_spills():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 11
    spilled = [r for r in results if r["local_bytes"] != 0]
    assert not spilled, f"register spills: {spilled}"
    assert all(r["shared"] <= 227 * 1024 for r in results)  # fits an H100/H200 SM


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(compile_all()))
