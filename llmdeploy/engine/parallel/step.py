"""What rank 0 sends the other ranks: a fixed-size header (the command and the sizes), then for a forward one
int64 payload with the step's inputs back to back. Two broadcasts per step, whatever the batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

from llmdeploy.engine.attention import AttentionMetadata
from llmdeploy.engine.parallel.group import RankGroup

HEADER_LEN = 12


class Command(IntEnum):
    FORWARD = 1  # copy blocks, then run the model on the payload's inputs
    ALLOCATE_KV = 2  # a zeroed KV cache of header[1] blocks (the warm-up's scratch cache, then the real one)
    SIZE_KV = 3  # every rank says how many blocks it can hold; the smallest count wins
    STOP = 4


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    block_copies: list[tuple[int, int]] = field(default_factory=list)


def _rows(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.shape[0]


def _width(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.shape[1]


def pack(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (header on CPU, payload on the inputs' device)."""
    m, dev = step.meta, step.input_ids.device
    parts = [step.input_ids, step.positions, m.slot_mapping]
    parts += [
        t.flatten()
        for t in (m.prefill_cu_seqlens_q, m.prefill_context_lens, m.prefill_block_tables)
        if t is not None
    ]
    parts += [t.flatten() for t in (m.decode_context_lens, m.decode_block_tables) if t is not None]
    if step.block_copies:
        parts.append(torch.tensor(step.block_copies, dtype=torch.int64, device=dev).flatten())
    header = [
        Command.FORWARD,
        step.input_ids.shape[0],
        m.num_prefill_tokens,
        _rows(m.prefill_context_lens),
        _width(m.prefill_block_tables),
        m.prefill_max_q_len,
        m.prefill_max_context_len,
        _rows(m.decode_context_lens),
        _width(m.decode_block_tables),
        m.decode_max_context_len,
        len(step.block_copies),
    ]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    return _header(header), payload


def _header(values: list[int]) -> torch.Tensor:
    return torch.tensor([*values, *[0] * (HEADER_LEN - len(values))], dtype=torch.int64)


def payload_len(h: list[int]) -> int:
    n, p, w1, d, w2, c = h[1], h[3], h[4], h[7], h[8], h[10]
    prefill = (p + 1) + p + p * w1 if p else 0
    decode = d + d * w2 if d else 0
    return 3 * n + prefill + decode + 2 * c


def unpack(h: list[int], payload: torch.Tensor) -> StepInputs:
    n, num_prefill, p, w1, max_q, max_ctx, d, w2, max_dctx, c = h[1:11]
    at = 0

    def take(count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        nonlocal at
        out = payload[at : at + count]
        at += count
        return out if dtype == torch.int64 else out.to(dtype)

    input_ids, positions, slots = take(n), take(n), take(n)
    meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=num_prefill, num_decode_tokens=d)
    if p:
        meta.prefill_cu_seqlens_q = take(p + 1, torch.int32)
        meta.prefill_context_lens = take(p, torch.int32)
        meta.prefill_block_tables = take(p * w1, torch.int32).view(p, w1)
        meta.prefill_max_q_len, meta.prefill_max_context_len = max_q, max_ctx
    if d:
        meta.decode_context_lens = take(d, torch.int32)
        meta.decode_block_tables = take(d * w2, torch.int32).view(d, w2)
        meta.decode_max_context_len = max_dctx
    copies = take(2 * c).view(c, 2).tolist() if c else []
    return StepInputs(input_ids, positions, meta, [(int(s), int(t)) for s, t in copies])


# the two ends
def send_command(group: RankGroup, command: Command, value: int = 0) -> None:
    dist.broadcast(_header([command, value]), src=0, group=group.control)


def send_step(group: RankGroup, step: StepInputs) -> None:
    header, payload = pack(step)
    dist.broadcast(header, src=0, group=group.control)
    dist.broadcast(payload, src=0)


def receive_header(group: RankGroup) -> list[int]:
    header = _header([])
    dist.broadcast(header, src=0, group=group.control)
    return header.tolist()


def receive_step(group: RankGroup, header: list[int]) -> StepInputs:
    payload = torch.empty(payload_len(header), dtype=torch.int64, device=group.device)
    dist.broadcast(payload, src=0)
    return unpack(header, payload)
