"""CUDA graphs for decode steps on GPU: one graph per batch size in DECODE_SIZES (up to max_num_seqs), captured
once the KV cache exists; a decode-only step pads its batch to the next captured size and replays.

A decode step is hundreds of small kernel launches (norms, rotary, KV store, attention, GEMMs per layer), which a
graph replays in one launch. Graphs fix shapes and pointers, so the inputs live in static buffers the step copies
into; the attention metadata's max_context_len is max_model_len at capture (the Triton decode kernel loops over
each sequence's own context_lens, so shorter contexts cost only their length). Padded rows store nothing (slot
-1), attend over one token of block 0 and are dropped.

Only on CUDA with the Triton kernels (LLMDEPLOY_CUDA_GRAPHS=0 turns it off). A capture that fails logs a warning
and the runner stays eager. This path has not run on a GPU yet (bench/gpu_engine.py covers it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from llmdeploy.engine.attention import AttentionMetadata

log = logging.getLogger("llmdeploy.engine")

DECODE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: DECODE_SIZES up to max_num_seqs, and max_num_seqs itself."""
    sizes = [s for s in DECODE_SIZES if s < max_num_seqs]
    return [*sizes, max_num_seqs]


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch` decodes, or None (the step runs eager)."""
    return next((s for s in sizes if s >= batch), None)


def wanted(device: torch.device, kernel_backend: str) -> bool:
    return (
        device.type == "cuda"
        and kernel_backend == "triton"
        and os.environ.get("LLMDEPLOY_CUDA_GRAPHS") != "0"
    )


@dataclass
class StaticInputs:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    context_lens: torch.Tensor  # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32

    @classmethod
    def allocate(cls, max_bs: int, max_blocks: int, device: torch.device) -> StaticInputs:
        long = dict(dtype=torch.long, device=device)
        return cls(
            torch.zeros(max_bs, **long),
            torch.zeros(max_bs, **long),
            torch.full((max_bs,), -1, **long),
            torch.ones(max_bs, dtype=torch.int32, device=device),
            torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device),
        )

    def meta(self, size: int, max_context_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_prefill_tokens=0,
            num_decode_tokens=size,
            decode_context_lens=self.context_lens[:size],
            decode_block_tables=self.block_tables[:size],
            decode_max_context_len=max_context_len,
        )


class DecodeGraphs:
    """Captured decode forwards by batch size; `forward` returns None where a step cannot use them."""

    def __init__(
        self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int, device
    ):
        self.model, self.max_model_len = model, max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.inputs = StaticInputs.allocate(self.sizes[-1], -(-max_model_len // block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            meta = self.inputs.meta(size, self.max_model_len)
            ids, pos = self.inputs.input_ids[:size], self.inputs.positions[:size]
            self.model(ids, pos, meta)  # warm-up outside the graph (Triton compiles here)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(ids, pos, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        batch = meta.num_decode_tokens
        size = padded_size(batch, self.sizes) if meta.num_prefill_tokens == 0 else None
        if size is None or size not in self.graphs:
            return None
        inp, width = self.inputs, meta.decode_block_tables.shape[1]
        inp.input_ids[:batch].copy_(input_ids)
        inp.positions[:batch].copy_(positions)
        inp.slot_mapping[:batch].copy_(meta.slot_mapping)
        inp.context_lens[:batch].copy_(meta.decode_context_lens)
        inp.block_tables[:batch, :width].copy_(meta.decode_block_tables)
        if size > batch:  # padding rows: store nothing, attend over one token
            inp.slot_mapping[batch:size].fill_(-1)
            inp.context_lens[batch:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:batch]


def capture_decode_graphs(runner) -> DecodeGraphs | None:
    """DecodeGraphs for the runner's model and KV cache, or None (not CUDA, switched off, or capture failed)."""
    if not wanted(runner.device, runner.kernel_backend):
        return None
    graphs = DecodeGraphs(
        runner.model, runner.config.max_num_seqs, runner.max_model_len, runner.block_size, runner.device
    )
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 (any capture failure leaves the runner eager, never broken)
        log.warning("CUDA graph capture failed, decode runs eager: %s", exc)
        return None
    log.info("CUDA graphs captured for decode batch sizes %s", graphs.sizes)
    return graphs
