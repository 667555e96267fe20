"""The command line of one engine process (`python -m llmdeploy.engine ...`) for a revision's spec."""

from __future__ import annotations

import sys

from llmdeploy.spec.models import DeploymentSpec

ENGINE_BODY_FACTOR = 4  # the router re-encodes bodies with \u escapes: up to ~3x the client's bytes
MIN_ENGINE_BODY_BYTES = 32 * 1024 * 1024


def engine_command(
    spec: DeploymentSpec, port: int, drain_s: float = 20.0, host: str = "127.0.0.1"
) -> list[str]:
    """host: loopback for a local replica; a Ray node's own IP for a replica placed there."""
    m, e = spec.model, spec.engine
    cmd = [
        sys.executable,
        "-m",
        "llmdeploy.engine",
        "--model",
        m.path,
        "--served-alias",
        m.served_alias,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        m.dtype,
        "--max-model-len",
        str(m.max_model_len),
        "--block-size",
        str(e.block_size),
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--kv-cache-gb",
        str(e.kv_cache_gb),
        "--device",
        e.device,
        "--kernel-backend",
        e.kernel_backend,
        "--seed",
        str(e.seed),
    ]
    cmd += ["--gpu-memory-utilization", str(e.gpu_memory_utilization), "--log-level", spec.logging.level]
    cmd += ["--drain-timeout", str(drain_s), "--max-body-bytes", str(engine_body_limit(spec))]
    cmd += ["--ttft-sla-ms", str(spec.sla.ttft_p99_ms)]  # the scheduler's deadlines count from it
    cmd += ["--quantization", m.quantization, "--compile" if e.compile else "--no-compile"]
    if not e.prefix_caching:
        cmd.append("--no-prefix-caching")
    if spec.parallel.tensor_parallel > 1:  # the engine starts its other ranks itself (engine/parallel/)
        cmd += ["--tensor-parallel", str(spec.parallel.tensor_parallel)]
    if spec.logging.bodies:
        cmd.append("--log-bodies")
    return cmd


def engine_body_limit(spec: DeploymentSpec) -> int:
    """Roomy enough for any body the router passes on (it refuses bigger ones first), yet bounded."""
    return max(MIN_ENGINE_BODY_BYTES, ENGINE_BODY_FACTOR * spec.routing.max_body_bytes + 65536)
