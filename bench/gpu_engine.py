"""The engine half of bench/gpu_kernels.py: our engine against transformers' static-batch generate on one GPU.

A random model of a real shape is made on the GPU with transformers (bf16) and saved with a word-level
tokenizer that covers the whole vocabulary (random weights emit any id; text is never looked at). transformers
runs first, on the in-memory model, then is freed before the engine loads the same folder, so the engine's KV
sizing sees the whole GPU. `device="cpu"` exists only so a test can run this logic on a tiny config.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


def save_random_model(cfg: dict, folder: Path, device: str, dtype: torch.dtype):
    """-> the transformers model (eval, on `device`), also saved to `folder` with a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = dict(cfg)
    config = AutoConfig.for_model(
        cfg.pop("model_type"), bos_token_id=2, eos_token_id=1, pad_token_id=0, **cfg
    )
    vocab = {f"<t{i}>": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<t0>", eos_token="<t1>", bos_token="<t2>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(folder)
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_static_batches(model, prompts: list[list[int]], output_len: int, batch_size: int, device: str) -> dict:
    """transformers' generate over fixed batches (no padding needed: equal lengths), halving the batch on OOM."""

    def run(batch: list[list[int]], new_tokens: int) -> int:
        ids = torch.tensor(batch, device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    with torch.inference_mode():
        run([p[:16] for p in prompts[:2]], 4)  # warm-up
        while batch_size >= 1:
            try:
                sync(device)
                t = time.perf_counter()
                tokens = sum(
                    run(prompts[i : i + batch_size], output_len) for i in range(0, len(prompts), batch_size)
                )
                sync(device)
                seconds = time.perf_counter() - t
                return dict(
                    batch_size=batch_size,
                    seconds=round(seconds, 2),
                    output_tokens=tokens,
                    output_tokens_per_s=round(tokens / seconds, 1),
                )
            except torch.cuda.OutOfMemoryError:
                batch_size //= 2
                gc.collect()
                torch.cuda.empty_cache()
                print(f"  transformers: out of memory, batch -> {batch_size}", file=sys.stderr)
    raise RuntimeError("transformers ran out of memory at batch size 1")


def engine_run(folder: Path, prompts: list[list[int]], args, device: str) -> dict:
    from llmdeploy.engine import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(
        model=str(folder),
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        kernel_backend="triton",
        block_size=16,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.output_len,
        gpu_memory_utilization=0.9,
    )
    load_s = time.perf_counter() - t
    # the warm-up compiles every kernel variant the timed run meets: full prompts in a small decode batch
    # (split-K decode), a large decode batch of short prompts (no split), short prefill chunks
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([p[: args.prompt_len] for p in prompts[:16]], greedy(min(8, args.output_len)))
    llm.generate([p[:12] for p in prompts[:128]], greedy(4))
    t = time.perf_counter()
    outs = llm.generate(prompts, greedy(args.output_len))
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(
        seconds=round(seconds, 2),
        output_tokens=tokens,
        output_tokens_per_s=round(tokens / seconds, 1),
        total_tokens_per_s=round((tokens + sum(map(len, prompts))) / seconds, 1),
        load_s=round(load_s, 1),
        kv_cache_tokens=llm.engine.runner.capacity.tokens,
    )


def bench_engine(args, cfg: dict, device: str = "cuda") -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg["vocab_size"], (args.requests, args.prompt_len), generator=gen).tolist()
    result: dict = dict(
        model=args.model,
        requests=args.requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        target_speedup=5.0,
    )
    try:  # fail before the slow baseline when the engine's own packages are missing (e.g. pydantic)
        import llmdeploy.engine.llm  # noqa: F401
    except ImportError as exc:
        return dict(
            result, error=f"the engine cannot be imported ({exc}); see bench/RESULTS.md, Triton kernels"
        )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="llmdeploy-bench-") as tmp:
        folder = Path(tmp) / args.model
        model = None
        try:
            print(f"engine: making a random {args.model} ...", file=sys.stderr)
            model = save_random_model(cfg, folder, device, dtype)
            print("engine: transformers static batching ...", file=sys.stderr)
            sizes = [int(bs) for bs in args.hf_batch_sizes.split(",")]
            runs = [hf_static_batches(model, prompts, args.output_len, bs, device) for bs in sizes]
            result["transformers_runs"] = runs
            result["transformers"] = max(runs, key=lambda r: r["output_tokens_per_s"])
        except Exception as exc:
            traceback.print_exc()
            return dict(result, error=f"transformers baseline failed: {exc!r}")
        finally:
            del model
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()  # the engine sizes its KV cache from this process's peak
        try:
            print("engine: llmdeploy (triton) ...", file=sys.stderr)
            result["llmdeploy"] = ours = engine_run(folder, prompts, args, device)
        except Exception as exc:
            traceback.print_exc()
            return dict(result, error=f"engine run failed: {exc!r}")
    hf = result["transformers"]
    speedup = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    result.update(speedup=round(speedup, 2), met=speedup >= 5.0)
    print(
        f"engine {args.model}: transformers (best static batch: {hf['batch_size']}) {hf['output_tokens_per_s']} "
        f"tok/s, llmdeploy {ours['output_tokens_per_s']} tok/s -> {speedup:.2f}x (target 5x)"
    )
    return result
