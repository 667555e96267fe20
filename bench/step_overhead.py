"""Per-step CPU overhead of the engine around the forward pass at batch-32 decode (issue 13: under 5% of a step).

    python bench/step_overhead.py [--model builtin:smollm2-135m-instruct] [--batch 32] [--steps 60] [--dtype float32]
                                [--quantization none]

32 requests of 128 prompt tokens decode together (greedy, EOS ignored). Each timed step of LLMEngine.step() is split
into: schedule (Scheduler.schedule), prepare (ModelRunner.prepare: input ids, positions, slot mapping, block
tables), forward (the model and its logits, or the native call from token ids to logits that replaces both on CPU,
or to greedy tokens where the LM head's screen reads the head: the argmax is then in it), sample (Sampler) and the rest (post-processing: appending tokens, stop checks, detokenization, outputs, metrics).
Overhead = step - forward. Medians over --steps steps; on a shared machine read the medians, not the means.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ceilings import cpu_info  # noqa: E402
from llmdeploy.engine import LLM, SamplingParams  # noqa: E402

PARTS = ("schedule", "prepare", "forward", "sample")


class Timings:
    """Seconds spent in each wrapped call during the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += time.perf_counter() - t

        return timed

    def take(self) -> dict[str, float]:
        out, self.now = self.now, dict.fromkeys(PARTS, 0.0)
        return out


class TimedSampler:
    """The engine's sampler with its calls timed; everything else (a burst's rewind) passes through."""

    def __init__(self, sampler, timed) -> None:
        self.sampler, self.timed = sampler, timed

    def __call__(self, *args, **kwargs):
        return self.timed(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)


def instrument(llm: LLM) -> Timings:
    """Wraps the engine's scheduler, runner and sampler calls of one step (instance attributes only)."""
    engine, runner, t = llm.engine, llm.engine.runner, Timings()
    engine.scheduler.schedule = t.wrap("schedule", engine.scheduler.schedule)
    runner.prepare = t.wrap("prepare", runner.prepare)
    model = runner.model
    # the Python model's forward and head, and the native calls that replace both on CPU (one call from token ids
    # to logits, or a burst of greedy steps): each is the forward
    for name in ("forward", "compute_logits", "decode_logits", "decode_greedy"):
        if hasattr(model, name):
            setattr(model, name, t.wrap("forward", getattr(model, name)))
    engine.sampler = TimedSampler(engine.sampler, t.wrap("sample", engine.sampler))
    return t


def measure(llm: LLM, batch: int, prompt_len: int, steps: int) -> list[dict[str, float]]:
    engine = llm.engine
    vocab = engine.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(prompt_len)]
        engine.add_request(f"r{i}", ids, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefills (not timed)
    for _ in range(3):
        engine.step()  # warm decode steps
    timings = instrument(llm)
    rows = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        parts = timings.take()
        parts["rest"] = total - sum(parts.values())
        parts["step"] = total
        rows.append(parts)
    while engine.has_unfinished():
        engine.step()
    return rows


def report(rows: list[dict[str, float]], batch: int) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    overheads = [r["step"] - r["forward"] for r in rows]
    shares = [(r["step"] - r["forward"]) / r["step"] for r in rows]
    med["overhead"] = statistics.median(overheads)
    med["overhead_share"] = statistics.median(shares)
    print(f"batch-{batch} decode step, medians over {len(rows)} steps:")
    for k in ("step", "forward", "schedule", "prepare", "sample", "rest", "overhead"):
        print(f"  {k:9s} {med[k] * 1e3:8.3f} ms")
    verdict = "under" if med["overhead_share"] < 0.05 else "NOT under"
    print(f"  overhead = {med['overhead_share']:.1%} of the step ({verdict} the 5% target)")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--quantization", default="none", help="model.quantization: none, int8, gguf")
    args = ap.parse_args()
    print(cpu_info().line())
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=max(64, args.batch),
        decode_burst=1,  # one step a call, so each is split as above (a burst runs several in C at once)
    )
    torch.manual_seed(0)
    report(measure(llm, args.batch, args.prompt_len, args.steps), args.batch)
    print(cpu_info().line())


if __name__ == "__main__":
    main()
