"""ModelRunner: owns the loaded model and the paged KV cache; turns a ScheduledBatch into logits.

KV capacity: engine.kv_cache_gb on CPU. On CUDA, a warm-up forward of max_num_batched_tokens measures this
process's peak memory (weights + activations); the KV cache gets total * gpu_memory_utilization minus that peak,
but never more than is actually free now (other processes' memory is not subtracted blindly, nor ignored).

With tensor_parallel N (engine/parallel/) this is rank 0: it starts the other ranks and hands them each step,
warm-up included. Every rank holds the same block ids for its own KV heads, so one block is 1/N of the replica's
block bytes per rank: engine.kv_cache_gb stays the replica's total on CPU, and on CUDA the GPU with the least
room sets the block count for all.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time

import numpy as np
import torch

from llmdeploy.engine.attention import AttentionMetadata
from llmdeploy.engine.attn_probe import probe_attn_cost_context, probe_context
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.cuda_graphs import capture_decode_graphs
from llmdeploy.engine.errors import CapacityError
from llmdeploy.engine.load_stats import CostPoint
from llmdeploy.engine.loader import LoadedModel, load_model
from llmdeploy.engine.outputs import Capacity, TokenLogprob
from llmdeploy.engine.parallel.shard import Shard
from llmdeploy.engine.resources import kv_cache_over_memory, trim_heap
from llmdeploy.engine.scheduler import ScheduledBatch
from llmdeploy.engine.sequence import Sequence
from llmdeploy.engine.start_measures import StartMeasures, measures_path, read_measures, write_measures
from llmdeploy.kernels.decode_step import BurstDraw
from llmdeploy.kernels.huge_pages import huge_zeros
from llmdeploy.policies.step_cost import chunk_cost

log = logging.getLogger("llmdeploy.engine")
GiB = 1 << 30
# one step's flat input ids, positions, attention metadata and the rows whose logits are wanted
StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]
# Each calibration step is timed this many times and the fastest kept: one slow run (a page fault storm, a busy
# neighbour) made the prior twice the real cost, and the prior outweighs the first minutes of real steps.
CALIBRATION_REPEATS = 2
PROMPT_LOGPROB_ROWS = 128  # prompt positions scored at once: [128, vocab] float32 logits at most
CUDA_FREE_MARGIN = 256 << 20  # left free on the GPU for the allocator and other kernels' workspaces
# How fast the torch reference attention runs per FLOP, relative to the projections, by dtype. Measured on SmolLM2-135M
# (2 threads, 2026-11-30): a chunk of n tokens after c cached ones took n x 0.71 ms x (1 + c / 1000) in float32 and
# n x 0.43 ms x (1 + c / 550) in bfloat16, against a FLOP parity context of 3072 (see attn_cost_context).
# Used only where no long context can be timed at start (engine/attn_probe.py; max_model_len under 321). The Triton
# kernels are not measured yet: no sizing by cost there.
TORCH_ATTN_EFFICIENCY = {torch.float32: 0.33, torch.bfloat16: 0.18, torch.float16: 0.18}


def release_openmp_workers() -> bool:
    """Ends this thread's idle OpenMP worker threads (`omp_pause_resource_all(omp_pause_soft)`); its next parallel
    op starts them again. Why: libgomp stops spin-waiting for work once it manages more threads than there are
    CPUs, and then every parallel op (each projection, gather, bmm) pays futex wake-ups. The loading thread's idle
    workers plus those of a step loop on another thread (AsyncLLMEngine) are such a case: on 2 cores decode went
    from 18 to 28 ms/token and a 128-token prefill from 90 to 130 ms. Best effort: False where there is no
    libgomp in this process (another OpenMP runtime, or none)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libgomp" in line), None)
        return path is not None and ctypes.CDLL(path).omp_pause_resource_all(1) == 0  # 1 = omp_pause_soft
    except (OSError, AttributeError):
        return False


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on CPU from a fresh anonymous mapping (huge_zeros): zero pages are handed out as they are
    first touched, so a large cache costs nothing at start (torch.zeros wrote 1 GiB in 0.17 s), only its used part
    is resident, and attention's reads of it walk huge pages where the kernel gives them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_zeros(math.prod(shape), dtype).view(shape)


def allocate_kv_cache(
    model: torch.nn.Module, num_blocks: int, block_size: int, dtype, device
) -> torch.Tensor:
    """One zeroed tensor [2, layers, blocks, block_size, kv_heads, head_dim], sliced into every layer (kv_heads:
    this rank's). Zeroed: padded rows the reference kernels gather (and mask) must not hold NaN."""
    layers = model.attention_layers()
    shape = (2, len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    kv = zeroed(shape, dtype, torch.device(device))
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]
    return kv


