"""Where a spec's replicas go and whether they fit (ARCHITECTURE.md §10): replicas x tensor-parallel ranks
against the CPUs and GPUs the backend reports. `plan_placement` is pure; `local_resources` reads this machine,
`ray_launcher.cluster_nodes` a Ray cluster. `plan` shows the result; `validate` and `apply` check the local
backend (no network)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from llmdeploy.spec.models import DeploymentSpec

CPUS_PER_RANK = 1.0  # what a rank reserves on Ray; a CPU rank's threads share the machine (engine/parallel/)
Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class NodeResources:
    address: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class PlacementIssue:
    loc: tuple[str, ...]
    severity: Severity
    message: str


@dataclass(frozen=True)
class Placement:
    backend: str
    where: str  # "this machine" | "the Ray cluster at ADDRESS"
    replicas: str  # "2" or "1-4 (autoscaled)"
    ranks: int
    cpus_per_replica: float
    gpus_per_replica: float
    nodes: tuple[NodeResources, ...] | None  # None: not known (an unreachable cluster)
    fits: int | None  # how many replicas the resources hold at once
    issues: tuple[PlacementIssue, ...] = field(default=())
    note: str = ""

    @property
    def errors(self) -> list[PlacementIssue]:
        return [i for i in self.issues if i.severity == "error"]


def replica_resources(spec: DeploymentSpec, gpu: bool) -> tuple[float, float]:
    """(CPUs, GPUs) one replica reserves: CPUS_PER_RANK per rank, and one GPU per rank on CUDA."""
    ranks = spec.parallel.tensor_parallel
    return ranks * CPUS_PER_RANK, float(ranks) if gpu else 0.0


def plan_placement(
    spec: DeploymentSpec, nodes: list[NodeResources] | None, gpu: bool, where: str, note: str = ""
) -> Placement:
    """Pure: the placement of `spec` on `nodes` (None: unknown) and what does not fit."""
    p = spec.parallel
    cpus, gpus = replica_resources(spec, gpu)
    issues: list[PlacementIssue] = []
    fits = None
    if nodes is not None and p.backend == "local":
        fits = _local(spec, nodes[0], gpu, issues)
    elif nodes is not None:
        fits = _ray(spec, nodes, cpus, gpus, issues)
    return Placement(
        p.backend, where, str(p.replicas), p.tensor_parallel, cpus, gpus, _t(nodes), fits, tuple(issues), note
    )


def _t(nodes: list[NodeResources] | None) -> tuple[NodeResources, ...] | None:
    return None if nodes is None else tuple(nodes)


def _local(spec: DeploymentSpec, node: NodeResources, gpu: bool, issues: list[PlacementIssue]) -> int:
    """Local replicas share the machine: on CUDA every replica's rank r uses GPU r, so only the ranks need
    GPUs; on CPU every rank is a process that wants a core."""
    p = spec.parallel
    if gpu and p.tensor_parallel > node.gpus:
        issues.append(
            PlacementIssue(
                ("parallel", "tensor_parallel"),
                "error",
                f"{p.tensor_parallel} ranks need {p.tensor_parallel} GPUs (one per rank); this machine has "
                f"{node.gpus:g}",
            )
        )
    processes = p.max_replicas * p.tensor_parallel
    if not gpu and processes > node.cpus:
        issues.append(
            PlacementIssue(
                ("parallel", "replicas"),
                "warning",
                f"{p.max_replicas} replicas x {p.tensor_parallel} ranks = {processes} engine processes on "
                f"{node.cpus:g} CPUs: they compete for cores and each runs slower",
            )
        )
    return p.max_replicas if not gpu or p.tensor_parallel <= node.gpus else 0


def _ray(
    spec: DeploymentSpec, nodes: list[NodeResources], cpus: float, gpus: float, issues: list[PlacementIssue]
) -> int:
    """Each replica is one bundle on one node; a canary revision needs room beside the stable one."""
    p = spec.parallel
    fits = sum(_per_node(n, cpus, gpus) for n in nodes)
    need = f"{cpus:g} CPU" + (f" and {gpus:g} GPU" if gpus else "")
    if fits == 0:
        biggest = max(nodes, key=lambda n: (n.gpus, n.cpus), default=NodeResources("-", 0, 0))
        where = ("parallel", "tensor_parallel") if p.tensor_parallel > 1 else ("parallel", "replicas")
        issues.append(
            PlacementIssue(
                where,
                "error",
                f"a replica needs {need} on one node (its ranks stay together); the largest node of the Ray "
                f"cluster has {biggest.cpus:g} CPU and {biggest.gpus:g} GPU",
            )
        )
    elif p.initial_replicas > fits:
        issues.append(
            PlacementIssue(
                ("parallel", "replicas"),
                "error",
                f"only {fits} of {p.initial_replicas} replicas ({need} each) fit on the Ray cluster",
            )
        )
    elif p.max_replicas > fits:
        issues.append(
            PlacementIssue(
                ("parallel", "replicas"),
                "warning",
                f"autoscaling stops at {fits} replicas: no room for {p.max_replicas} ({need} each)",
            )
        )
    elif p.max_replicas + p.initial_replicas > fits:
        issues.append(
            PlacementIssue(
                ("parallel", "replicas"),
                "warning",
                f"a canary revision starts {p.initial_replicas} more replicas beside the stable "
                f"{p.max_replicas}; the Ray cluster holds {fits}, so a new revision waits for room",
            )
        )
    return fits


def _per_node(node: NodeResources, cpus: float, gpus: float) -> int:
    by_cpu = int(node.cpus // cpus) if cpus else 0
    return min(by_cpu, int(node.gpus // gpus)) if gpus else by_cpu


def local_resources(gpu: bool) -> NodeResources:
    """This machine's CPUs (those this process may use) and, for CUDA engines, its GPUs (imports torch)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    gpus = 0
    if gpu:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return NodeResources("127.0.0.1", float(cpus), float(gpus))
