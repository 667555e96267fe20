"""Launch helpers shared by the Triton kernels: interpreter detection, dot precision, device facts."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def interpreting(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (decided at import, not per call)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU ones. Say which is missing."""
    if interpreting(kernel):
        return
    for t in tensors:
        if t.device.type != "cuda":
            raise RuntimeError(
                f"triton kernels need CUDA tensors (got {t.device}); run on a GPU, use kernel_backend='torch', "
                "or set TRITON_INTERPRET=1 before importing llmdeploy.kernels.triton_ops to run them on CPU"
            )


def dot_args(kernel: object, dtype: torch.dtype) -> dict:
    """Constexprs for tl.dot: fp32 inputs use exact (ieee) products, not tf32, so fp32 matches the reference;
    the interpreter's bf16/fp16 matmul is wrong, so there the operands are upcast to fp32 first."""
    upcast = interpreting(kernel) and dtype in (torch.bfloat16, torch.float16)
    return {"UPCAST": upcast, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def head_block(n: int) -> int:
    """Register tile for a head-dim (or head-count) axis: a power of two, at least 16 for tl.dot."""
    return max(16, triton.next_power_of_2(n))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in on CPU (the interpreter) so heuristics still split."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)
