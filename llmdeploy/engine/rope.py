"""Rotary position embedding: inverse frequencies exactly as transformers computes them, precomputed into one
float32 cos/sin table indexed by position (the layout of kernels' `rotary_embedding`)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmdeploy.engine.errors import EngineError

# "dynamic" (NTK) equals "default" for every position below max_position_embeddings, which is as far as the
# table goes, so it is exact here; transformers only rescales once a sequence grows past that length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedRopeError(EngineError, ValueError):
    pass


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "rope_type" not in params and "type" in params:  # configs from before transformers 4.45
        params = {**params, "rope_type": params["type"]}
    return {"rope_type": "default", **params}


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim/2] float32, attention scaling applied to cos and sin)."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedRopeError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if rope_type in ("default", "dynamic"):
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def build_cos_sin_cache(
    config: PretrainedConfig, head_dim: int, max_positions: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_positions, head_dim] float32 = cat(cos, sin) of the half dims, times the attention scaling."""
    inv_freq, scaling = rope_inv_freq(config, head_dim)
    # same op order as transformers (float positions x float inv_freq, then cos/sin) so values match bit for bit
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return cache.to(device)
