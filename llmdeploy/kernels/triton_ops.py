"""Triton kernels behind the op names and signatures of kernels/reference.py (see docs/CONTRACTS.md §1).

They run compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set before this module is
imported), which is how CI checks them against the reference.
"""

from __future__ import annotations

from llmdeploy.kernels.triton_decode import decode_attention
from llmdeploy.kernels.triton_kv import store_kv
from llmdeploy.kernels.triton_norm import rms_norm, rotary_embedding
from llmdeploy.kernels.triton_prefill import prefill_attention

__all__ = ["store_kv", "paged_attention_decode", "paged_prefill_attention", "rms_norm", "rotary_embedding"]

# The launchers take the contract's arguments first, in its order, then tuning knobs (bench/gpu_kernels.py):
# decode with split-K chosen by size, prefill as causal chunks back to back over the paged cache.
paged_attention_decode = decode_attention
paged_prefill_attention = prefill_attention
