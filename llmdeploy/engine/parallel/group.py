"""The process group of one engine's ranks: gloo on CPU, NCCL on CUDA (one GPU per rank), on 127.0.0.1.

Two groups on CUDA: NCCL for the model's sums and the step payload (device tensors), and a gloo group for the
step header and the KV sizing, which idle ranks wait on between steps (a CPU wait, not a spinning kernel). On
CPU both are the same gloo group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

MASTER_ADDR = "127.0.0.1"
# Ranks wait for the next step as long as the engine is idle, so a collective may block for hours; a dead rank
# is noticed by its closed connection and by the leader's watch over its processes, not by this timeout. A month
# without a single request ends in the timeout: the replica then restarts, as after any lost rank.
IDLE_TIMEOUT = timedelta(days=30)


@dataclass
class RankGroup:
    rank: int
    size: int
    device: torch.device
    control: dist.ProcessGroup | None  # None: the default group (CPU)

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def rank_device(device: str, rank: int) -> torch.device:
    """engine.device for one rank: CUDA ranks take one GPU each (cuda:rank)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if rank >= torch.cuda.device_count():
            raise ValueError(
                f"tensor-parallel rank {rank} needs GPU {rank} (one per rank); "
                f"{torch.cuda.device_count()} visible"
            )
        return torch.device("cuda", rank)
    return torch.device(device)


def cpu_threads_per_rank(size: int) -> int:
    """The CPUs this process may use, shared out: N ranks each with every CPU only wait on each other."""
    return max(1, len(os.sched_getaffinity(0)) // size)


def join(rank: int, size: int, port: int, device: torch.device) -> RankGroup:
    """Blocks until all `size` ranks have joined (rank 0 hosts the rendezvous on `port`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads_per_rank(size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{MASTER_ADDR}:{port}",
        rank=rank,
        world_size=size,
        timeout=IDLE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend == "nccl" else None
    return RankGroup(rank, size, device, control)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of every rank's partial result of a row-split layer, in place."""
    dist.all_reduce(x)
    return x


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
