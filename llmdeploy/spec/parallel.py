"""`parallel:` of the YAML contract: how many engine copies run, fixed or autoscaled, and how each is split.

`replicas` is either a count (fixed, as it always was) or a range `{min, max}` that the daemon's autoscaler
(control/autoscaler.py, judged by policies/autoscale.py) moves within, one replica at a time. A count is stored
and compared as the plain integer it is, so specs written before ranges existed keep their revision hashes.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from llmdeploy.spec.base import RuleError, Section

# the discriminated union's branch names: pydantic puts them into error locations, the loader takes them out
COUNT_TAG, RANGE_TAG = "count", "range"
RAY_INSTALL_HINT = "pip install 'llmdeploy[ray]'"


class ReplicaRange(Section):
    min: int = Field(1, ge=1, description="fewest replicas; the revision starts with this many")
    max: int = Field(..., ge=1, description="most replicas (required in a range)")
    scale_up_after_s: float = Field(
        30.0,
        gt=0,
        description="the SLA must be at risk this long (predicted TTFT, queues or KV usage on every replica, or "
        "the share spilled to the cloud) before one replica is added",
    )
    cool_down_s: float = Field(
        300.0,
        gt=0,
        description="the replicas must be idle this long, and the last change this long ago, before one is "
        "removed (it drains like `down`)",
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> ReplicaRange:
        if self.min > self.max:
            raise RuleError(f"min ({self.min}) must be <= max ({self.max})", "min", ("max",))
        return self

    def __str__(self) -> str:
        return f"{self.min}-{self.max} (autoscaled)"


def _count_or_range(value: Any) -> str:
    return RANGE_TAG if isinstance(value, dict | ReplicaRange) else COUNT_TAG


Replicas = Annotated[
    Annotated[int, Tag(COUNT_TAG), Field(ge=1)] | Annotated[ReplicaRange, Tag(RANGE_TAG)],
    Discriminator(_count_or_range),
]


class ParallelSpec(Section):
    replicas: Replicas = Field(
        1,
        description="data-parallel engine copies: a fixed count, or a range {min, max} the daemon autoscales "
        "within",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="ranks per replica (one process each, torch.distributed: gloo on CPU, NCCL on CUDA, one "
        "GPU per rank); must divide the model's attention heads and KV heads",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: engine processes on this machine; ray: each replica runs under a Ray actor on a "
        "running Ray cluster (its ranks on one node, num_cpus and num_gpus reserved as a placement group); "
        "needs pip install 'llmdeploy[ray]' here and llmdeploy plus the model file at the same path on each node",
    )
    ray_address: str | None = Field(
        None,
        description="the Ray cluster's GCS address, e.g. 10.0.0.5:6379, when backend is ray; unset or auto: the "
        "cluster this machine has joined (RAY_ADDRESS, or `ray start` here). The daemon never starts a cluster",
    )

    @property
    def autoscale(self) -> ReplicaRange | None:
        """The range the autoscaler keeps the replicas in; None for a fixed count."""
        return self.replicas if isinstance(self.replicas, ReplicaRange) else None

    @property
    def initial_replicas(self) -> int:
        """How many replicas a revision starts with."""
        return self.autoscale.min if self.autoscale else self.replicas  # type: ignore[return-value]

    @property
    def max_replicas(self) -> int:
        """The most replicas that may run at once (what memory must hold)."""
        return self.autoscale.max if self.autoscale else self.replicas  # type: ignore[return-value]


def tensor_parallel_problem(tensor_parallel: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why `tensor_parallel` ranks cannot split a model with these heads (each rank takes whole heads, and the KV
    cache is split by KV heads), or None when they can."""
    if num_heads % tensor_parallel == 0 and num_kv_heads % tensor_parallel == 0:
        return None
    common = math.gcd(num_heads, num_kv_heads)
    fits = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
    return (
        f"{tensor_parallel} ranks cannot split the model's {num_heads} attention heads and {num_kv_heads} KV heads "
        f"evenly; use one of: {fits}"
    )


def ray_installed() -> bool:
    """Whether `import ray` can work here (found, not imported: importing Ray takes a second)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False
