"""Engine replicas: one `python -m llmdeploy.engine` each, started by the launcher of the revision's backend
(control/launch.py: a child process on a loopback port, or a Ray actor's child on a node).

Each replica has a monitor task: it polls /health (readiness), restarts a crashed engine with exponential
backoff (the replica is unready meanwhile, so the router sends its share elsewhere), and gives up on a
revision whose engines crash before ever becoming ready. Local engines run in their own session so they outlive
a killed daemon; pid + port are recorded in state.db and the next daemon re-adopts them when /proc shows the
same process (our owner tag in its environment) and /health answers. Ray replicas end with the daemon's Ray job
and are started again. Each engine gets the deployment's internal token in its environment (never on its command
line, in state.db or in status) and serves only requests that carry it; an adopted engine keeps its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmdeploy.control.engine_logs import kv_tokens_from_log, log_tail
from llmdeploy.control.launch import LOOPBACK, EngineHandle, EngineJob, StartFailed
from llmdeploy.control.launchers import Launchers
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.processes import (  # noqa: F401 -- pid_alive, stop_recorded_engines: used via this module
    OWNER_ENV,
    engine_token,
    is_our_engine,
    owner_tag,
    pid_alive,
    stop_recorded_engines,
    terminate,
)
from llmdeploy.control.state import EngineRecord, StateStore
from llmdeploy.engine.errors import CANNOT_LOAD_EXIT
from llmdeploy.openai_api.headers import ENGINE_TOKEN_ENV
from llmdeploy.spec.models import DeploymentSpec, not_yet_supported

log = logging.getLogger("llmdeploy.supervisor")
START_TIMEOUT_S = 900.0  # loading big weights on CPU is slow; past this a silent engine counts as crashed
MAX_CRASHES_BEFORE_READY = 3
BACKOFF_BASE_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 0.5, 30.0, 30.0
UNHEALTHY_AFTER = 3  # failed probes in a row before a live engine is marked unready


def unsupported(spec: DeploymentSpec) -> str | None:
    """What this supervisor cannot run yet; refused before anything starts."""
    found = not_yet_supported(spec)
    return f"{'.'.join(found[0])}: {found[1]}" if found else None


def backoff_s(consecutive_crashes: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** max(0, consecutive_crashes - 1))


@dataclass
class Replica:
    revision: int
    name: str
    spec: DeploymentSpec
    host: str = LOOPBACK  # a Ray node's IP for a replica placed there
    port: int = 0
    pid: int | None = None  # on the engine's machine
    handle: EngineHandle | None = None  # this start's engine: alive?, how it ended, stop
    ready: bool = False
    ever_ready: bool = False
    failed: bool = False
    phase: str = "starting"
    restarts: int = 0
    crashes: int = 0  # in a row, reset after BACKOFF_RESET_S of readiness
    kv_tokens: int | None = None
    started: float = field(default_factory=time.monotonic)
    ready_since: float | None = None
    # its last start, spawn to the first 200 /health (None: adopted, or not ready yet)
    start_s: float | None = None
    task: asyncio.Task | None = None
    stopping: bool = False
    restart_pending: bool = False
    added: bool = False  # by the autoscaler: giving up before ready drops it, not the revision
    log_offset: int = 0
    token: str | None = field(default=None, repr=False)  # the engine's internal token (never shown)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_json(self) -> dict[str, Any]:
        return {
            "revision": self.revision,
            "replica": self.name,
            "url": self.url,
            "pid": self.pid,
            "ready": self.ready,
            "phase": self.phase,
            "restarts": self.restarts,
            "start_s": self.start_s,
            "kv_tokens": self.kv_tokens,
            "failed": self.failed,
        }


class Supervisor:
    def __init__(
        self,
        paths: DeploymentPaths,
        store: StateStore,
        on_change: Callable[[], None],
        event: Callable[..., None],
    ):
        self.paths, self.store, self.on_change, self.event = paths, store, on_change, event
        self.replicas: dict[int, list[Replica]] = {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0), trust_env=False)
        self.token = secrets.token_urlsafe(32)  # this daemon's engines' internal token
        self.launchers = Launchers(str(paths.root))
        self.failed_adds: dict[int, float] = {}  # revision -> when an added replica last gave up (monotonic)
        # removed replicas still stopping: their names stay taken until they have exited
        self._draining: set[tuple[int, str]] = set()

    # what the daemon reads
    def revision_phase(self, revision: int) -> str:
        """starting | ready (every replica answered at least once) | failed (a replica gave up)."""
        reps = self.replicas.get(revision, [])
        if any(r.failed for r in reps):
            return "failed"
        return "ready" if reps and all(r.ever_ready for r in reps) else "starting"

    def all_replicas(self) -> list[Replica]:
        return [r for reps in self.replicas.values() for r in reps]

    # lifecycle
    def start_revision(self, revision: int, spec: DeploymentSpec, adopt: list[EngineRecord] = ()) -> None:
        if revision in self.replicas:  # already supervised: a second set of monitors would fight the first
            return
        adopts = self.launchers.for_spec(spec).adopts
        records = {
            rec.replica: rec
            for rec in adopt  # only live engines: an added replica whose engine is gone is not restarted
            if adopts and is_our_engine(rec.pid, rec.port, owner_tag(self.paths, revision, rec.replica))
        }
        self.replicas[revision] = []
        for i, name in enumerate(_replica_names(spec, records)):
            added = i >= spec.parallel.initial_replicas  # adopted after the autoscaler had added it
            self._run(Replica(revision, name, spec, added=added), records.get(name))

    def _run(self, r: Replica, record: EngineRecord | None = None) -> None:
        self.replicas[r.revision].append(r)
        r.task = asyncio.create_task(self._supervise(r, record), name=f"engine-{r.revision}-{r.name}")

    def add_replica(self, revision: int) -> str:
        """One more engine of a supervised revision (autoscaling): the lowest free name, unready until it
        answers /health, so the router sends it nothing before."""
        reps = self.replicas[revision]
        taken = {r.name for r in reps} | {name for rev, name in self._draining if rev == revision}
        name = next(f"r{i}" for i in range(1, len(taken) + 2) if f"r{i}" not in taken)
        self._run(Replica(revision, name, reps[0].spec, added=True))
        self.on_change()
        return name

    def remove_replica(self, revision: int, name: str) -> Replica | None:
        """The replica leaves the revision and the routing table at once (on_change publishes); `drain` then
        stops its engine. None: no such replica."""
        reps = self.replicas.get(revision, [])
        r = next((r for r in reps if r.name == name), None)
        if r is None:
            return None
        reps.remove(r)
        r.stopping, r.ready = True, False
        if r.task:
            r.task.cancel()
        self._draining.add((revision, name))
        self.on_change()
        return r

    async def drain(self, r: Replica, drain_s: float) -> None:
        """A removed replica's engine finishes its in-flight requests (SIGTERM) and exits; its name is free then."""
        try:
            await self._stop(r, drain_s)
        finally:
            self._draining.discard((r.revision, r.name))

    async def stop_revision(self, revision: int, drain_s: float = 20.0) -> None:
        reps = self.replicas.pop(revision, [])
        for r in reps:
            r.stopping, r.ready = True, False
            if r.task:
                r.task.cancel()
        self.on_change()
        await asyncio.gather(*(self._stop(r, drain_s) for r in reps))

    async def close(self, drain_s: float = 20.0) -> None:
        await asyncio.gather(*(self.stop_revision(rev, drain_s) for rev in list(self.replicas)))
        await self.launchers.close()
        await self.http.aclose()

    async def detach(self) -> None:
        """Leave the engines running (the daemon is going away without `down`)."""
        for r in self.all_replicas():
            r.stopping = True
            if r.task:
                r.task.cancel()
        await self.http.aclose()

    async def _stop(self, r: Replica, drain_s: float) -> None:
        if r.handle is not None:
            await r.handle.stop(drain_s)
        await self._forget(r)
        r.phase = "stopped"

    async def _forget(self, r: Replica) -> None:
        """The replica is gone for good: its record and its launcher's reservation."""
        self.store.forget_engine(r.revision, r.name)
        await self.launchers.for_spec(r.spec).release(r.revision, r.name)

    # the monitor loop of one replica
    async def _supervise(self, r: Replica, record: EngineRecord | None) -> None:
        try:
            if record and is_our_engine(record.pid, record.port, owner_tag(self.paths, r.revision, r.name)):
                r.handle = self.launchers.for_spec(r.spec).adopt(record.pid, record.port)
                r.pid, r.port, r.phase = record.pid, record.port, "adopted"
                r.restarts, r.token = record.restarts, engine_token(record.pid)
                self.event(
                    "engine-adopted", f"re-adopted engine {r.name} (pid {r.pid}, port {r.port})", r.revision
                )
            else:
                await self._spawn(r)
            unhealthy = 0
            while not r.stopping:
                if not await self._alive(r) or self._start_timed_out(r):
                    if not await self._after_exit(r):
                        return
                    await self._spawn(r)
                    unhealthy = 0
                    continue
                healthy = await self._probe(r)
                unhealthy = 0 if healthy else unhealthy + 1
                if healthy and not r.ready:
                    await self._became_ready(r)
                elif not healthy and r.ready and unhealthy >= UNHEALTHY_AFTER:
                    r.ready, r.phase = False, "not responding"
                    log.warning("engine rev %s %s stopped answering /health", r.revision, r.name)
                    self.on_change()
                if (
                    r.ready
                    and r.crashes
                    and r.ready_since
                    and time.monotonic() - r.ready_since > BACKOFF_RESET_S
                ):
                    r.crashes = 0
                await self._pause(r, 1.0 if r.ready else 0.2)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not leave a replica silently unsupervised
            log.exception("supervising engine rev %s %s failed", r.revision, r.name)
            r.failed, r.ready, r.phase = True, False, "supervisor error"
            self.on_change()

    async def _spawn(self, r: Replica) -> None:
        launcher = self.launchers.for_spec(r.spec)
        env = {OWNER_ENV: owner_tag(self.paths, r.revision, r.name), ENGINE_TOKEN_ENV: self.token}
        log_path = self.paths.engine_log(r.revision, r.name)
        job = EngineJob(r.revision, r.name, r.spec, env, log_path, self.paths.root)
        r.token, r.handle, r.kv_tokens = self.token, None, None
        phase = "loading weights" if launcher.adopts else "placing"  # Ray: waiting for the reservation
        r.started, r.ready, r.phase = time.monotonic(), False, phase
        try:
            handle = await launcher.start(job, lambda h: setattr(r, "handle", h))
        except Exception as e:  # e.g. Ray cannot place it: counted and retried like a crash
            log.warning("engine rev %s %s could not start: %s", r.revision, r.name, e)
            if r.handle is not None:
                await r.handle.stop(2.0)
            r.handle = StartFailed(str(e) or type(e).__name__)
            return
        r.host, r.port, r.pid, r.handle = handle.host, handle.port, handle.pid, handle
        r.log_offset = log_path.stat().st_size if log_path.exists() else 0
        r.started, r.phase = time.monotonic(), "loading weights"
        if launcher.adopts:  # a Ray replica ends with the daemon: nothing to re-adopt
            self.store.record_engine(r.revision, r.name, r.pid, r.port, r.restarts)
        log.info("engine rev %s %s started: pid %s at %s:%s", r.revision, r.name, r.pid, r.host, r.port)

    async def _pause(self, r: Replica, seconds: float) -> None:
        """Until the next look at the replica: `seconds`, cut short when its engine exits."""
        if r.handle is None:
            await asyncio.sleep(seconds)
        else:
            await r.handle.wait_exit(seconds)

    async def _alive(self, r: Replica) -> bool:
        return r.handle is not None and await r.handle.alive()

    def _start_timed_out(self, r: Replica) -> bool:
        return not r.ever_ready and not r.ready and time.monotonic() - r.started > START_TIMEOUT_S

    async def _after_exit(self, r: Replica) -> bool:
        """Record the crash, wait the backoff; False when the replica gives up."""
        how = r.handle.exit_description() if r.handle else "exited"
        if await self._alive(r):  # hung at start: kill it before restarting
            await r.handle.stop(2.0)  # type: ignore[union-attr]
        was_ready = r.ready
        r.ready, r.crashes = False, r.crashes + 1
        if was_ready:
            self.on_change()
        tail = log_tail(self.paths.engine_log(r.revision, r.name))
        cannot_load = r.handle is not None and r.handle.exit_code() == CANNOT_LOAD_EXIT
        if not r.ever_ready and (cannot_load or r.crashes >= MAX_CRASHES_BEFORE_READY):
            why = (
                f"cannot load its model ({how})"
                if cannot_load
                else f"{how} {r.crashes} times before becoming ready"
            )
            if r.added:
                await self._drop_added(r, why, tail)
                return False
            r.failed, r.phase = True, f"failed: {why}"
            self.event(
                "engine-failed",
                f"engine {r.name} {why}; giving up",
                r.revision,
                {"pid": r.pid, "log_tail": tail},
            )
            await self._forget(r)
            self.on_change()
            return False
        delay = backoff_s(r.crashes)
        r.phase = f"restarting in {delay:g}s ({how})"
        self.event(
            "engine-crash",
            f"engine {r.name} (pid {r.pid}) {how}; restart in {delay:g}s",
            r.revision,
            {
                "pid": r.pid,
                "port": r.port,
                "crashes_in_a_row": r.crashes,
                "backoff_s": delay,
                "log_tail": tail,
            },
        )
        await asyncio.sleep(delay)
        r.restarts += 1
        r.restart_pending = True
        return not r.stopping

    async def _drop_added(self, r: Replica, why: str, tail: str) -> None:
        """An added replica that never became ready leaves the revision, which keeps serving without it."""
        reps = self.replicas.get(r.revision, [])
        if r in reps:
            reps.remove(r)
        r.phase = f"failed: {why}"
        self.failed_adds[r.revision] = time.monotonic()
        self.event(
            "engine-failed",
            f"added engine {r.name} {why}; giving up (the revision keeps its {len(reps)} replicas)",
            r.revision,
            {"pid": r.pid, "log_tail": tail},
        )
        await self._forget(r)
        self.on_change()

    async def _probe(self, r: Replica) -> bool:
        try:
            resp = await self.http.get(f"{r.url}/health")
        except httpx.HTTPError:
            if not r.ever_ready and r.phase != "adopted":
                r.kv_tokens = r.kv_tokens or kv_tokens_from_log(
                    self.paths.engine_log(r.revision, r.name), r.log_offset
                )
                r.phase = "loading weights" if r.kv_tokens is None else "warming up"
            return False
        if resp.status_code == 200:
            return True
        if not r.ever_ready:
            r.phase = "warming up"
        return False

    async def _became_ready(self, r: Replica) -> None:
        r.ready, r.ever_ready, r.ready_since = True, True, time.monotonic()
        if r.phase != "adopted":  # an adopted engine's start was before this daemon
            r.start_s = round(r.ready_since - r.started, 1)
        took = f" in {r.start_s:g} s" if r.start_s is not None else ""
        try:
            load = (await self.http.get(f"{r.url}/load")).json()
            r.kv_tokens = int(load["total_blocks"]) * int(load["block_size"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        r.phase = "ready"
        if r.restart_pending:
            r.restart_pending = False
            self.event(
                "engine-restart",
                f"engine {r.name} restarted and ready{took} (pid {r.pid}, port {r.port})",
                r.revision,
                {"pid": r.pid, "port": r.port, "restarts": r.restarts, "start_s": r.start_s},
            )
        log.info(
            "engine rev %s %s ready%s (pid %s, KV %s tokens)", r.revision, r.name, took, r.pid, r.kv_tokens
        )
        self.on_change()

    async def loads(self) -> dict[tuple[int, str], dict]:
        """Each ready engine's /load JSON, for status."""

        async def one(r: Replica) -> tuple[tuple[int, str], dict | None]:
            try:
                return (r.revision, r.name), (await self.http.get(f"{r.url}/load")).json()
            except (httpx.HTTPError, ValueError):
                return (r.revision, r.name), None

        pairs = await asyncio.gather(*(one(r) for r in self.all_replicas() if r.ready))
        return {k: v for k, v in pairs if v is not None}


def _replica_names(spec: DeploymentSpec, adoptable: dict[str, EngineRecord]) -> list[str]:
    """r1..rN for the revision's initial count; an autoscaled revision also takes back the replicas it had
    added before the daemon restarted (their engines still run), up to its max."""
    names = [f"r{i + 1}" for i in range(spec.parallel.initial_replicas)]
    if spec.parallel.autoscale is not None:
        extra = sorted((n for n in adoptable if n not in names), key=lambda n: (len(n), n))
        names += extra[: spec.parallel.max_replicas - len(names)]
    return names
