"""bench/ceilings.py's floors: the W roofline (decode steps bound by compute or by their weight + K/V bytes),
checked on SmolLM2's shape with made-up machine figures whose answers can be worked out by hand."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from bench.ceilings import (
    B1Run,
    Ceilings,
    CpuInfo,
    DtypeCeiling,
    Workload,
    b1_runs_line,
    compute_dtype,
    floors,
    read_probe,
    smollm2_shape,
)
from llmdeploy.kernels.native_quant import QFormat, q_packed_bytes

SHAPE = smollm2_shape()
W = Workload()


def machine(peak_gflops: float, read_gbps: float, dtype: str = "float32") -> Ceilings:
    compute = DtypeCeiling(
        dtype, peak_gflops, {"test": peak_gflops}, {1: 10.0, 32: peak_gflops, 2048: peak_gflops}
    )
    cpu = CpuInfo("test CPU", (), "DEFAULT", 2, (0.0, 0.0, 0.0))
    return Ceilings(cpu, read_gbps, {dtype: compute, "float32": compute})


def test_kv_bytes_count_k_and_v_of_every_layer_at_the_cache_dtype():
    per_token = 2 * 30 * 3 * 64  # K and V, 30 layers, 3 kv heads x 64
    assert SHAPE.kv_bytes(192, "float32") == per_token * 192 * 4
    assert SHAPE.kv_bytes(192, "bfloat16") == per_token * 192 * 2
    assert SHAPE.kv_bytes(192, "int8") == SHAPE.kv_bytes(192, "float32")  # int8 weights, float32 cache


def test_roofline_is_the_compute_ceiling_when_memory_is_fast():
    f = floors(SHAPE, machine(peak_gflops=150, read_gbps=1e6), "float32")
    assert f["w_tok_s_roofline"] == pytest.approx(f["w_tok_s_ceiling"], rel=1e-9)


def test_roofline_counts_weight_and_kv_bytes_when_decode_is_bandwidth_bound():
    peak, gbps = 3000.0, 30.0  # an AMX core pair: bf16 decode at batch 32 waits on memory
    f = floors(SHAPE, machine(peak, gbps, "bfloat16"), "bfloat16")
    prefill, _ = SHAPE.workload_flops(W.num_requests, W.prompt_len, W.output_len)
    contexts = range(W.prompt_len + 1, W.prompt_len + W.output_len)
    step_bytes = [
        SHAPE.weight_bytes("bfloat16") + W.num_requests * SHAPE.kv_bytes(c, "bfloat16") for c in contexts
    ]
    expected_s = prefill / (peak * 1e9) + sum(step_bytes) / (gbps * 1e9)
    assert f["w_tok_s_roofline"] == pytest.approx(W.num_requests * W.output_len / expected_s, rel=1e-9)
    assert f["w_tok_s_roofline"] < 0.5 * f["w_tok_s_ceiling"]  # the compute ceiling alone overstates it here


@pytest.mark.parametrize("flags,expected", [(("avx512_bf16",), "bfloat16"), (("avx2",), "float32")])
def test_int8_products_are_bounded_by_the_dtype_they_run_in(flags, expected):
    """int8 weights run their many-row products as bf16 tiles where the CPU has AVX-512 BF16, float32 elsewhere;
    their bytes stay int8's."""
    rates = {"float32": 200.0, "bfloat16": 400.0}
    dtypes = {d: DtypeCeiling(d, g, {"test": g}, {1: 10.0, 32: g, 2048: g}) for d, g in rates.items()}
    c = Ceilings(CpuInfo("test CPU", flags, "DEFAULT", 2, (0.0, 0.0, 0.0)), 30.0, dtypes)
    assert compute_dtype(c, "int8") == expected
    assert floors(SHAPE, c, "int8")["w_tok_s_ceiling"] == pytest.approx(
        floors(SHAPE, c, expected)["w_tok_s_ceiling"]
    )
    assert floors(SHAPE, c, "int8")["decode_b1_floor_ms"] < floors(SHAPE, c, "bfloat16")["decode_b1_floor_ms"]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the probe is compiled with gcc")
@pytest.mark.parametrize("streams", [1, 3, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_read_probe_reads_every_element_once_a_pass(streams, threads):
    probe = read_probe()
    assert probe is not None
    n, reps = 1_000_003, 2  # odd: every thread's share leaves a remainder past its streams
    buf, sink = torch.ones(n), ctypes.c_float(0.0)
    gbps = probe.llmd_read_probe(buf.data_ptr(), n, streams, threads, reps, ctypes.byref(sink))
    assert sink.value == reps * n  # sums of ones: exact in float32 at this size
    assert 0 < gbps < 1e4


def test_batch_1_runs_are_put_against_the_bandwidth_around_them():
    """A run whose probes disagree met a switch of the host's bandwidth: it is counted, at the mean of the two
    probes, but not among the runs whose band held."""
    weight_bytes = 270_000_000  # 10 ms at 27 GB/s
    steady = B1Run(12.0, 27.0, 27.0)
    switched = B1Run(12.0, 54.0, 27.0)  # fast before, slow after: "2.4x" by the first probe alone
    assert steady.band_held and not switched.band_held
    assert steady.floor_ratio(weight_bytes) == pytest.approx(1.2)
    assert switched.floor_ratio(weight_bytes) == pytest.approx(12.0 / (weight_bytes / 40.5e9 * 1e3))
    line = b1_runs_line(weight_bytes, [steady, switched, B1Run(13.0, 26.0, 27.5)])
    assert "3 runs; 2 whose band held: median 1.24x" in line
    assert "12.0 ms at 54->27 GB/s" in line
    assert "no band held" in b1_runs_line(weight_bytes, [switched])


def test_int8_bytes_are_the_packed_q8_blocks():
    """The batch-1 floor counts what the kernel streams: q_pack's Q8 layout, a float16 scale per 32 inputs."""
    n_k = [(o, i) for i, o in SHAPE.projections()]
    packed = sum(q_packed_bytes(QFormat.Q8, n, k) for n, k in n_k) * SHAPE.num_layers
    packed += q_packed_bytes(QFormat.Q8, SHAPE.vocab, SHAPE.hidden)
    # tiles of 32 channels: padding only
    assert SHAPE.weight_bytes("int8") == pytest.approx(packed, rel=0.001)
