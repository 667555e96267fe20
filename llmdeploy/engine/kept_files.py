"""Small JSON files an engine keeps under its cache between starts (start measures, `dtype: auto`'s choice, parsed
model configs): read whole or not at all, written atomically, the newest KEEP of a folder kept. Whatever cannot be
read or written is made again; the engine starts either way."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger("llmdeploy.engine")
KEEP = 64  # files kept per folder; older ones are removed when a new one is written


def read_kept(path: Path | None) -> dict | None:
    """The JSON object kept at `path`; None where there is none or it is not whole (then it is made again)."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("kept file %s unreadable (%s): made again", path, exc)
        return None
    return data if isinstance(data, dict) else None


def write_kept(path: Path | None, data: dict) -> None:
    """Best effort: written whole (a temporary file renamed into place) or not at all."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        prune(path.parent)
    except OSError as exc:
        log.warning("not kept in %s: %s", path.parent, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def prune(folder: Path, keep: int = KEEP) -> None:
    """The `keep` newest files stay (every test model, every changed option makes one)."""
    dated = []
    for f in folder.glob("*.json"):
        with contextlib.suppress(OSError):  # another engine may have removed it since
            dated.append((f.stat().st_mtime_ns, f))
    for _, old in sorted(dated, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()
