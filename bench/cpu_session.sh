#!/usr/bin/env bash
# Issue 13's CPU figures on whatever CPU this machine has, in one run, each benchmark after the other (never two at
# once: they share the cores and the memory bus). The CPU model changes between sessions; start this first thing on
# a CPU kind not measured lately (AVX-512 BF16, AMX) and read bench/RESULTS.md's last section of that kind beside it.
# Each benchmark's output goes to $OUT/<name>.txt (default bench/out/cpu-<date>), the CPU line first.
#
#   bench/cpu_session.sh           # about 50 minutes on 2 cores (transformers' bf16 is slow where it is emulated)
#   ONLY="linear_rows engine_vs_hf" bench/cpu_session.sh
#
# What each one decides: linear_rows the kernel thresholds in kernels/native_build.py (AMX_MIN_ROWS_DEFAULT,
# TILE_AHEAD_ROWS_DEFAULT, ROW_STREAMS_AVX2 / ROW_STREAMS_AVX512, SIDE_ROWS_DEFAULT); engine_vs_hf the issue's
# targets (W, S, shares of the ceilings, batch-1 against the bandwidth floor, TTFT, int8); small_batches and
# bf16_decode decode at 1-16 concurrent requests; step_overhead the per-step CPU overhead; head_screen the LM head's
# screen on and off at 1-4 rows (SCREEN_MAX_ROWS_* in csrc/decode_step.c); decode_attention the AVX-512 passes
# (csrc/decode_attention_avx512.c) against the 8-lane kernel before them (fd48fb8; Zen 4: bf16 0.76-0.87x behind the
# weight stream, float32 even; on a CPU with two 512-bit FMA ports float32 is the open question); sampling_steps
# what sampled requests (temperature, top_p, top_k, min_p) add to a step against the torch-ops sampler before
# 2026-12-07. The row streams
# are best judged in engine steps alternating in one process (bench/RESULTS.md, "Zen 4 again"), not by linear_rows
# alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/out/cpu-$(date +%Y%m%d-%H%M)}
PY=${PY:-.venv/bin/python}
ALL="linear_rows engine_vs_hf small_batches small_batches_bf16 bf16_decode step_overhead head_screen"
ONLY=${ONLY:-$ALL decode_attention sampling_steps}
mkdir -p "$OUT"

run() { # name, then the command
  local name=$1
  shift
  case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name: $* ($(date -u +%H:%M:%S) UTC)"
  "$@" 2>&1 | grep -v '^Loading weights' | tee "$OUT/$name.txt"
}

run linear_rows "$PY" bench/linear_rows.py --dtypes bfloat16,float32
run engine_vs_hf "$PY" bench/engine_vs_hf.py --repeat 2 --engine-only int8 --json "$OUT/engine_vs_hf.json"
run small_batches "$PY" bench/small_batches.py --dtype float32
run small_batches_bf16 "$PY" bench/small_batches.py --dtype bfloat16
run bf16_decode "$PY" bench/bf16_decode.py
run step_overhead "$PY" bench/step_overhead.py --steps 40
run head_screen "$PY" bench/head_screen.py
case " $ONLY " in *" decode_attention "*)
  git show fd48fb8:llmdeploy/kernels/csrc/decode_attention.c >"$OUT/decode_attention_8_lanes.c"
  run decode_attention "$PY" bench/decode_attention.py --baseline "$OUT/decode_attention_8_lanes.c" ;;
esac
run sampling_steps "$PY" bench/sampling_steps.py --batches 1,4,8,32
echo "outputs in $OUT"
