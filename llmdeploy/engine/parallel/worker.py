"""`python -m llmdeploy.engine.parallel.worker`: tensor-parallel rank 1..N-1 of one engine, started by rank 0
(leader.py). It loads its shard of the weights, then runs whatever rank 0 sends: forwards, KV cache allocation
and sizing, and STOP. It serves nothing itself: no HTTP, no scheduler, no sampling."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys

import torch

from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.model_runner import allocate_kv_cache, cuda_kv_bytes, load_rank
from llmdeploy.engine.parallel.group import RankGroup, join, leave, rank_device
from llmdeploy.engine.parallel.shard import Shard
from llmdeploy.engine.parallel.step import Command, StepInputs, receive_header, receive_step

log = logging.getLogger("llmdeploy.engine")
PR_SET_PDEATHSIG = 1
NO_LIMIT = 1 << 62  # a CPU rank's own block limit: engine.kv_cache_gb is the replica's, counted on rank 0


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when rank 0 dies, however it dies (kill -9 included); exits now if it is already gone."""
    with contextlib.suppress(OSError):  # not glibc: a dead rank 0 still ends our collectives with an error
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        sys.exit(1)


class RankWorker:
    def __init__(self, config: EngineConfig, group: RankGroup):
        self.config, self.group = config, group
        self.loaded = load_rank(config, Shard(group.rank, group.size), group.device)
        self.model = self.loaded.model
        self.kv_cache: torch.Tensor | None = None

    @torch.inference_mode()
    def serve(self) -> None:
        while True:
            header = receive_header(self.group)
            command = Command(header[0])
            if command is Command.FORWARD:
                self.forward(receive_step(self.group, header))
            elif command is Command.ALLOCATE_KV:
                self.kv_cache = allocate_kv_cache(
                    self.model, header[1], self.config.block_size, self.loaded.dtype, self.group.device
                )
            elif command is Command.SIZE_KV:
                self.group.min_over_ranks(self.blocks_here())
            else:
                return

    def forward(self, step: StepInputs) -> None:
        if step.block_copies:
            src = torch.tensor([s for s, _ in step.block_copies], device=self.group.device)
            dst = torch.tensor([d for _, d in step.block_copies], device=self.group.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        self.model(step.input_ids, step.positions, step.meta)

    def blocks_here(self) -> int:
        """How many blocks of this rank's KV heads fit here (CUDA: its own GPU, after the warm-up)."""
        if self.group.device.type != "cuda":
            return NO_LIMIT
        self.kv_cache = None  # the warm-up's scratch cache; rank 0 has dropped its own
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        torch.cuda.empty_cache()
        budget = cuda_kv_bytes(self.group.device, self.config.gpu_memory_utilization)[0]
        layer = self.model.attention_layers()[0]
        per_block = 2 * len(self.model.attention_layers()) * self.config.block_size * layer.num_kv_heads
        return max(0, budget) // (per_block * layer.head_dim * self.loaded.dtype.itemsize)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmdeploy.engine.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's rendezvous port on 127.0.0.1")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config", required=True, help="the engine's EngineConfig as JSON, dtype resolved")
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid)
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains first, then stops this rank
        signal.signal(sig, signal.SIG_IGN)
    config = EngineConfig(**json.loads(args.config))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {args.rank}]: %(message)s"
    )
    try:
        group = join(args.rank, config.tensor_parallel, args.port, rank_device(config.device, args.rank))
        RankWorker(config, group).serve()
    except Exception:
        log.exception("rank %d failed", args.rank)
        return 1
    leave()
    return 0


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    os._exit(status)  # nothing left to clean up: skip the interpreter's slow teardown of torch
