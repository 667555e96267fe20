"""The LM head's screen (kernels/csrc/head_screen.c) in engine decode steps: greedy steps of 1-32 sequences (bursts
at 1-4) with the screen on and off, alternating in one engine, each run after a read-bandwidth probe. Prints per row
count the median on/off time ratio, each side's step against the bandwidth floor of its own probe (weights + K/V at
the dtype), and the candidate tiles a screened step computed (of the head's ceil(vocab / 32)).

    python bench/head_screen.py [--dtypes bfloat16,float32] [--rows 1,2,3,4] [--rounds 12] [--steps 12]

The screen is on where head_screen.c takes it (its Q8 copy: bf16 up to 3 rows, float32 up to 4; a float32 head's
bf16 copy from 5 rows where the CPU has AVX-512 BF16): at other row counts both sides run the whole head, and their
ratio shows the noise. Off, a greedy step past 4 rows still runs as one native call (argmax in C), so the two sides
differ only in the head's screen.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ceilings  # noqa: E402
from bench.small_batches import MODEL, decode_step_ms  # noqa: E402
from llmdeploy.engine import LLM, SamplingParams  # noqa: E402
from llmdeploy.kernels.decode_step import DecodeLayers  # noqa: E402


@dataclass
class Runs:
    """One row count's alternating runs: (ms a step, its floor in ms) for each side, and the screen's counts."""

    on: list[tuple[float, float]] = field(default_factory=list)
    off: list[tuple[float, float]] = field(default_factory=list)
    steps: int = 0
    tiles: int = 0

    def ratio(self) -> float:
        return statistics.median(a[0] / b[0] for a, b in zip(self.on, self.off, strict=True))

    def line(self, rows: int, head_tiles: int) -> str:
        on = statistics.median(ms / floor for ms, floor in self.on)
        off = statistics.median(ms / floor for ms, floor in self.off)
        per_step = (
            f"{self.tiles / self.steps:.1f} of {head_tiles} tiles a screened step"
            if self.steps
            else "not used"
        )
        return (
            f"{rows} rows: on/off {self.ratio():.3f}x the time (median of {len(self.on)} pairs); on {on:.2f}x, off "
            f"{off:.2f}x the floor; screen {per_step}"
        )


def layers_of(llm: LLM) -> DecodeLayers | None:
    """The engine's native decode step where it has a head screen, else None."""
    model = llm.engine.runner.model
    layers = next((m.native_decode.layers for m in model.modules() if hasattr(m, "native_decode")), None)
    return layers if layers is not None and layers.screen_struct is not None else None


def alternate(
    llm: LLM, dtype: str, rows: int, rounds: int, steps: int, prompt_len: int = 128, probe_mib: int = 256
) -> Runs:
    """`rounds` pairs of runs of `steps` decode steps at `rows` sequences, the screen on and off in turn (floors at
    SmolLM2's shape)."""
    shape, layers = ceilings.smollm2_shape(), layers_of(llm)
    assert layers is not None, "no head screen in this engine"
    on_struct, runs = layers.screen_struct, Runs()
    before = (layers.screened_steps, layers.screened_tiles)
    for r in range(rounds):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            layers.screen_struct = on_struct if side == "on" else None
            gbps = ceilings.read_bandwidth_gbps(probe_mib, 0.2)
            ms, context = decode_step_ms(
                llm, rows, prompt_len, steps, salt=2 * r + (side == "on") + 1000 * rows
            )
            bytes_read = shape.weight_bytes(dtype) + rows * shape.kv_bytes(int(context), dtype)
            getattr(runs, side).append((ms, 1e3 * bytes_read / (gbps * 1e9)))
    layers.screen_struct = on_struct
    runs.steps, runs.tiles = layers.screened_steps - before[0], layers.screened_tiles - before[1]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    print(ceilings.cpu_info().line())
    rows_list = [int(r) for r in args.rows.split(",")]
    for dtype in args.dtypes.split(","):
        llm = LLM(model=MODEL, dtype=dtype, max_num_seqs=max(8, *rows_list))
        llm.generate(
            [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )  # builds the step
        head_tiles = -(-llm.engine.arch.vocab_size // 32)
        if layers_of(llm) is None:
            print(f"[{dtype}] no head screen here (no native decode step, or LLMDEPLOY_HEAD_SCREEN=0)")
            continue
        for rows in rows_list:
            print(
                f"[{dtype}] " + alternate(llm, dtype, rows, args.rounds, args.steps).line(rows, head_tiles),
                flush=True,
            )
        del llm
    print(ceilings.cpu_info().line())


if __name__ == "__main__":
    main()
