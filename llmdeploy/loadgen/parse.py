"""Parsing of bench's command-line values: durations, level lists, percentages, `--burst` and `--mix`.

Pure functions; each raises ValueError with a message a user can act on (the CLI turns it into exit code 2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(text: str) -> float:
    """'30s', '2m', '500ms', '1h' or a bare number of seconds -> seconds (> 0)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration; use e.g. 30s, 2m, 500ms")
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"{text!r}: a duration must be longer than 0")
    return seconds


def parse_int_list(text: str) -> list[int]:
    """'1,4,16,32' -> [1, 4, 16, 32]: positive, sorted, without repeats (the last one is the load asked for)."""
    values = []
    for part in _parts(text):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{part!r} in {text!r} is not a whole number >= 1")
        values.append(int(part))
    return sorted(set(values))


def parse_float_list(text: str) -> list[float]:
    """'2,5,10' or '0.5,1.5' -> sorted positive numbers without repeats."""
    values = []
    for part in _parts(text):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not a number") from None
        if not v > 0 or v == float("inf"):
            raise ValueError(f"{part!r} in {text!r} must be a finite number > 0")
        values.append(v)
    return sorted(set(values))


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"{text!r} is not a comma-separated list, e.g. 1,4,16,32")
    return parts


def parse_percent(text: str) -> float:
    """'10%' or '10' -> 0.10 (a share, 0..1). A bare number is read as percent too, never as a fraction."""
    body = text.strip().removesuffix("%").strip()
    try:
        v = float(body)
    except ValueError:
        raise ValueError(f"{text!r} is not a percentage; use e.g. 10%") from None
    if not 0 <= v <= 100:
        raise ValueError(f"{text!r} must be between 0% and 100%")
    return v / 100


@dataclass(frozen=True)
class BurstPlan:
    """`--burst 3x:20s[:60s]`: arrivals at `factor` x the sustainable rate for `duration_s`, after a calm
    `before_s` and followed by `after_s` at the sustainable rate to watch TTFT recover."""

    factor: float
    duration_s: float
    after_s: float

    @property
    def before_s(self) -> float:
        return max(1.0, self.duration_s / 2)


def parse_burst(text: str) -> BurstPlan:
    """'3x:20s' (after = 2 x the burst, at least 2 s) or '3x:20s:60s' (watch 60 s after it)."""
    parts = text.split(":")
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*x\s*$", parts[0])
    if len(parts) not in (2, 3) or not m:
        raise ValueError(f"{text!r} is not a burst; use FACTORx:DURATION[:WATCH], e.g. 3x:20s or 3x:20s:60s")
    factor = float(m.group(1))
    if factor <= 1:
        raise ValueError(f"{text!r}: the burst factor must be above 1x")
    duration = parse_duration(parts[1])
    after = parse_duration(parts[2]) if len(parts) == 3 else max(2.0, 2 * duration)
    return BurstPlan(factor, duration, after)


@dataclass(frozen=True)
class Mix:
    """`--mix 1500:128 --mix-ratio 1:4`: prompts of `long_len` or `short_len` tokens, `long_share` of them long."""

    long_len: int
    short_len: int
    long_share: float


def parse_mix(lengths: str, ratio: str = "1:1") -> Mix:
    long_len, short_len = _pair(lengths, "--mix", "LONG:SHORT prompt lengths in tokens, e.g. 1500:128")
    if long_len < 1 or short_len < 1:
        raise ValueError(f"--mix {lengths!r}: prompt lengths must be >= 1 token")
    a, b = _pair(ratio, "--mix-ratio", "LONG:SHORT request counts, e.g. 1:4")
    if a < 0 or b < 0 or a + b == 0:
        raise ValueError(f"--mix-ratio {ratio!r}: counts must be >= 0 and not both 0")
    return Mix(long_len, short_len, a / (a + b))


def _pair(text: str, flag: str, what: str) -> tuple[int, int]:
    m = re.match(r"^\s*(\d+)\s*:\s*(\d+)\s*$", text)
    if not m:
        raise ValueError(f"{flag} {text!r} must be {what}")
    return int(m.group(1)), int(m.group(2))
