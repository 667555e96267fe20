"""The event loop the long-running servers run on: uvloop where it is installed (a dependency on Linux and
macOS), else asyncio's. The engine gets the same from uvicorn's own `loop="auto"`; the router and the daemon
start their loops themselves, so they choose here. LLMDEPLOY_EVENT_LOOP=asyncio keeps asyncio's (debugging)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOP_ENV = "LLMDEPLOY_EVENT_LOOP"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the chosen loop."""
    if os.environ.get(LOOP_ENV) != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
