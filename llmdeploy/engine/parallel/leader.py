"""Rank 0's side of tensor parallelism: starts ranks 1..N-1, hands them every step, stops them.

One replica is all its ranks: when any other rank exits, rank 0 kills the rest and exits non-zero (the supervisor
restarts the replica), and a forward that fails mid-step does the same, since the ranks' sums are then out of
step. SIGTERM reaches every rank of the process group; the other ranks ignore it and rank 0 drains, then stops
them (STOP, at exit). A killed rank 0 takes the others with it (PR_SET_PDEATHSIG in worker.py).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace

import torch

from llmdeploy.engine.attention import AttentionMetadata
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.loader import read_hf_config, resolve_device, resolve_dtype_for
from llmdeploy.engine.parallel.group import MASTER_ADDR, join, leave, rank_device
from llmdeploy.engine.parallel.shard import check_split
from llmdeploy.engine.parallel.step import Command, StepInputs, send_command, send_step
from llmdeploy.spec.addresses import free_port

log = logging.getLogger("llmdeploy.engine")
WATCH_INTERVAL_S = 0.2
STOP_WAIT_S = 10.0
# the engine's exit status when a rank is lost: any non-zero one makes the supervisor restart the replica
RANK_LOST_EXIT = 3


def start_ranks(config: EngineConfig) -> Leader:
    """Spawns ranks 1..N-1 and joins them; they load their shards while rank 0 loads its own. A model the ranks
    cannot split, or too few GPUs, is refused before anything starts."""
    hf = read_hf_config(config.model, config.base_dir)
    check_split(hf, config.tensor_parallel)
    device = rank_device(config.device, config.tensor_parallel - 1)  # the last rank's GPU must exist
    # dtype auto is measured on CPU: each rank measuring for itself could pick another dtype than rank 0
    dtype, reason = resolve_dtype_for(config.dtype, resolve_device(device.type), hf, config.quantization)
    return Leader(replace(config, dtype=str(dtype).removeprefix("torch.")), reason)


def worker_command(config: EngineConfig, rank: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llmdeploy.engine.parallel.worker",
        "--rank",
        str(rank),
        "--port",
        str(port),
        "--parent-pid",
        str(os.getpid()),
        "--config",
        json.dumps(asdict(config)),
    ]


class Leader:
    def __init__(self, config: EngineConfig, dtype_reason: str):
        """`config`: the engine's, with the dtype every rank uses (resolved from auto by rank 0)."""
        self.config, self.dtype_reason = config, dtype_reason
        self.size, self.dtype = config.tensor_parallel, config.dtype
        self.device = rank_device(config.device, 0)
        port = free_port(MASTER_ADDR)
        # spawned from this (the main) thread: PR_SET_PDEATHSIG fires when the spawning thread ends
        self.procs = [subprocess.Popen(worker_command(config, r, port)) for r in range(1, self.size)]
        self.closing = False
        self.lock = threading.Lock()  # one step at a time on the wire; close() waits for the step in flight
        threading.Thread(target=self._watch, name="llmdeploy-tp-watch", daemon=True).start()
        try:
            self.group = join(0, self.size, port, self.device)
        except BaseException:
            self._kill_ranks()
            raise
        atexit.register(self.close)
        log.info(
            "tensor parallel: %d ranks (%s, %s), ranks 1..%d are pids %s",
            self.size,
            "nccl" if self.device.type == "cuda" else "gloo",
            self.dtype,
            self.size - 1,
            " ".join(str(p.pid) for p in self.procs),
        )

    # each step
    def forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        block_copies: list[tuple[int, int]],
    ) -> torch.Tensor:
        with self.lock:
            try:
                send_step(self.group, StepInputs(input_ids, positions, meta, block_copies))
                return model(input_ids, positions, meta)
            except Exception:
                log.exception("the forward failed with the ranks mid-step; the engine stops")
                self._abort()

    def allocate_kv(self, num_blocks: int) -> None:
        with self.lock:
            send_command(self.group, Command.ALLOCATE_KV, num_blocks)

    def min_blocks(self, blocks_here: int) -> int:
        with self.lock:
            send_command(self.group, Command.SIZE_KV)
            return self.group.min_over_ranks(blocks_here)

    # lifecycle
    def close(self) -> None:
        """Stops the other ranks (at exit, after the drain); idempotent."""
        if self.closing:
            return
        self.closing = True
        if self.lock.acquire(timeout=STOP_WAIT_S):
            try:
                send_command(self.group, Command.STOP)
            except Exception:  # a rank already gone: the wait below kills the rest
                log.warning("could not send STOP to the other ranks", exc_info=True)
            finally:
                self.lock.release()
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank pid %d did not stop; killing it", proc.pid)
        self._kill_ranks()
        leave()

    def _watch(self) -> None:
        while not self.closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self.closing:
                    log.error(
                        "tensor-parallel rank %d (pid %d) exited with %s; the engine stops",
                        rank,
                        proc.pid,
                        code,
                    )
                    self._abort()
            time.sleep(WATCH_INTERVAL_S)

    def _abort(self) -> None:
        """The replica cannot go on without all its ranks: the others are killed and this process exits now (the
        step loop or the HTTP server may be blocked on a rank that is gone)."""
        self._kill_ranks()
        logging.shutdown()
        os._exit(RANK_LOST_EXIT)

    def _kill_ranks(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("rank pid %d survived SIGKILL", proc.pid)
