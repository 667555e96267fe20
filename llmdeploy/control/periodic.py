"""The daemon's periodic checks (the auto-rollback watcher, the autoscaler) run on this loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("llmdeploy.control")


async def every(period_s: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    """`step` about every `period_s` seconds until cancelled; one failing step is logged, the next one runs."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await step()
        except Exception:  # one bad check must not end the checking
            log.exception("%s failed", what)
