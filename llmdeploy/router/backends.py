"""The local engine pool: one pooled HTTP client, /load polling, in-flight counts and a breaker per engine.

The poller keeps each engine's last /load; an engine that fails to answer is down until it answers again.
replica_states() turns all of it into the plain snapshot the policies decide over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from llmdeploy.policies.breaker import BreakerConfig, CircuitBreaker
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState, RevisionState
from llmdeploy.router.localhttp import LocalHTTP
from llmdeploy.router.table import EngineEndpoint, RoutingTable

log = logging.getLogger("llmdeploy.router.backends")

POLL_INTERVAL_S = 0.2
POLL_TIMEOUT_S = 2.0
STALE_AFTER_S = 5.0  # a /load older than this is not trusted (the poller is stuck or the engine hangs)
LOCAL_CONNECT_TIMEOUT_S = 2.0
LOCAL_READ_TIMEOUT_S = 120.0  # between bytes, unless the request sets its own (local_read_timeout_s)
# a non-stream answer comes whole at the end: its limit grows with the output it may generate, at the engine's
# measured per-sequence decode rate (this fallback before any measurement), with a wide margin for busy moments
TIMEOUT_MARGIN = 4.0
FALLBACK_DECODE_TOKENS_PER_S = 5.0


def engine_base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def local_read_timeout_s(floor_s: float, output_tokens: int | None, load: EngineLoad | None) -> float:
    """How long the router waits on a local engine before calling it a timeout (504, never 'overloaded').

    `output_tokens`: what a non-stream request may generate (None for a stream, whose bytes flow from its first
    token on). The floor covers an ordinary request; the queue wait and the generation at the per-sequence rate
    the engine measures now are added on top, times TIMEOUT_MARGIN."""
    wait_s = load.predicted_queue_wait_ms / 1000 if load is not None else 0.0
    gen_s = 0.0
    if output_tokens:
        rate = load.decode_tokens_per_s / max(1, getattr(load, "decoding", 0)) if load is not None else 0.0
        gen_s = output_tokens / (rate if rate > 0 else FALLBACK_DECODE_TOKENS_PER_S)
    return floor_s + TIMEOUT_MARGIN * (max(0.0, wait_s) + gen_s)


class EnginePool:
    def __init__(
        self, table: RoutingTable, breaker_config: BreakerConfig, poll_interval_s: float = POLL_INTERVAL_S
    ):
        self.table = table
        self.breaker_config = breaker_config
        self.poll_interval_s = poll_interval_s
        self.loads: dict[str, tuple[EngineLoad | None, float]] = {}
        self.inflight: dict[str, int] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.client = LocalHTTP(LOCAL_CONNECT_TIMEOUT_S, LOCAL_READ_TIMEOUT_S)
        self._poll_client = httpx.AsyncClient(timeout=POLL_TIMEOUT_S)
        self._task: asyncio.Task | None = None
        self._tokens: dict[str, str] = {}
        self._tokens_version = -1

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            await self.poll_once()
            self._task = asyncio.create_task(self._poll_loop(), name="llmdeploy-load-poller")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.client.aclose()
        await self._poll_client.aclose()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # the poller must outlive any one bad answer
                log.exception("load poll failed")

    async def poll_once(self) -> None:
        urls = {engine_base(e.url) for _, e in self.table.engines()}
        await asyncio.gather(*(self._poll(u) for u in urls))
        for gone in set(self.loads) - urls:
            self.loads.pop(gone, None)

    async def _poll(self, base: str) -> None:
        try:
            r = await self._poll_client.get(f"{base}/load")
            r.raise_for_status()
            load = EngineLoad.from_json(r.json())
        except (httpx.HTTPError, ValueError, TypeError) as exc:
            if self.loads.get(base, (None, 0))[0] is not None:
                log.warning(
                    "engine %s stopped answering /load (%s); routing around it", base, type(exc).__name__
                )
            self.loads[base] = (None, time.monotonic())
            return
        if self.loads.get(base, (None, 0))[0] is None:
            log.info("engine %s is up (ready=%s)", base, load.ready)
            if base in self.loads:  # it was down: a restarted engine (maybe on the same port) starts afresh,
                self.breakers.pop(base, None)  # not half-open behind its predecessor's failures
        self.loads[base] = (load, time.monotonic())

    # ---- per-request bookkeeping ------------------------------------------------------------------------
    def breaker(self, url: str) -> CircuitBreaker:
        base = engine_base(url)
        br = self.breakers.get(base)
        if br is None:
            br = self.breakers[base] = CircuitBreaker(self.breaker_config)
        return br

    def reconfigure(self, breaker_config: BreakerConfig) -> None:
        self.breaker_config = breaker_config
        for br in self.breakers.values():
            br.reconfigure(breaker_config)

    def token_for(self, url: str) -> str | None:
        """The internal token of the engine at `url` (from the routing table the control plane fills)."""
        if self._tokens_version != self.table.version:
            self._tokens = {engine_base(e.url): e.token for _, e in self.table.engines() if e.token}
            self._tokens_version = self.table.version
        return self._tokens.get(engine_base(url))

    def acquire(self, url: str) -> None:
        base = engine_base(url)
        self.inflight[base] = self.inflight.get(base, 0) + 1

    def release(self, url: str) -> None:
        base = engine_base(url)
        self.inflight[base] = max(0, self.inflight.get(base, 0) - 1)

    def mark_down(self, url: str) -> None:
        """A request could not connect: stop choosing this engine until its /load answers again."""
        self.loads[engine_base(url)] = (None, time.monotonic())

    # ---- snapshot -----------------------------------------------------------------------------------------
    def load_of(self, url: str, now: float) -> EngineLoad | None:
        load, stamp = self.loads.get(engine_base(url), (None, 0.0))
        return load if load is not None and now - stamp <= STALE_AFTER_S else None

    def replica_state(self, revision: int, e: EngineEndpoint, now: float) -> ReplicaState:
        base = engine_base(e.url)
        br = self.breakers.get(base)
        return ReplicaState(
            url=base,
            replica=e.replica,
            revision=revision,
            load=self.load_of(base, now),
            inflight=self.inflight.get(base, 0),
            breaker_allows=br.allows(now) if br else True,
            listed_ready=e.ready,
        )

    def revision_states(self, now: float) -> list[RevisionState]:
        return [
            RevisionState(
                r.revision,
                r.role,
                r.percent,
                tuple(self.replica_state(r.revision, e, now) for e in r.engines),
            )
            for r in self.table.revisions
        ]
