"""Issue 3's and 13's throughput benchmark: this engine against transformers on SmolLM2-135M-Instruct, one
invocation, with the machine's ceilings measured in the same run (bench/ceilings.py).

    python bench/engine_vs_hf.py [--dtypes float32,bfloat16] [--workloads W,S] [--repeat 2] [--json out.json]

Workload W: 32 requests x 128 prompt tokens x 128 output tokens, greedy, EOS ignored (transformers:
min_new_tokens=128; engine: ignore_eos). Workload S: 32 x 64 prompt x 64 output. Prompts are deterministic word
salad cut to exactly the prompt length in token ids.
  (a) transformers generate, one request at a time (W only): --seq-subset requests are timed and the mean is
      extrapolated to 32 (said so in the output);
  (b) transformers generate, static batch of 32;
  (c) this engine, all 32 submitted at once (LLM.generate); its prefix cache is emptied before each run.
With --repeat N, (b) and (c) run N times and the fastest counts (on a shared machine the least disturbed run).
(b) and (c) run at every --dtypes entry (default: float32, plus bfloat16 where the CPU has native bf16), so each
ratio is quoted at the same dtype as well as default against default (transformers: float32; the engine: dtype
auto). `--engine-only int8` adds engine runs with int8 weights (model.quantization). Then the engine's latency at
batch 1: TTFT of a 128-token prompt and decode ms/token (median of --latency-reps). All models are warmed up
before timing. At the end every engine figure is printed as a share of its ceiling: W tok/s against the compute
ceiling, batch-1 ms/token against the bandwidth floor, TTFT against the prefill compute floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ceilings  # noqa: E402
from llmdeploy.engine import LLM, SamplingParams  # noqa: E402
from llmdeploy.engine.loader import resolve_dtype_for  # noqa: E402
from llmdeploy.engine.weights_cache import ensure_converted  # noqa: E402
from llmdeploy.spec.sources import resolve_model_source  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
WORD_TEXT = (
    "the of and to in is was for on that by with as at from his her it an are were which this be or has had not "
    "first one their its new after who they have two been other when there all during into school time may years "
    "more most only over city some world would where later up such used many can state about national out known "
    "university united then made team film through river village station island mountain valley bridge harbor"
)
WORDS = WORD_TEXT.split(" ")


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    output_len: int

    @property
    def output_tokens(self) -> int:
        return self.num_requests * self.output_len


WORKLOADS = {"W": Workload("W", 32, 128, 128), "S": Workload("S", 32, 64, 64)}
W = WORKLOADS["W"]


def workload(tokenizer, w: Workload = W) -> list[list[int]]:
    prompts = []
    for i in range(w.num_requests):
        r = random.Random(1000 + i)
        text = f"Request {i}. Summarize the following notes: " + " ".join(r.choice(WORDS) for _ in range(400))
        ids = tokenizer.encode(text)[: w.prompt_len]
        assert len(ids) == w.prompt_len
        prompts.append(ids)
    return prompts


def hf_model(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_generate(model, batch: list[list[int]], max_new: int) -> torch.Tensor:
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


def hf_sequential(model, prompts: list[list[int]], subset: int, w: Workload = W) -> dict:
    hf_generate(model, [prompts[0][:16]], 8)  # warm-up
    times = []
    for p in prompts[:subset]:
        t = time.perf_counter()
        hf_generate(model, [p], w.output_len)
        times.append(time.perf_counter() - t)
    wall = statistics.mean(times) * w.num_requests
    return {
        "wall_s": wall,
        "tok_s": w.output_tokens / wall,
        "timed_requests": subset,
        "extrapolated": subset < w.num_requests,
    }


def best_of(repeat: int, run, w: Workload) -> tuple[dict, list[list[int]]]:
    """Time `run` `repeat` times; wall = the fastest (on a shared machine the least disturbed), median kept too."""
    walls, tokens = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        tokens = run()
        walls.append(time.perf_counter() - t)
    wall = min(walls)
    return {
        "wall_s": wall,
        "tok_s": w.output_tokens / wall,
        "median_wall_s": statistics.median(walls),
    }, tokens


def hf_static(model, prompts: list[list[int]], repeat: int, w: Workload) -> tuple[dict, list[list[int]]]:
    hf_generate(model, [p[:16] for p in prompts[:4]], 8)  # warm-up
    return best_of(repeat, lambda: hf_generate(model, prompts, w.output_len).tolist(), w)


def engine_run(llm: LLM, prompts: list[list[int]], repeat: int, w: Workload) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    def run() -> list[list[int]]:
        assert llm.engine.block_manager.reset_prefix_cache()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    res, tokens = best_of(repeat, run, w)
    assert all(len(t) == w.output_len for t in tokens)
    return res, tokens


def engine_latency(llm: LLM, prompt: list[int], reps: int) -> dict:
    """TTFT of one 128-token prompt on an idle engine, and its decode ms/token (median inter-token gap; tokens
    that come out of one step together, a decode burst's, share the time since the previous output, as the
    server's inter-token metric counts them). Before each run and after the last the read bandwidth is sampled
    again (the floor of that moment: a shared host's moves a lot)."""
    engine, ttft, itl, gbps = llm.engine, [], [], []
    engine.stream = True
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(reps + 1):  # the first run is a warm-up
        # a new first token: no prefix-cache help
        ids = [(prompt[0] + 1 + i) % engine.arch.vocab_size] + prompt[1:]
        if i:
            gbps.append(ceilings.read_bandwidth_gbps(256, 0.25))
        t0 = time.perf_counter()
        engine.add_request(f"latency-{i}", ids, params)
        stamps = []  # (when an output came, its new tokens)
        while engine.has_unfinished():
            if outs := engine.step():
                stamps.append(
                    (time.perf_counter(), sum(len(c.delta_token_ids) for o in outs for c in o.outputs))
                )
        if i:
            ttft.append(stamps[0][0] - t0)
            gaps = [(b - a) / n for (a, _), (b, n) in zip(stamps, stamps[1:], strict=False) for _ in range(n)]
            itl.append(statistics.median(gaps))
    gbps.append(ceilings.read_bandwidth_gbps(256, 0.25))
    engine.stream = False
    return {
        "ttft_128_s": statistics.median(ttft),
        "decode_ms_per_token_b1": 1000 * statistics.median(itl),
        "decode_ms_b1_runs": [1000 * x for x in itl],
        "read_gbps_b1_runs": gbps,  # sampled before each run and after the last
    }


def agreement(a: list[list[int]], b: list[list[int]], n: int = 16) -> float:
    """Share of requests whose first n greedy tokens agree (fp32 batches may drift apart late; bf16 earlier)."""
    return sum(x[:n] == y[:n] for x, y in zip(a, b, strict=True)) / len(a)


@dataclass(frozen=True)
class EngineVariant:
    """One engine configuration to time: a dtype, and int8 weights or not."""

    dtype: str
    quantization: str = "none"

    @property
    def label(self) -> str:
        return self.dtype if self.quantization == "none" else f"{self.quantization}-{self.dtype}"

    @property
    def weight_dtype(self) -> str:  # what the bandwidth floor counts
        return self.dtype if self.quantization == "none" else self.quantization


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default=None, help="default: float32, plus bfloat16 where the CPU has it")
    ap.add_argument("--engine-only", default="", help="extra engine-only variants, e.g. int8 (int8 weights)")
    ap.add_argument("--workloads", default="W,S", help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--seq-subset", type=int, default=4, help="requests timed for (a), extrapolated to 32")
    ap.add_argument("--latency-reps", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1, help="time (b) and (c) this often; the fastest counts")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-ceilings", action="store_true")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    folder = ensure_converted(resolve_model_source(MODEL).path)
    dtypes = args.dtypes.split(",") if args.dtypes else ceilings.default_dtypes()
    variants = [EngineVariant(d) for d in dtypes]
    variants += [EngineVariant("float32", q) for q in args.engine_only.split(",") if q]
    workloads = [WORKLOADS[n] for n in args.workloads.split(",")]
    from transformers import AutoConfig

    auto_dtype, why = resolve_dtype_for("auto", torch.device("cpu"), AutoConfig.from_pretrained(folder))
    auto = str(auto_dtype).removeprefix("torch.")
    print(f"engine dtype auto on this CPU: {why}", flush=True)
    info = ceilings.cpu_info()
    print(info.line(), flush=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": info.line(), "engine_auto_dtype": auto}
    shape = ceilings.smollm2_shape()
    ceil = None
    if not args.skip_ceilings:
        ceil = ceilings.measure(shape, sorted(set(dtypes) | {"float32"}))
        res["ceilings"] = ceil.to_json()
        print("\n".join(ceilings.report(shape, ceil)), flush=True)
    hf_tokens: dict[tuple[str, str], list] = {}
    if not args.skip_hf:
        run_transformers(folder, dtypes, workloads, args, res, hf_tokens)
    for v in variants:
        run_engine(v, workloads, args, res, hf_tokens)
    print_ratios(res, dtypes, variants, workloads, auto)
    if ceil is not None:
        print_shares(res, shape, ceil, variants)
    print(ceilings.cpu_info().line())
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def run_transformers(folder: Path, dtypes, workloads, args, res: dict, hf_tokens: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    for dt in dtypes:
        model = hf_model(folder, getattr(torch, dt))
        for w in workloads:
            prompts = workload(tok, w)
            if dt == "float32" and w.name == "W":
                res["a_hf_sequential_float32"] = hf_sequential(model, prompts, args.seq_subset, w)
                print(
                    "(a) transformers one at a time, float32:",
                    fmt(res["a_hf_sequential_float32"]),
                    flush=True,
                )
            key = f"b_hf_static32_{dt}" + ("" if w.name == "W" else f"_{w.name}")
            res[key], hf_tokens[(dt, w.name)] = hf_static(model, prompts, args.repeat, w)
            print(f"(b) {w.name} transformers static batch 32, {dt}:", fmt(res[key]), flush=True)
        del model
        gc.collect()


def run_engine(v: EngineVariant, workloads, args, res: dict, hf_tokens: dict) -> None:
    t = time.perf_counter()
    extra = {"quantization": v.quantization} if v.quantization != "none" else {}
    llm = LLM(
        model=MODEL,
        dtype=v.dtype,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **extra,
    )
    load_s = time.perf_counter() - t
    for w in workloads:
        prompts = workload(llm.tokenizer, w)
        key = f"c_engine_{v.label}" + ("" if w.name == "W" else f"_{w.name}")
        res[key], tokens = engine_run(llm, prompts, args.repeat, w)
        res[key]["load_s"] = load_s
        ref = hf_tokens.get((v.dtype, w.name)) or hf_tokens.get(("float32", w.name))
        if ref is not None:
            res[key]["first16_agree_with_hf"] = agreement(tokens, ref)
        print(f"(c) {w.name} engine, all 32 at once, {v.label}:", fmt(res[key]), flush=True)
    res[f"latency_engine_{v.label}"] = engine_latency(llm, workload(llm.tokenizer)[0], args.latency_reps)
    print(f"    engine batch 1, {v.label}:", fmt(res[f"latency_engine_{v.label}"]), flush=True)
    del llm
    gc.collect()


def fmt(d: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def print_ratios(res: dict, dtypes: list[str], variants, workloads, auto: str) -> None:
    a = res.get("a_hf_sequential_float32")
    if a and a["extrapolated"]:
        print(f"note: (a) timed {a['timed_requests']} of {W.num_requests} requests and extrapolated")
    ratios = {}
    for w in workloads:
        sfx = "" if w.name == "W" else f"_{w.name}"
        hf32 = res.get(f"b_hf_static32_float32{sfx}")
        for v in variants:
            c = res[f"c_engine_{v.label}{sfx}"]["tok_s"]
            same = res.get(f"b_hf_static32_{v.dtype}{sfx}")
            if same and v.quantization == "none":
                ratios[f"{w.name} (c)/(b) {v.label} vs {v.dtype}"] = c / same["tok_s"]
            if hf32:
                ratios[f"{w.name} (c)/(b) engine {v.label} vs transformers default float32"] = (
                    c / hf32["tok_s"]
                )
            if a and w.name == "W":
                ratios[f"W (c)/(a) engine {v.label} vs transformers float32 one at a time"] = c / a["tok_s"]
        if f"c_engine_{auto}{sfx}" in res and hf32:
            ratios[f"{w.name} (c)/(b) default vs default (engine auto={auto})"] = (
                res[f"c_engine_{auto}{sfx}"]["tok_s"] / hf32["tok_s"]
            )
    res["ratios"] = ratios
    for k, val in ratios.items():
        print(f"{k}: {val:.2f}x")


def b1_runs(latency: dict) -> list[ceilings.B1Run]:
    ms, gbps = latency.get("decode_ms_b1_runs", []), latency.get("read_gbps_b1_runs", [])
    return [ceilings.B1Run(m, a, b) for m, a, b in zip(ms, gbps, gbps[1:], strict=False)]


def print_shares(res: dict, shape, ceil, variants) -> None:
    """Each engine figure as a share of the ceiling measured at the start of this run."""
    print("engine figures against this machine's ceilings (measured at the start of the run):")
    for v in variants:
        lat = res.get(f"latency_engine_{v.label}", {})
        lines = ceilings.shares(
            shape,
            ceil,
            v.weight_dtype if v.quantization != "none" else v.dtype,
            w_tok_s=res.get(f"c_engine_{v.label}", {}).get("tok_s"),
            b1_ms=lat.get("decode_ms_per_token_b1"),
            ttft_s=lat.get("ttft_128_s"),
            b1_runs=b1_runs(lat),
        )
        for line in lines:
            print(f"  [{v.label}] {line}")


if __name__ == "__main__":
    main()
