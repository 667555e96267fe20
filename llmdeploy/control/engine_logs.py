"""What the supervisor reads from an engine's log file: the KV cache size it logs once its weights are loaded
(the progress shown before /load answers), and the last lines of a crash."""

from __future__ import annotations

import re
from pathlib import Path

KV_LINE = re.compile(rb"KV cache: .*?= (\d+) tokens")


def kv_tokens_from_log(path: Path, offset: int) -> int | None:
    """The engine logs its KV cache size once weights are loaded; until /load answers, this is the progress."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            found = KV_LINE.findall(f.read(65536))
    except OSError:
        return None
    return int(found[-1]) if found else None


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
