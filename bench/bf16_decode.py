"""bfloat16 against float32 at decode and prefill, on any CPU: the engine serving SmolLM2 in bf16 with its native bf16
linear (vdpbf16ps on AVX-512 BF16; elsewhere, on AVX2 + FMA, each weight widened to float32: csrc/bf16_linear_avx2.c)
beside bf16 through torch's matmuls (LLMDEPLOY_NATIVE_LINEAR=0 at load: what bf16 ran before on AVX2 CPUs, which
torch emulates) and the native float32 engine, alternating in one process.

    python bench/bf16_decode.py [--batches 1,2,4,8,16] [--steps 16] [--passes 2] [--ttft 128,512] [--skip-torch]

Decode cells: the median ms of --steps decode-only steps after the batch's prefills, best of --passes, and each
step's roofline floor (bench/small_batches.py) at the variant's weight bytes. TTFT: one fresh prompt a request,
median of 5 after a warm-up. The torch variant is slow where bf16 is emulated (seconds a step at batch 16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ceilings  # noqa: E402
from bench.small_batches import MODEL, decode_step_ms, floor_ms  # noqa: E402
from llmdeploy.engine import LLM, SamplingParams  # noqa: E402


def load(dtype: str, native: bool) -> LLM:
    """The engine at `dtype`; native=False packs no projection for the native kernels (torch's matmuls run them)."""
    os.environ["LLMDEPLOY_NATIVE_LINEAR"] = "1" if native else "0"
    try:
        return LLM(model=MODEL, dtype=dtype, max_num_seqs=64)
    finally:
        os.environ.pop("LLMDEPLOY_NATIVE_LINEAR", None)


def ttft_ms(llm: LLM, prompt_len: int, salt: int, reps: int = 5) -> float:
    vocab = llm.engine.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(reps + 1):
        ids = [((salt + r) * 7919 + 13 * j) % (vocab - 10) + 5 for j in range(prompt_len)]
        t = time.perf_counter()
        llm.generate_ids([ids], params)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--ttft", default="128,512", help="prompt lengths timed for TTFT ('' for none)")
    ap.add_argument("--skip-torch", action="store_true", help="leave out bf16 through torch's matmuls")
    args = ap.parse_args()
    print(ceilings.cpu_info().line())
    variants = {"bf16 native": ("bfloat16", True), "float32": ("float32", True)}
    if not args.skip_torch:
        variants["bf16 torch"] = ("bfloat16", False)
    engines = {name: load(dtype, native) for name, (dtype, native) in variants.items()}
    shape = ceilings.smollm2_shape()
    c = ceilings.measure(shape, ["float32", "bfloat16"], quick=True)
    print(f"read bandwidth {c.read_gbps:.1f} GB/s; decode step ms (x its floor), best of {args.passes}")
    print(f"{'batch':>5} " + " ".join(f"{name:>18}" for name in engines) + "  native bf16 / float32")
    salt = 0
    for batch in [int(b) for b in args.batches.split(",")]:
        # a variant's best ms, and the mean context its steps ran at (bursts run further)
        best, context = {}, {}
        for _ in range(args.passes):
            for name, llm in engines.items():
                salt += 1
                ms, context[name] = decode_step_ms(llm, batch, args.prompt_len, args.steps, salt)
                best[name] = min(best.get(name, ms), ms)
        cells = []
        for name, ms in best.items():
            floor = floor_ms(shape, c, variants[name][0], batch, round(context[name]))
            cells.append(f"{ms:9.2f} ({ms / floor:4.2f}x)")
        print(f"{batch:5d} " + " ".join(f"{cell:>18}" for cell in cells), end="")
        print(f"  {best['bf16 native'] / best['float32']:.2f}", flush=True)
    for prompt_len in [int(n) for n in args.ttft.split(",") if n]:
        cells = [f"{ttft_ms(llm, prompt_len, 1000 + prompt_len):9.1f} ms" for llm in engines.values()]
        print(f"TTFT({prompt_len}) " + " ".join(f"{cell:>18}" for cell in cells), flush=True)
    print(ceilings.cpu_info().line())


if __name__ == "__main__":
    main()
