"""Forward-pass speed and parity of the engine's model code on CPU, SmolLM2-135M shapes (builtin model).

    python bench/forward_cpu.py [--dtypes float32,bfloat16] [--reps 20] [--parity] [--json out.json]

Speed: decode batch 1 and batch 32 at context ~200, prefill of 128 and 512 tokens (forward + last-row logits),
median of --reps. Parity (--parity): greedy tokens against transformers float32 on the same weights, and the
max-abs logit difference over the prompt positions. LLMDEPLOY_COMPILE=0/1 selects torch.compile.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdeploy.engine.loader import load_model  # noqa: E402
from tests.engine.paged_driver import PagedDriver  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
]


def timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def fake_context(driver: PagedDriver, batch: int, ctx: int):
    """Sequences whose first ctx-1 tokens count as cached (random cache contents time the same)."""
    seqs = [driver.new_seq(list(range(ctx))) for _ in range(batch)]
    for s in seqs:
        s.num_cached = ctx - 1
    return seqs


def decode_step(driver: PagedDriver, seqs) -> None:
    for s in seqs:
        s.num_cached -= 1  # re-decode the same position: constant context length across reps
    driver.step([], seqs)


def summary(ts: list[float]) -> dict:
    """min is the figure on a shared machine (least disturbed run); median shows how busy it was."""
    return {"min": round(1e3 * min(ts), 2), "median": round(1e3 * statistics.median(ts), 2)}


def speed(dtype: str, reps: int) -> dict:
    lm = load_model(MODEL, dtype=dtype)
    arch, out = lm.arch, {}
    with torch.inference_mode():
        for batch in (1, 32):
            driver = PagedDriver(lm.model, arch, lm.dtype, max_seqs=batch, max_len=256)
            seqs = fake_context(driver, batch, 200)
            ts = timed(lambda seqs=seqs, driver=driver: decode_step(driver, seqs), reps)
            out[f"decode_b{batch}_ctx200_ms"] = summary(ts)
        for n in (128, 512):
            driver = PagedDriver(lm.model, arch, lm.dtype, max_seqs=1, max_len=n)
            seq = driver.new_seq(list(range(100, 100 + n)))

            def prefill(seq=seq, driver=driver, n=n):
                seq.num_cached = 0
                driver.step([(seq, n)], [])

            out[f"prefill_{n}_ms"] = summary(timed(prefill, max(3, reps // 4)))
    out["decode_b32_tok_per_s"] = {k: round(32e3 / v, 1) for k, v in out["decode_b32_ctx200_ms"].items()}
    return out


def parity(dtype: str, new_tokens: int = 32) -> dict:
    """Against transformers float32 on the same (dequantized) weights: greedy continuations of chat prompts and
    of W-style word-salad prompts, and logits at every prompt position (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    from llmdeploy.engine.weights_cache import cached_gguf_folder

    lm = load_model(MODEL, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(cached_gguf_folder(lm.source.path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run every continuation to its full length on both sides
    prompts = [chat_ids(lm.tokenizer, t) for t in PROMPTS] + [salad_ids(lm.tokenizer, i) for i in range(4)]
    same, first_diff, max_diff, scale = 0, [], 0.0, 0.0
    with torch.inference_mode():
        for ids in prompts:
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[
                0, len(ids) :
            ].tolist()
            driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=1, max_len=len(ids) + new_tokens + 1)
            got = driver.generate_greedy([ids], new_tokens)[0]
            same += got == ref
            first_diff.append(
                next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
            )
            ref_logits = hf(torch.tensor([ids])).logits[0].float()
            d2 = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=1, max_len=len(ids))
            hidden, _ = d2.forward([(d2.new_seq(ids), len(ids))], [])
            max_diff = max(max_diff, float((lm.model.compute_logits(hidden) - ref_logits).abs().max()))
            scale = max(scale, float(ref_logits.abs().max()))
    return {
        "greedy_identical": f"{same}/{len(prompts)} ({new_tokens} tokens)",
        "first_divergence": first_diff,
        "logits_max_abs_diff": round(max_diff, 5),
        "logits_max_abs": round(scale, 2),
    }


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def salad_ids(tok, i: int, n: int = 128) -> list[int]:
    """W's prompts: exactly n token ids of deterministic word salad (as in cpu-baseline.md)."""
    rng = random.Random(1000 + i)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "his",
        "her",
        "are",
        "an",
        "have",
        "be",
        "one",
        "first",
    ]
    text = f"Request {i}. Summarize the following notes about the " + " ".join(
        rng.choice(words) for _ in range(400)
    )
    return tok(text)["input_ids"][:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("LLMDEPLOY_THREADS", "2")))
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": torch.get_num_threads(),
        "compile": os.environ.get("LLMDEPLOY_COMPILE", "default"),
        "load_avg": os.getloadavg(),
    }
    for dtype in args.dtypes.split(","):
        results[dtype] = speed(dtype, args.reps)
        if args.parity:
            results[dtype]["parity"] = parity(dtype)
        print(dtype, json.dumps(results[dtype], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
