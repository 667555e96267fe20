"""Forward-pass speed and parity of the engine's model code on CPU, SmolLM2-135M shapes (builtin model).

    python bench/forward_cpu.py [--dtypes float32,bfloat16,int8] [--reps 20] [--workload] [--parity] [--json out.json]

(`int8` / `gguf` = float32 activations over the weights of model.quantization int8 / gguf; `gguf:bfloat16` with
bfloat16 activations.)

Speed: decode batch 1 and batch 32 at context ~200, prefill of 128 and 512 tokens (forward + last-row logits);
min and median of --reps. --workload: the forwards of issue 3's W alone. --parity: greedy tokens and logits
against transformers float32 on the same weights. LLMDEPLOY_COMPILE=0/1 selects torch.compile; on a shared
machine --quiet-load waits for a low load average first.
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


def wait_until_quiet(max_load: float, give_up_s: float = 900) -> None:
    """On a shared machine: wait (up to give_up_s) until the 1-minute load average is below max_load."""
    deadline = time.time() + give_up_s
    while max_load > 0 and os.getloadavg()[0] > max_load and time.time() < deadline:
        time.sleep(10)


def timed(fn, reps: int, first: list | None = None) -> list[float]:
    t = time.perf_counter()
    fn()  # warm-up (and compilation, when on)
    if first is not None:
        first.append(time.perf_counter() - t)
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


def load_variant(dtype: str):
    """A --dtypes entry -> the loaded model: a dtype, or a quantization (int8, gguf) with float32 activations,
    or QUANT:DTYPE (e.g. gguf:bfloat16)."""
    quant, _, act = dtype.partition(":")
    if quant in ("int8", "gguf"):
        return load_model(MODEL, dtype=act or "float32", quantization=quant)
    return load_model(MODEL, dtype=dtype)


def speed(dtype: str, reps: int) -> dict:
    lm = load_variant(dtype)
    arch, out = lm.arch, {}
    with torch.inference_mode():
        for batch in (1, 32):
            driver = PagedDriver(lm.model, arch, lm.dtype, max_seqs=batch, max_len=256)
            seqs = fake_context(driver, batch, 200)
            first: list[float] = []
            ts = timed(lambda seqs=seqs, driver=driver: decode_step(driver, seqs), reps, first)
            out[f"decode_b{batch}_ctx200_ms"] = summary(ts)
            out[f"decode_b{batch}_first_call_s"] = round(first[0], 2)
        for n in (128, 512):
            driver = PagedDriver(lm.model, arch, lm.dtype, max_seqs=1, max_len=n)
            seq = driver.new_seq(list(range(100, 100 + n)))

            def prefill(seq=seq, driver=driver, n=n):
                seq.num_cached = 0
                driver.step([(seq, n)], [])

            out[f"prefill_{n}_ms"] = summary(timed(prefill, max(3, reps // 4)))
    out["decode_b32_tok_per_s"] = {k: round(32e3 / v, 1) for k, v in out["decode_b32_ctx200_ms"].items()}
    return out


def workload_w(dtype: str) -> dict:
    """The forward passes of issue 3's W alone (no scheduler, sampler or detokenizer): 32 salad prompts of 128
    tokens prefilled 16 at a time (2048 tokens per step), then 127 greedy decode steps of the 32 sequences."""
    lm = load_variant(dtype)
    prompts = [salad_ids(lm.tokenizer, i) for i in range(32)]
    driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=32, max_len=257)
    seqs = [driver.new_seq(p) for p in prompts]
    with torch.inference_mode():
        driver.step([(seqs[0], 16)], [])  # warm-up, then start over
        seqs[0].num_cached = 0
        t0 = time.perf_counter()
        last = torch.cat([driver.step([(s, 128) for s in seqs[i : i + 16]], []) for i in (0, 16)])
        t1 = time.perf_counter()
        for _ in range(127):
            for s, token in zip(seqs, last.argmax(-1).tolist(), strict=True):
                s.tokens.append(token)
            last = driver.step([], seqs)
        t2 = time.perf_counter()
    return {
        "prefill_s": round(t1 - t0, 2),
        "decode_s": round(t2 - t1, 2),
        "output_tok_per_s": round(32 * 128 / (t2 - t0), 1),
    }


def parity(dtype: str, new_tokens: int = 32) -> dict:
    """Against transformers float32 on the same (dequantized) weights: greedy continuations of chat prompts and
    of W-style word-salad prompts, and logits at every prompt position (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    from llmdeploy.engine.weights_cache import cached_gguf_folder

    lm = load_variant(dtype)
    hf = AutoModelForCausalLM.from_pretrained(cached_gguf_folder(lm.source.path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run every continuation to its full length on both sides
    prompts = [chat_ids(lm.tokenizer, t) for t in PROMPTS] + [salad_ids(lm.tokenizer, i) for i in range(4)]
    same, first_diff, agree, total, max_diff, scale = 0, [], 0, 0, 0.0, 0.0
    with torch.inference_mode():
        for ids in prompts:
            ref = hf_greedy(hf, ids, new_tokens)
            driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=1, max_len=len(ids) + new_tokens + 1)
            got = driver.generate_greedy([ids], new_tokens)[0]
            same += got == ref
            first_diff.append(
                next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
            )
            # teacher-forced along transformers' continuation: top-1 agreement and logits at every position
            full = ids + ref[:-1]
            ref_logits = hf(torch.tensor([full])).logits[0].float()
            d2 = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=1, max_len=len(full))
            hidden, _ = d2.forward([(d2.new_seq(full), len(full))], [])
            ours = lm.model.compute_logits(hidden)
            agree += int((ours[len(ids) - 1 :].argmax(-1) == torch.tensor(ref)).sum())
            total += len(ref)
            max_diff = max(max_diff, float((ours - ref_logits).abs().max()))
            scale = max(scale, float(ref_logits.abs().max()))
    return {
        "greedy_identical": f"{same}/{len(prompts)} ({new_tokens} tokens)",
        "first_divergence": first_diff,
        "first16_agree": f"{sum(d is None or d >= 16 for d in first_diff)}/{len(first_diff)}",
        "teacher_forced_top1_agreement": round(agree / total, 4),
        "logits_max_abs_diff": round(max_diff, 5),
        "logits_max_abs": round(scale, 2),
    }


def hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation. The explicit mask matters: without it generate masks every prompt
    token equal to pad_token_id once eos_token_id is unset (SmolLM2's pad is <|im_end|>)."""
    mask = torch.ones(1, len(ids), dtype=torch.long)
    out = hf.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def chat_ids(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok(chat, add_special_tokens=False)["input_ids"]


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
    ap.add_argument("--workload", action="store_true", help="also time the forwards of W (32 x 128 + 128)")
    ap.add_argument("--json")
    ap.add_argument("--quiet-load", type=float, default=0.0, help="wait for a 1-min load average below this")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("LLMDEPLOY_THREADS", "2")))
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": torch.get_num_threads(),
        "compile": os.environ.get("LLMDEPLOY_COMPILE", "default"),
        "load_avg": os.getloadavg(),
    }
    for dtype in args.dtypes.split(","):
        wait_until_quiet(args.quiet_load)
        results[dtype] = speed(dtype, args.reps)
        if args.workload:
            results[dtype]["workload_w"] = workload_w(dtype)
        results[dtype]["load_avg_after"] = os.getloadavg()
        if args.parity:
            results[dtype]["parity"] = parity(dtype)
        print(dtype, json.dumps(results[dtype], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
