"""Two CLI calls on one deployment never interleave: an exclusive flock on <state dir>/lock."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def deployment_lock(lock_file: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Held for the whole command; the kernel drops it if the process dies, so it never goes stale."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
