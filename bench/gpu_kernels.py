"""GPU benchmark of the Triton kernels and of the engine end to end. Nothing comes from the network.

    python bench/gpu_kernels.py [--out results.json] [--peak-gbps N] [--skip-engine] [--no-sweep] [--no-compile]
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --quick --device cpu      # smoke test of the script logic

Kernels: time (triton.testing.do_bench, median) and achieved bandwidth against the device's peak HBM bandwidth
(looked up by device name, or --peak-gbps) for decode attention (target: >= 60% of peak at batch 64 x 2k
context on an H200), prefill attention, store_kv, rms_norm and rotary, each beside its pure-PyTorch reference
and, where torch has one, its fused op (dense flash SDPA, F.rms_norm, torch.compile of the reference).
Tuning sweeps of the attention kernels' tile/warp/stage/split knobs show whether the defaults are right.

Engine: a randomly initialised model of a real shape (Qwen3-0.6B or Llama-3.2-1B config below; speed does not
depend on the weights' values) served by LLM(..., kernel_backend="triton") against transformers' generate with
static batching on the same GPU: 256 requests, 512 prompt / 256 output tokens, ignore_eos (target: >= 5x).
The whole run takes a few minutes on an H200 (budget: 8).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Peak HBM bandwidth (GB/s) by device-name substring; first match wins, so specific names come first.
PEAK_GBPS = [
    ("GH200", 4000),
    ("H200", 4800),
    ("H100 NVL", 3900),
    ("H100 PCIe", 2000),
    ("H100", 3350),
    ("H800", 3350),
    ("H20", 4000),
    ("B200", 8000),
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),
    ("L40S", 864),
    ("L40", 864),
    ("L4", 300),
    ("A10G", 600),
    ("A10", 600),
    ("RTX 4090", 1008),
    ("V100", 900),
]
ENGINE_CONFIGS = {  # the published configs' shapes, written inline so nothing is fetched
    "qwen3-0.6b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}
FULL = dict(
    decode=[
        ("b64 ctx2k h32/8 d128", 64, 2048, 32, 8, 128, 16),
        ("b8 ctx8k h32/8 d128", 8, 8192, 32, 8, 128, 16),
        ("b256 ctx768 h16/8 d128", 256, 768, 16, 8, 128, 16),
        ("b64 ctx2k h32/8 d64 p32", 64, 2048, 32, 8, 64, 32),
    ],
    prefill=[
        ("8x1024 prompts h32/8 d128", 8, 1024, 1024, 32, 8, 128),
        ("4x512 after 1536 cached", 4, 512, 2048, 32, 8, 128),
    ],
    # tuning sweeps: a grid, then a second grid around the best point of the first
    sweep_decode=(
        dict(num_splits=(1, 2, 4, 8), block_n=(32, 64, 128), num_warps=(4,), num_stages=(2,)),
        dict(num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4)),
    ),
    sweep_prefill=(
        dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2,)),
        dict(num_stages=(1, 2, 3)),
    ),
    tokens=8192,
    hidden=4096,
    heads=(32, 8, 128),
)
QUICK = dict(
    decode=[("b2 ctx40 h4/2 d64", 2, 40, 4, 2, 64, 16)],
    prefill=[("2x24 prompts h4/2 d64", 2, 24, 24, 4, 2, 64), ("2x8 after 32 cached", 2, 8, 40, 4, 2, 64)],
    sweep_decode=(dict(num_splits=(1, 2), block_n=(16, 32)), dict(num_warps=(4,), num_stages=(2,))),
    sweep_prefill=(dict(block_m=(16, 32), block_n=(16,)), dict(num_stages=(2,))),
    tokens=8,
    hidden=64,
    heads=(4, 2, 64),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: under TRITON_INTERPRET=1")
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke test of this script)")
    ap.add_argument("--peak-gbps", type=float, help="peak HBM bandwidth in GB/s (default: looked up by name)")
    ap.add_argument("--skip-engine", action="store_true", help="kernels only")
    ap.add_argument("--skip-kernels", action="store_true", help="engine only")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning sweeps")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(ENGINE_CONFIGS))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument(
        "--hf-batch-sizes",
        default="256,64",
        help="transformers' static batch sizes to try (each halved on OOM); the best one is the baseline",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    return ap.parse_args(argv)


def peak_gbps(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


class Bench:
    """Times callables and collects result rows."""

    def __init__(self, device: str, peak: float | None):
        self.device, self.peak = device, peak
        self.rows: list[dict] = []
        self.sweeps: dict[str, list[dict]] = {}

    def time_ms(self, fn) -> float:
        import triton

        if self.device == "cuda":
            return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
        fn()
        times = []
        for _ in range(2):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    def row(self, op: str, shape: str, impl: str, fn, nbytes: float, flops: float = 0.0) -> dict | None:
        try:
            ms = self.time_ms(fn)
        except Exception as exc:  # a baseline the installed torch lacks must not sink the run
            print(f"  {op} {shape} {impl}: failed ({type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
            return None
        gbps = nbytes / ms / 1e6
        r = dict(
            op=op,
            shape=shape,
            impl=impl,
            ms=round(ms, 4),
            gbps=round(gbps, 1),
            peak_frac=round(gbps / self.peak, 3) if self.peak else None,
            tflops=round(flops / ms / 1e9, 1) if flops else None,
        )
        self.rows.append(r)
        return r


def decode_case(torch, batch, ctx, h, hkv, d, page, dtype, device):
    blocks_per_seq = -(-ctx // page)
    num_blocks = batch * blocks_per_seq + 1
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, blocks_per_seq).int()
    k = torch.randn(num_blocks, page, hkv, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, h, d, dtype=dtype, device=device)
    return q, k, v, tables, lens


def bench_decode(b: Bench, torch, shapes, dtype, space: tuple | None) -> None:
    from llmdeploy.kernels import reference, triton_ops
    from llmdeploy.kernels.triton_decode import decode_attention

    for name, batch, ctx, h, hkv, d, page in shapes:
        q, k, v, tables, lens = decode_case(torch, batch, ctx, h, hkv, d, page, dtype, b.device)
        scale, size = d**-0.5, dtype.itemsize
        nbytes = 2 * batch * ctx * hkv * d * size + 2 * q.numel() * size
        flops = 4 * batch * h * ctx * d
        args = (q, k, v, tables, lens, scale, ctx)
        b.row("decode", name, "triton", partial(triton_ops.paged_attention_decode, *args), nbytes, flops)
        b.row(
            "decode",
            name,
            "torch reference",
            partial(reference.paged_attention_decode, *args),
            nbytes,
            flops,
        )
        # dense flash SDPA on a contiguous cache: GQA folded into the query length, one head group per kv head
        kd = reference.gather_kv(k, tables, ctx).transpose(1, 2).contiguous()
        vd = reference.gather_kv(v, tables, ctx).transpose(1, 2).contiguous()
        qd = q.view(batch, hkv, h // hkv, d)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        b.row("decode", name, "torch SDPA dense", partial(sdpa, qd, kd, vd, scale=scale), nbytes, flops)
        del kd, vd
        if space and name == shapes[0][0]:
            sweep(b, "decode", partial(decode_attention, q, k, v, tables, lens, scale, ctx), space, nbytes)


def grid(axes: dict) -> list[dict]:
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def sweep(b: Bench, op: str, run, space: tuple[dict, dict], nbytes: float) -> None:
    """Time `run(**config)` over the grid space[0], then over space[1] around the best config of the first."""
    results = [(b.time_ms(partial(run, **cfg)), cfg) for cfg in grid(space[0])]
    best = min(results, key=lambda r: r[0])[1]
    results += [(b.time_ms(partial(run, **cfg)), cfg) for cfg in (dict(best, **g) for g in grid(space[1]))]
    results.sort(key=lambda r: r[0])
    b.sweeps[op] = [dict(cfg, ms=round(ms, 4), gbps=round(nbytes / ms / 1e6, 1)) for ms, cfg in results]
    print(f"  {op} sweep best: {b.sweeps[op][0]}  worst: {b.sweeps[op][-1]}", file=sys.stderr)


def prefill_case(torch, seqs, q_len, ctx, h, hkv, d, dtype, device, page=16):
    q, k, v, tables, lens = decode_case(torch, seqs, ctx, h, hkv, d, page, dtype, device)
    cu = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * q_len
    query = torch.randn(seqs * q_len, h, d, dtype=dtype, device=device)
    return query, k, v, cu, lens, tables


def bench_prefill(b: Bench, torch, shapes, dtype, space: tuple | None) -> None:
    from llmdeploy.kernels import reference, triton_ops
    from llmdeploy.kernels.triton_prefill import prefill_attention

    for name, seqs, q_len, ctx, h, hkv, d in shapes:
        query, k, v, cu, lens, tables = prefill_case(torch, seqs, q_len, ctx, h, hkv, d, dtype, b.device)
        scale, size = d**-0.5, dtype.itemsize
        nbytes = 2 * query.numel() * size + 2 * seqs * ctx * hkv * d * size
        visible = sum(ctx - q_len + j + 1 for j in range(q_len))  # causal keys summed over a chunk's queries
        flops = 4 * seqs * h * d * visible
        args = (query, k, v, cu, lens, tables, scale, q_len, ctx)
        b.row("prefill", name, "triton", partial(triton_ops.paged_prefill_attention, *args), nbytes, flops)
        b.row(
            "prefill",
            name,
            "torch reference",
            partial(reference.paged_prefill_attention, *args),
            nbytes,
            flops,
        )
        if (
            q_len == ctx
        ):  # dense flash SDPA (causal, kv heads expanded beforehand) only aligns without a prefix
            kd = (
                reference.gather_kv(k, tables, ctx)
                .transpose(1, 2)
                .repeat_interleave(h // hkv, 1)
                .contiguous()
            )
            vd = (
                reference.gather_kv(v, tables, ctx)
                .transpose(1, 2)
                .repeat_interleave(h // hkv, 1)
                .contiguous()
            )
            qd = query.view(seqs, q_len, h, d).transpose(1, 2).contiguous()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            b.row(
                "prefill",
                name,
                "torch SDPA dense",
                partial(sdpa, qd, kd, vd, is_causal=True, scale=scale),
                nbytes,
                flops,
            )
            del kd, vd
        if space and name == shapes[0][0]:
            sweep(b, "prefill", partial(prefill_attention, *args), space, nbytes)


def bench_small_ops(b: Bench, torch, shapes, dtype, use_compile: bool) -> None:
    from llmdeploy.kernels import reference, triton_ops

    n, hidden, (h, hkv, d) = shapes["tokens"], shapes["hidden"], shapes["heads"]
    size, dev = dtype.itemsize, b.device
    page = 16
    key = torch.randn(n, hkv, d, dtype=dtype, device=dev)
    val = torch.randn_like(key)
    kc = torch.zeros(-(-n // page) * 2, page, hkv, d, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(kc.shape[0] * page, device=dev)[:n]
    nbytes = 4 * key.numel() * size + 8 * n
    b.row(
        "store_kv",
        f"{n} tok h{hkv} d{d}",
        "triton",
        lambda: triton_ops.store_kv(key, val, kc, vc, slots),
        nbytes,
    )
    b.row(
        "store_kv",
        f"{n} tok h{hkv} d{d}",
        "torch reference",
        lambda: reference.store_kv(key, val, kc, vc, slots),
        nbytes,
    )

    x, res = torch.randn(n, hidden, dtype=dtype, device=dev), torch.randn(n, hidden, dtype=dtype, device=dev)
    w = torch.randn(hidden, dtype=dtype, device=dev)
    shape = f"{n}x{hidden} +residual"
    nbytes = 4 * x.numel() * size + hidden * size
    b.row("rms_norm", shape, "triton", lambda: triton_ops.rms_norm(x, w, 1e-6, res), nbytes)
    b.row("rms_norm", shape, "torch reference", lambda: reference.rms_norm(x, w, 1e-6, res), nbytes)
    f_rms = torch.nn.functional.rms_norm
    b.row("rms_norm", shape, "torch add + F.rms_norm", lambda: f_rms(x + res, (hidden,), w, 1e-6), nbytes)
    if use_compile:
        compiled = torch.compile(reference.rms_norm)
        b.row("rms_norm", shape, "torch.compile(reference)", lambda: compiled(x, w, 1e-6, res), nbytes)

    pos = torch.randint(0, 4096, (n,), device=dev)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), -1)
    q, k = torch.randn(n, h, d, dtype=dtype, device=dev), torch.randn(n, hkv, d, dtype=dtype, device=dev)
    shape = f"{n} tok h{h}/{hkv} d{d}"
    nbytes = 2 * (q.numel() + k.numel()) * size + n * d * 4
    b.row("rotary", shape, "triton", lambda: triton_ops.rotary_embedding(pos, q, k, cache), nbytes)
    b.row("rotary", shape, "torch reference", lambda: reference.rotary_embedding(pos, q, k, cache), nbytes)
    if use_compile:
        compiled = torch.compile(reference.rotary_embedding)
        b.row("rotary", shape, "torch.compile(reference)", lambda: compiled(pos, q, k, cache), nbytes)


def print_table(rows: list[dict]) -> None:
    cols = ["op", "shape", "impl", "ms", "gbps", "peak_frac", "tflops"]
    cells = [[str(r.get(c) if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def headline(rows: list[dict], op: str, shape: str, impl: str = "triton") -> dict | None:
    return next((r for r in rows if r["op"] == op and r["shape"] == shape and r["impl"] == impl), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; nothing measured")
        if args.out:
            Path(args.out).write_text(json.dumps({"status": "no_cuda", "measured": False}, indent=1))
        return 0
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (triton interpreter)"
    peak = peak_gbps(name, args.peak_gbps)
    shapes = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    b = Bench(args.device, peak)
    torch.manual_seed(0)
    print(
        f"device: {name}; peak HBM bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}"
    )
    results: dict = dict(
        device=name, peak_gbps=peak, quick=args.quick, dtype=str(dtype).removeprefix("torch.")
    )
    if not args.skip_kernels:
        use_compile = args.device == "cuda" and not (args.no_compile or args.quick)
        with torch.inference_mode():
            bench_decode(b, torch, shapes["decode"], dtype, None if args.no_sweep else shapes["sweep_decode"])
            bench_prefill(
                b, torch, shapes["prefill"], dtype, None if args.no_sweep else shapes["sweep_prefill"]
            )
            bench_small_ops(b, torch, shapes, dtype, use_compile)
        print_table(b.rows)
        results.update(kernels=b.rows, sweeps=b.sweeps)
        top = headline(b.rows, "decode", shapes["decode"][0][0])
        if top and top["peak_frac"] is not None:
            results["decode_target"] = dict(
                shape=top["shape"], peak_frac=top["peak_frac"], target=0.6, met=top["peak_frac"] >= 0.6
            )
    if args.skip_engine:
        results["engine"] = {"skipped": "--skip-engine"}
    elif args.device != "cuda":
        results["engine"] = {"skipped": "the engine benchmark needs CUDA"}
        print("engine: skipped (needs CUDA)")
    else:
        from bench.gpu_engine import bench_engine

        results["engine"] = bench_engine(args, ENGINE_CONFIGS[args.model])
        if "error" in results["engine"]:
            print(f"engine: {results['engine']['error']}")
    results["wall_s"] = round(time.perf_counter() - started, 1)
    if "decode_target" in results:
        t = results["decode_target"]
        print(
            f"decode {t['shape']}: {t['peak_frac']:.0%} of peak HBM bandwidth (target 60%: {'met' if t['met'] else 'NOT met'})"
        )
    if "speedup" in results.get("engine", {}):
        print(
            f"engine: {results['engine']['speedup']}x transformers (target 5x: {'met' if results['engine']['met'] else 'NOT met'})"
        )
    print(f"total {results['wall_s']} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