def load_rank(
    config: EngineConfig, shard: Shard = Shard(), device: str | torch.device | None = None
) -> LoadedModel:
    """The model as `config` asks, or one tensor-parallel rank's part of it on its own device (the config's
    dtype is then the one rank 0 resolved)."""
    return load_model(
        config.model,
        dtype=config.dtype,
        device=config.device if device is None else device,
        kernel_backend=config.kernel_backend,
        base_dir=config.base_dir,
        quantization=config.quantization,
        compile=config.compile,
        shard=shard,
    )


def cuda_kv_bytes(device: torch.device, util: float) -> tuple[int, str, str]:
    """total x utilization - this process's peak (after warm-up), capped by what is free now."""
    total = torch.cuda.get_device_properties(device).total_memory
    free = torch.cuda.mem_get_info(device)[0]
    peak = torch.cuda.max_memory_allocated(device)
    how = (
        f"gpu_memory_utilization={util} of {total / GiB:.1f} GiB, peak of weights + activations "
        f"{peak / GiB:.2f} GiB, free now {free / GiB:.2f} GiB"
    )
    fix = "raise engine.gpu_memory_utilization, free GPU memory, or lower model.max_model_len"
    return min(int(total * util) - peak, free - CUDA_FREE_MARGIN), how, fix


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.tp = None  # rank 0's side of tensor parallelism (parallel/leader.py); None with one rank
        if config.tensor_parallel > 1:
            if loaded is not None:
                raise ValueError("tensor_parallel > 1 loads its own shards; a loaded model cannot be split")
            from llmdeploy.engine.parallel.leader import start_ranks

            self.tp = start_ranks(config)
            loaded = load_rank(self.tp.config, Shard(0, self.tp.size), self.tp.device)
            loaded.dtype_reason = self.tp.dtype_reason
        if loaded is None:
            started = time.perf_counter()
            loaded = load_rank(config)
            log.info("weights loaded in %.1f s", time.perf_counter() - started)
        self.loaded = loaded
        self.model, self.arch = self.loaded.model, self.loaded.arch
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}  # of the last run(): seq_id -> its chunk's
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        self.block_size = config.block_size
        ops = {layer.ops.__name__ for layer in self.model.attention_layers()}
        self.kernel_backend = "torch" if ops == {"llmdeploy.kernels.reference"} else "triton"
        self.max_model_len = min(config.max_model_len, self.arch.max_position_embeddings)
        if self.max_model_len < config.max_model_len:
            log.warning(
                "max_model_len %d is longer than the model's %d positions; using %d",
                config.max_model_len,
                self.arch.max_position_embeddings,
                self.max_model_len,
            )
        self.decode_graphs = None  # captured after the KV cache exists (warm-up runs eager)
        self.attn_cost_context, self.calibration = self.start_measures()
        self.num_blocks = self.kv_cache_blocks()
        self.kv_cache = self.allocate_kv_cache(self.num_blocks)
        self.first_touch()
        # CUDA only (engine/cuda_graphs.py); not across ranks: a graph would hold the other ranks' sums
        self.decode_graphs = capture_decode_graphs(self) if self.tp is None else None
        release_openmp_workers()
        trim_heap()  # the unpacked weights' and the warm-up's freed memory
        self.capacity = Capacity(
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.block_size / self.max_model_len,
        )
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s) = %.1f sequences of max_model_len %d",
            self.num_blocks,
            self.block_size,
            self.capacity.tokens,
            self.num_blocks * self.block_bytes / GiB,
            str(self.dtype).removeprefix("torch."),
            self.capacity.max_model_len_seqs,
            self.max_model_len,
        )

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (also done at exit); nothing to do with one rank."""
        if self.tp is not None:
            self.tp.close()

    def start_measures(self) -> tuple[float | None, list[CostPoint]]:
        """The attention cost constant and the step-cost calibration: kept from an earlier start of this engine on
        this machine (engine/start_measures.py), else measured now and kept."""
        kept_here = self.device.type == "cpu" and self.tp is None
        source = self.loaded.source
        path = measures_path(self.config, source, self.dtype, self.max_model_len) if kept_here else None
        kept = read_measures(path)
        if kept is not None:
            context, how = kept.attn_cost_context, f"{kept.attn_how}, kept from an earlier start: {path}"
        else:
            context, how = self.measured_attn_cost_context()
        log.info(
            "attention cost: a prefill token at context %s costs two fresh ones (%s)",
            context and round(context),
            how,
        )
        self.attn_cost_context = context  # the warm-up's prefill points are weighted by it
        if kept is not None:
            self.warmup(timed=False)
            return context, list(kept.calibration)
        calibration = self.warmup()
        write_measures(path, StartMeasures(context, how, tuple(calibration)))
        return context, calibration

    def measured_attn_cost_context(self) -> tuple[float | None, str]:
        """Context length at which a prefill token's attention costs as much as the rest of its forward (the
        scheduler sizes chunks by it), and how it was found: timed here on the CPU (engine/attn_probe.py), else
        the FLOP-based estimate. None where neither applies (CUDA: not measured yet)."""
        timed_here = self.kernel_backend == "torch" and self.device.type == "cpu" and self.tp is None
        context = probe_context(self.max_model_len) if timed_here else None
        if context is not None:
            return probe_attn_cost_context(self, context), "timed at start"
        return self.estimated_attn_cost_context(), "estimated from FLOPs"

    def estimated_attn_cost_context(self) -> float | None:
        """The FLOP parity context (projection FLOPs per token / attention FLOPs per cached token) scaled by the
        torch attention's relative speed measured once (TORCH_ATTN_EFFICIENCY); where no long context can be timed."""
        efficiency = TORCH_ATTN_EFFICIENCY.get(self.dtype) if self.kernel_backend == "torch" else None
        if efficiency is None:
            return None
        proj = sum(  # per token, all layers
            2 * m.in_features * m.out_features
            for name, m in self.model.named_modules()
            if hasattr(m, "in_features") and not name.endswith("lm_head")
        )
        layers = self.model.attention_layers()
        return efficiency * proj / (4 * layers[0].num_heads * layers[0].head_dim * len(layers))

    # KV cache sizing
    @property
    def block_bytes(self) -> int:
        return self.block_size * self.arch.kv_bytes_per_token(self.dtype.itemsize)

    def kv_cache_blocks(self) -> int:
        kv_bytes, how, fix = self.cuda_kv_bytes() if self.device.type == "cuda" else self.cpu_kv_bytes()
        num_blocks = max(0, kv_bytes) // self.block_bytes
        if self.tp is not None and self.device.type == "cuda":  # each GPU holds 1/N of a block
            num_blocks = self.tp.min_blocks(
                max(0, kv_bytes) * self.config.tensor_parallel // self.block_bytes
            )
        need = -(-self.max_model_len // self.block_size)
        if num_blocks < need:
            raise CapacityError(
                f"The KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks of "
                f"{self.block_size}; {how}), but one sequence of max_model_len={self.max_model_len} needs {need} "
                f"blocks ({need * self.block_bytes / GiB:.3f} GiB); {fix}."
            )
        return num_blocks

    def cpu_kv_bytes(self) -> tuple[int, str, str]:
        gb = self.config.kv_cache_gb
        if too_big := kv_cache_over_memory(gb):
            raise CapacityError(too_big)
        return (
            int(gb * GiB),
            f"engine.kv_cache_gb={gb}",
            "raise engine.kv_cache_gb or lower model.max_model_len",
        )

    def cuda_kv_bytes(self) -> tuple[int, str, str]:
        return cuda_kv_bytes(self.device, self.config.gpu_memory_utilization)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        if self.tp is not None:
            self.tp.allocate_kv(num_blocks)
        return allocate_kv_cache(self.model, num_blocks, self.block_size, self.dtype, self.device)

    @torch.inference_mode()
    def warmup(self, timed: bool = True) -> list[CostPoint]:
        """Measured steps on a scratch cache: a prefill at the step budget (peak activation memory on CUDA; its
        first run pays one-time setup and is not timed), a short prefill, and decodes at batch 1 and wider. They
        calibrate the step-cost model (engine/load_stats.py) before real steps are seen. timed=False (a kept
        calibration): the prefill and the decodes run once each, untimed, so their one-time setup is still paid
        here and not by the first requests."""
        cuda = self.device.type == "cuda"
        budget = self.config.max_num_batched_tokens if cuda else min(self.config.max_num_batched_tokens, 256)
        seq_len = min(budget, self.max_model_len)
        wide = max(1, min(8, self.config.max_num_seqs))
        n_long = -(-budget // seq_len)
        seqs = [
            Sequence([i % self.arch.vocab_size for i in range(seq_len)]) for _ in range(max(n_long, wide))
        ]
        per_seq = -(-seq_len // self.block_size)
        for i, s in enumerate(seqs):
            s.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        scratch = self.allocate_kv_cache(per_seq * len(seqs))
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        prefill = ScheduledBatch(prefills=[(s, len(s)) for s in seqs[:n_long]]).finalize()
        widest = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.run(prefill, num_logit_rows=widest)  # the first call also pays one-time setup: not timed
        short = min(16, seq_len)
        points = []
        if timed:
            points += [
                self._timed(prefill, budget, 0, num_logit_rows=widest),
                self._timed(ScheduledBatch(prefills=[(seqs[-1], short)]).finalize(), short, 0),
            ]
        for s in seqs:
            s.num_computed_tokens = len(s) - 1
        for batch in (1, wide):
            decode = ScheduledBatch(decodes=seqs[:batch]).finalize()
            if timed:
                points.append(self._timed(decode, 0, batch))
            else:
                self.run(decode)
        del scratch
        return points

    @torch.inference_mode()
    def first_touch(self) -> None:
        """One short prefill into the serving cache's first block, at start. The cache is a fresh mapping whose
        pages are faulted in when first written (huge pages, with direct compaction under THP defrag=madvise):
        on Zen 4 that cost a fresh engine's first request ~170 ms of a ~45 ms step (60 huge pages, one per layer's
        K and V). What it writes is overwritten before any sequence reads it: the block manager hands out block 0
        first, and a sequence writes each position before attending to it. Later blocks' pages are still first
        touched by the requests that reach them (one stripe of 2 MB per layer's K and V at a time)."""
        if self.device.type != "cpu" or self.tp is not None:
            return
        seq = Sequence([i % self.arch.vocab_size for i in range(min(self.block_size, self.max_model_len))])
        seq.block_table = [0]
        self.run(ScheduledBatch(prefills=[(seq, len(seq))]).finalize())

    def _timed(self, batch: ScheduledBatch, prefill_tokens: int, decodes: int, **kw) -> CostPoint:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda device: None)
        best = float("inf")
        for _ in range(CALIBRATION_REPEATS):
            sync(self.device)
            t0 = time.perf_counter()
            self.run(batch, **kw)
            sync(self.device)
            best = min(best, time.perf_counter() - t0)
        ctx = sum(s.num_computed_tokens for s, _ in batch.prefills)
        tokens = chunk_cost(ctx, prefill_tokens, self.attn_cost_context) if prefill_tokens else 0.0
        return CostPoint(tokens, decodes, max(best, 1e-6))

    # one step
    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, num_logit_rows: int | None = None, inputs: StepInputs | None = None
    ) -> torch.Tensor:
        """Forward of the batch's tokens -> float32 logits [len(batch.logit_seqs), vocab]. `inputs`: the batch
        already prepared (the engine does it under its lock, before an abort can free the batch's blocks)."""
        if batch.blocks_to_copy:
            self.copy_blocks(batch.blocks_to_copy)
        input_ids, positions, meta, logit_idx = inputs if inputs is not None else self.prepare(batch)
        if not batch.prefills and not num_logit_rows and self.tp is None and self.device.type == "cpu":
            logits = self.model.decode_logits(input_ids, positions, meta)  # every row's, in the batch's order
            if logits is not None:
                self.prompt_logprobs = {}
                return logits
        hidden = None
        if self.tp is not None:
            hidden = self.tp.forward(self.model, input_ids, positions, meta, batch.blocks_to_copy)
        elif self.decode_graphs is not None and not num_logit_rows:
            hidden = self.decode_graphs.forward(
                input_ids, positions, meta
            )  # None: not a captured decode step
        if hidden is None:
            hidden = self.model(input_ids, positions, meta)
        if num_logit_rows:  # warm-up: the widest logits a step can ask for
            logit_idx = torch.arange(min(num_logit_rows, hidden.shape[0]), device=self.device)
        self.prompt_logprobs = self._prompt_logprobs(batch, hidden)
        return self.model.compute_logits(hidden[logit_idx])

    @property
    def bursts(self) -> bool:
        """Whether run_burst can run here: the native decode step, on CPU, one rank."""
        return self.device.type == "cpu" and self.tp is None and hasattr(self.model, "decode_greedy")

    def screens_head(self, rows: int) -> bool:
        """Whether a greedy native step of `rows` rows reads the LM head through its screen (run_burst's one-step
        call then costs less than the logits' step)."""
        return self.bursts and self.model.screens_head(rows)

    def run_burst(
        self,
        batch: ScheduledBatch,
        inputs: StepInputs,
        steps: int,
        yield_flag: ctypes.c_int32 | None = None,
        draw: BurstDraw | None = None,
    ) -> list[list[int]] | None:
        """Up to `steps` greedy (with `draw`: sampled) decode steps of a decode-only batch in one native call (its
        sequences' blocks reserved for them and `inputs` prepared with `ahead=steps - 1`; fewer once `yield_flag`
        is set): [decodes][steps run] token ids, or None (nothing run: the caller runs one ordinary step)."""
        if batch.prefills or batch.blocks_to_copy or not self.bursts:
            return None
        input_ids, positions, meta, _ = inputs
        tokens = self.model.decode_greedy(input_ids, positions, meta, steps, yield_flag, draw)
        if tokens is not None:
            self.prompt_logprobs = {}
        return tokens

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> dict[int, list[TokenLogprob]]:
        """seq_id -> the logprobs of the prompt tokens this step's chunk predicts (echo with logprobs). Each
        chunk row at position p scores prompt token p + 1; rows go through the head in slices so a long chunk
        never holds [chunk, vocab] logits at once."""
        out: dict[int, list[TokenLogprob]] = {}
        row = 0
        for seq, n in batch.prefills:
            k = seq.params.prompt_logprobs
            start = seq.num_computed_tokens
            scored = min(n, seq.num_prompt_tokens - 1 - start)  # the last prompt token scores a new one
            if k is not None and scored > 0:
                targets = seq.token_ids[start + 1 : start + 1 + scored]
                out[seq.seq_id] = self._score(hidden[row : row + scored], targets, k)
            row += n
        return out

    def _score(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
        lps: list[TokenLogprob] = []
        for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            logp = torch.log_softmax(self.model.compute_logits(hidden[i : i + PROMPT_LOGPROB_ROWS]), dim=-1)
            ids = torch.tensor(targets[i : i + PROMPT_LOGPROB_ROWS], device=logp.device)
            chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
            top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
            for t, c, tv, ti in zip(ids.tolist(), chosen, top_v.tolist(), top_i.tolist(), strict=True):
                lps.append(TokenLogprob(t, c, list(zip(ti, tv, strict=True))))
        return lps

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, batch: ScheduledBatch, ahead: int = 0) -> StepInputs:
        """Flat input_ids/positions/slot_mapping (prefill chunks first, then decodes) and the metadata. `ahead`: the
        decodes' block tables also cover that many positions after this step's (a decode burst, run_burst)."""
        bs, dev = self.block_size, self.device
        chunks, dec = batch.prefills, batch.decodes
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        cu_q, ctx, last = [0], [], {}  # last: seq_id -> flat index of the token whose logits it needs
        for seq, n in chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            cu_q.append(cu_q[-1] + n)
            ctx.append(end)
            last[seq.seq_id] = cu_q[-1] - 1
        num_prefill = cu_q[-1]
        if dec:
            dpos = [len(s) - 1 for s in dec]
            ids.extend(s.token_ids[-1] for s in dec)
            pos_parts.append(np.asarray(dpos, dtype=np.int64))
            slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(dec, dpos, strict=True)]
            slot_parts.append(np.asarray(slots, dtype=np.int64))
            last.update((s.seq_id, num_prefill + j) for j, s in enumerate(dec))
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=len(dec),
        )
        if chunks:
            meta.prefill_cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32, device=dev)
            meta.prefill_context_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
            meta.prefill_block_tables = self.block_tables([s for s, _ in chunks], max(ctx))
            meta.prefill_max_q_len = max(n for _, n in chunks)
            meta.prefill_max_context_len = max(ctx)
        if dec:
            lens = [len(s) for s in dec]
            meta.decode_context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            meta.decode_block_tables = self.block_tables(dec, max(lens) + ahead)
            meta.decode_max_context_len = max(lens)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_parts)).to(dev)
        logit_idx = torch.tensor([last[s.seq_id] for s in batch.logit_seqs], dtype=torch.long, device=dev)
        return input_ids, positions, meta, logit_idx

    def block_tables(self, seqs: list[Sequence], max_context_len: int) -> torch.Tensor:
        width = -(-max_context_len // self.block_size)
        table = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            row = s.block_table[:width]
            table[i, : len(row)] = row
        return torch.from_numpy(table).to(self.device)
