"""Attention/KV/norm ops behind one dispatch point: `get_ops(backend)`.

`torch` is the pure-PyTorch reference (kernels/reference.py, also the CPU path); `triton` are the kernels in
kernels/triton_ops.py with the same function names and signatures. `auto` picks triton on CUDA, torch elsewhere.
"""

from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = ("torch", "triton")


def resolve_backend(requested: str, device_type: str) -> str:
    if requested == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if requested not in BACKENDS:
        raise ValueError(f"unknown kernel backend {requested!r}; expected one of auto, {', '.join(BACKENDS)}")
    return requested


def get_ops(backend: str) -> ModuleType:
    module = {"torch": "llmdeploy.kernels.reference", "triton": "llmdeploy.kernels.triton_ops"}[backend]
    return importlib.import_module(module)
