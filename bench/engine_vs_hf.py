"""Issue 3's throughput benchmark: this engine against transformers on SmolLM2-135M-Instruct, one invocation.

    python bench/engine_vs_hf.py [--dtypes float32,bfloat16] [--seq-subset 4] [--json out.json]

Workload W: 32 requests x 128 prompt tokens x 128 output tokens, greedy, EOS ignored (transformers:
min_new_tokens=128; engine: ignore_eos). Prompts are deterministic word salad cut to exactly 128 token ids.
  (a) transformers generate, one request at a time: --seq-subset requests are timed and the mean is
      extrapolated to 32 (said so in the output);
  (b) transformers generate, static batch of 32;
  (c) this engine, all 32 submitted at once (LLM.generate); its prefix cache is emptied before each run.
With --repeat N, (b) and (c) run N times and the fastest counts (on a shared machine the least disturbed run).
(b) and (c) run at every --dtypes entry, so each ratio is quoted at the same dtype as well as default against
default (transformers: float32; the engine: dtype auto). Then the engine's latency at batch 1: TTFT of a
128-token prompt and decode ms/token (median of --latency-reps). All models are warmed up before timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdeploy.engine import LLM, SamplingParams  # noqa: E402
from llmdeploy.engine.loader import resolve_dtype  # noqa: E402
from llmdeploy.engine.weights_cache import ensure_converted  # noqa: E402
from llmdeploy.spec.sources import resolve_model_source  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
N_REQ, PROMPT_LEN, OUT_LEN = 32, 128, 128
WORD_TEXT = (
    "the of and to in is was for on that by with as at from his her it an are were which this be or has had not "
    "first one their its new after who they have two been other when there all during into school time may years "
    "more most only over city some world would where later up such used many can state about national out known "
    "university united then made team film through river village station island mountain valley bridge harbor"
)
WORDS = WORD_TEXT.split(" ")


def workload(tokenizer) -> list[list[int]]:
    prompts = []
    for i in range(N_REQ):
        r = random.Random(1000 + i)
        text = f"Request {i}. Summarize the following notes: " + " ".join(r.choice(WORDS) for _ in range(400))
        ids = tokenizer.encode(text)[:PROMPT_LEN]
        assert len(ids) == PROMPT_LEN
        prompts.append(ids)
    return prompts


def hf_model(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_generate(model, batch: list[list[int]], max_new: int = OUT_LEN) -> torch.Tensor:
    ids = torch.tensor(batch)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == ids.shape[1] + max_new
    return out[:, ids.shape[1] :]


def hf_sequential(model, prompts: list[list[int]], subset: int) -> dict:
    hf_generate(model, [prompts[0][:16]], 8)  # warm-up
    times = []
    for p in prompts[:subset]:
        t = time.perf_counter()
        hf_generate(model, [p])
        times.append(time.perf_counter() - t)
    wall = statistics.mean(times) * N_REQ
    return {
        "wall_s": wall,
        "tok_s": N_REQ * OUT_LEN / wall,
        "timed_requests": subset,
        "extrapolated": subset < N_REQ,
    }


def best_of(repeat: int, run) -> tuple[dict, list[list[int]]]:
    """Time `run` `repeat` times; wall = the fastest (on a shared machine the least disturbed), median kept too."""
    walls, tokens = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        tokens = run()
        walls.append(time.perf_counter() - t)
    wall = min(walls)
    return {
        "wall_s": wall,
        "tok_s": N_REQ * OUT_LEN / wall,
        "median_wall_s": statistics.median(walls),
    }, tokens


def hf_static(model, prompts: list[list[int]], repeat: int) -> tuple[dict, list[list[int]]]:
    hf_generate(model, [p[:16] for p in prompts[:4]], 8)  # warm-up
    return best_of(repeat, lambda: hf_generate(model, prompts).tolist())


def engine_run(llm: LLM, prompts: list[list[int]], repeat: int) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    def run() -> list[list[int]]:
        assert llm.engine.block_manager.reset_prefix_cache()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    res, tokens = best_of(repeat, run)
    assert all(len(t) == OUT_LEN for t in tokens)
    return res, tokens


def engine_latency(llm: LLM, prompt: list[int], reps: int) -> dict:
    """TTFT of one 128-token prompt on an idle engine, and its decode ms/token (median inter-token gap)."""
    engine, ttft, itl = llm.engine, [], []
    engine.stream = True
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(reps + 1):  # the first run is a warm-up
        ids = [(prompt[0] + 1 + i) % engine.arch.vocab_size] + prompt[
            1:
        ]  # a new first token: no prefix-cache help
        t0 = time.perf_counter()
        engine.add_request(f"latency-{i}", ids, params)
        stamps = []
        while engine.has_unfinished():
            if engine.step():
                stamps.append(time.perf_counter())
        if i:
            ttft.append(stamps[0] - t0)
            itl.append(statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False)))
    engine.stream = False
    return {"ttft_128_s": statistics.median(ttft), "decode_ms_per_token_b1": 1000 * statistics.median(itl)}


def agreement(a: list[list[int]], b: list[list[int]], n: int = 16) -> float:
    """Share of requests whose first n greedy tokens agree (fp32 batches may drift apart late; bf16 earlier)."""
    return sum(x[:n] == y[:n] for x, y in zip(a, b, strict=True)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seq-subset", type=int, default=4, help="requests timed for (a), extrapolated to 32")
    ap.add_argument("--latency-reps", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1, help="time (b) and (c) this often; the fastest counts")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    folder = ensure_converted(resolve_model_source(MODEL).path)
    dtypes = args.dtypes.split(",")
    auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": torch.get_num_threads(),
        "engine_auto_dtype": auto,
        "workload": f"{N_REQ} x {PROMPT_LEN} prompt x {OUT_LEN} output, greedy, EOS ignored",
    }
    prompts = None
    hf_tokens: dict[str, list] = {}
    if not args.skip_hf:
        for dt in dtypes:
            model = hf_model(folder, getattr(torch, dt))
            if prompts is None:
                from transformers import AutoTokenizer

                prompts = workload(AutoTokenizer.from_pretrained(folder))
            if dt == "float32":
                res["a_hf_sequential_float32"] = hf_sequential(model, prompts, args.seq_subset)
                print(
                    "(a) transformers one at a time, float32:",
                    fmt(res["a_hf_sequential_float32"]),
                    flush=True,
                )
            res[f"b_hf_static32_{dt}"], hf_tokens[dt] = hf_static(model, prompts, args.repeat)
            print(f"(b) transformers static batch 32, {dt}:", fmt(res[f"b_hf_static32_{dt}"]), flush=True)
            del model
            gc.collect()
    for dt in dtypes:
        t = time.perf_counter()
        llm = LLM(model=MODEL, dtype=dt, max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens)
        load_s = time.perf_counter() - t
        prompts = prompts or workload(llm.tokenizer)
        res[f"c_engine_{dt}"], tokens = engine_run(llm, prompts, args.repeat)
        res[f"c_engine_{dt}"]["load_s"] = load_s
        if dt in hf_tokens:
            res[f"c_engine_{dt}"]["first16_agree_with_hf"] = agreement(tokens, hf_tokens[dt])
        print(f"(c) engine, all 32 at once, {dt}:", fmt(res[f"c_engine_{dt}"]), flush=True)
        res[f"latency_engine_{dt}"] = engine_latency(llm, prompts[0], args.latency_reps)
        print(f"    engine batch 1, {dt}:", fmt(res[f"latency_engine_{dt}"]), flush=True)
        del llm
        gc.collect()
    print_ratios(res, dtypes, auto)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def fmt(d: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def print_ratios(res: dict, dtypes: list[str], auto: str) -> None:
    a = res.get("a_hf_sequential_float32")
    if a and a["extrapolated"]:
        print(f"note: (a) timed {a['timed_requests']} of {N_REQ} requests and extrapolated")
    ratios = {}
    for dt in dtypes:
        c = res[f"c_engine_{dt}"]["tok_s"]
        if f"b_hf_static32_{dt}" in res:
            ratios[f"(c)/(b) {dt} vs {dt}"] = c / res[f"b_hf_static32_{dt}"]["tok_s"]
        if "b_hf_static32_float32" in res:
            ratios[f"(c)/(b) engine {dt} vs transformers default float32"] = (
                c / res["b_hf_static32_float32"]["tok_s"]
            )
        if a:
            ratios[f"(c)/(a) engine {dt} vs transformers float32"] = c / a["tok_s"]
    if f"c_engine_{auto}" in res and "b_hf_static32_float32" in res:
        ratios[f"(c)/(b) default vs default (engine auto={auto})"] = (
            res[f"c_engine_{auto}"]["tok_s"] / res["b_hf_static32_float32"]["tok_s"]
        )
    res["ratios"] = ratios
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")


if __name__ == "__main__":
    main()
