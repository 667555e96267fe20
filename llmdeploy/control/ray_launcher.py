"""`parallel.backend: ray`: each engine replica runs under a Ray actor on a node of a running Ray cluster
(ARCHITECTURE.md §10). Imported only for that backend; `ray` itself is imported on first use.

- **Placement**: a replica's resources (`num_cpus` per rank, and one GPU per rank when the engine runs on CUDA)
  are reserved as one placement group (STRICT_PACK, one bundle: all ranks on one node, as `engine/parallel/`
  needs) that lives as long as the replica, across its restarts; the actor takes that bundle, so Ray points the
  engine's `CUDA_VISIBLE_DEVICES` at exactly the replica's GPUs.
- **The actor** (`EngineActor`) starts the same `python -m llmdeploy.engine` command a local replica runs, as its
  child on its node, bound to the node's IP on a free port, and answers where it listens, whether it still runs
  (with the new lines of its log, which the daemon appends to the replica's log) and stop(drain_s). The child
  dies with the actor (PR_SET_PDEATHSIG, set by `_exec_child` before it execs the engine) and is stopped in the
  actor's shutdown hook. An actor killed with `ray.kill`, or lost with its node, reads as an exited engine: the
  supervisor restarts it with backoff like a crashed process.
- **Token**: the engine's internal token travels as an argument of the actor's start call and reaches the child
  through its environment; never in the actor's name, options or runtime_env (Ray shows those).
- **Daemon restart**: actors and placement groups belong to the daemon's Ray job, so they end with the daemon
  (their engines with them); a new daemon starts the replicas again instead of re-adopting them (`adopts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmdeploy.control.launch import EngineJob, HandleSink
from llmdeploy.control.placement import NodeResources, replica_resources
from llmdeploy.spec.addresses import is_loopback
from llmdeploy.spec.models import DeploymentSpec
from llmdeploy.spec.parallel import RAY_INSTALL_HINT

log = logging.getLogger("llmdeploy.supervisor")
NAMESPACE = "llmdeploy"
PLACE_TIMEOUT_S = 30.0  # a reservation the cluster cannot grant in this long counts as a failed start
START_CALL_S = 180.0  # the actor's worker process starts (imports) before its first call runs
POLL_CALL_S = 10.0
LOG_CHUNK = 1 << 20
PR_SET_PDEATHSIG = 1
_connected_to: list[str] = []  # a process joins one cluster (ray.init once)
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 as the node address


class LaunchError(Exception):
    """A replica could not be started on Ray (message for status and events)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LaunchError(f"parallel.backend ray needs Ray on this machine: {RAY_INSTALL_HINT}") from None
    return ray


def is_loopback_address(address: str | None) -> bool:
    return is_loopback((address or "").removeprefix("ray://").rpartition(":")[0].strip("[]"))


def reachable(address: str | None, timeout_s: float = 2.0) -> str | None:
    """Why a `host:port` cluster address cannot be reached (None: it answers, or it is not host:port)."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as e:
        return f"no Ray cluster answers at {address} ({e})"


def connect(address: str | None) -> Any:
    """This process joins the cluster as a driver (once). Blocking."""
    if is_loopback_address(address):
        # Ray rewrites 127.0.0.1 to this machine's network address, where a cluster started on loopback does not
        # listen; its single-machine mode keeps loopback (the cluster was started with the same variable)
        os.environ.setdefault(SINGLE_MACHINE_ENV, "0")
    ray = import_ray()
    if ray.is_initialized():
        if _connected_to and _connected_to[0] != (address or "auto"):
            raise LaunchError(
                f"this daemon is connected to the Ray cluster at {_connected_to[0]}; to move to {address or 'auto'}, "
                "`llmdeploy down` and apply again"
            )
        return ray
    if why := reachable(address):
        raise LaunchError(why)
    try:
        ray.init(
            address=address or "auto",  # never starts a new local Ray instance
            namespace=NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise LaunchError(f"cannot connect to the Ray cluster at {address or 'auto'}: {e}") from None
    _connected_to[:] = [address or "auto"]
    return ray


def cluster_nodes(address: str | None) -> list[NodeResources]:
    """The live nodes' CPUs and GPUs, for placement checks (`plan`)."""
    ray = connect(address)
    return [
        NodeResources(n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def _exec_child(argv: list[str]) -> None:
    """`python -m llmdeploy.control.ray_launcher PARENT_PID CMD...`: die with the actor, then exec the engine.
    Set here rather than in a preexec_fn, which is unsafe in the actor's threaded process."""
    parent = int(argv[0])
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)
    os.execv(argv[1], argv[1:])


class EngineActor:
    """Runs on a Ray node (made a Ray actor class by `RayLauncher`): one engine child process at a time."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkdtemp(prefix="llmdeploy-engine-")) / "engine.log"

    def start(self, spec: dict, env: dict[str, str]) -> tuple[str, int, int]:
        import ray

        from llmdeploy.control.engine_args import engine_command
        from llmdeploy.spec.addresses import free_port

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        cmd = engine_command(DeploymentSpec.model_validate(spec), port, host=host)
        wrapper = [sys.executable, "-m", "llmdeploy.control.ray_launcher", str(os.getpid())]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                wrapper + cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,  # its tensor-parallel ranks share its group: stop signals them all
            )
        return host, port, self.proc.pid

    def poll(self, offset: int) -> tuple[int | None, bytes, int]:
        """(return code or None while it runs, the log's bytes from offset, the next offset)."""
        code = self.proc.poll() if self.proc else None
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                chunk = f.read(LOG_CHUNK)
        except OSError:
            chunk = b""
        return code, chunk, offset + len(chunk)

    def stop(self, drain_s: float) -> int | None:
        from llmdeploy.control.processes import terminate

        if self.proc is not None and self.proc.poll() is None:
            terminate(self.proc.pid, drain_s)
        return self.proc.poll() if self.proc else None

    def __ray_shutdown__(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


class RayEngine:
    """The daemon's handle of one engine under an actor."""

    def __init__(self, launcher: RayLauncher, actor: Any, name: str, log_path: Path):
        self.launcher, self.actor, self.name, self.log_path = launcher, actor, name, log_path
        self.host, self.port, self.pid = "", 0, None
        self.offset, self.returncode, self.gone = 0, None, ""

    async def alive(self) -> bool:
        if self.gone or self.returncode is not None:
            return False
        await self.pull_log()
        if (
            self.returncode is not None
        ):  # the engine exited: its actor goes too, freeing the bundle for a restart
            self._kill()
        return not self.gone and self.returncode is None

    async def wait_exit(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)  # an exit is seen by polling the actor (alive)

    def _kill(self) -> None:
        with contextlib.suppress(self.launcher.ray.exceptions.RayError, ValueError):
            self.launcher.ray.kill(self.actor, no_restart=True)

    async def pull_log(self) -> None:
        ray = self.launcher.ray
        try:
            code, chunk, self.offset = await self.launcher.call(
                self.actor.poll.remote(self.offset), POLL_CALL_S
            )
        except (asyncio.TimeoutError, ray.exceptions.ActorUnavailableError):
            return  # unreachable for now: the health probes judge the engine meanwhile
        except ray.exceptions.RayActorError:
            self.gone = "its Ray actor died (killed, or its node was lost)"
            return
        if chunk:
            with open(self.log_path, "ab") as f:
                f.write(chunk)
        self.returncode = code

    def exit_description(self) -> str:
        if self.gone:
            return self.gone
        if self.returncode is None:
            return "did not become ready in time"
        code = self.returncode
        return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def exit_code(self) -> int | None:
        return self.returncode

    async def stop(self, drain_s: float) -> None:
        ray = self.launcher.ray
        if not self.gone:
            with contextlib.suppress(ray.exceptions.RayError, asyncio.TimeoutError):
                await self.launcher.call(self.actor.stop.remote(drain_s), drain_s + 15.0)
            await self.pull_log()
        self._kill()
        self.gone = self.gone or "stopped"


class RayLauncher:
    adopts = False

    def __init__(self, address: str | None, owner: str):
        self.address = address
        self.owner = f"{Path(owner).name}-{hashlib.sha256(owner.encode()).hexdigest()[:6]}"
        self.ray: Any = None
        self.groups: dict[tuple[int, str], Any] = {}  # the replica's reservation, kept across its restarts
        self.starts = 0
        self._lock = asyncio.Lock()

    async def _connected(self) -> Any:
        async with self._lock:
            if self.ray is None:
                self.ray = await asyncio.to_thread(connect, self.address)
        return self.ray

    async def call(self, ref: Any, timeout_s: float) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)

    async def start(self, job: EngineJob, on_handle: HandleSink) -> RayEngine:
        ray = await self._connected()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cpus, gpus = replica_resources(job.spec, self._gpu(job.spec))
        group = await self._reserve(job, cpus, gpus)
        self.starts += 1
        name = f"{self.owner}/rev{job.revision}/{job.replica}/{self.starts}"
        actor = (
            ray.remote(EngineActor)
            .options(
                name=name,
                namespace=NAMESPACE,
                num_cpus=cpus,
                num_gpus=gpus,
                max_restarts=0,  # the supervisor restarts it, with backoff, and sees each crash
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            )
            .remote()
        )
        handle = RayEngine(self, actor, name, job.log_path)
        on_handle(handle)
        try:
            host, port, pid = await self.call(
                actor.start.remote(_spec_json(job.spec), _env(job)), START_CALL_S
            )
        except ray.exceptions.RayError as e:
            handle.gone = f"its Ray actor failed to start ({type(e).__name__})"
            raise LaunchError(handle.gone) from None
        handle.host, handle.port, handle.pid = host, port, pid
        with open(job.log_path, "ab") as f:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            f.write(f"--- {stamp} starting on {host}:{port} (Ray actor {name})\n".encode())
        return handle

    def _gpu(self, spec: DeploymentSpec) -> bool:
        device = spec.engine.device
        return device == "cuda" or (device == "auto" and self.ray.cluster_resources().get("GPU", 0) > 0)

    async def _reserve(self, job: EngineJob, cpus: float, gpus: float) -> Any:
        from ray.util.placement_group import placement_group

        key = (job.revision, job.replica)
        if key not in self.groups:
            bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
            self.groups[key] = placement_group([bundle], strategy="STRICT_PACK")
        group = self.groups[key]
        try:
            await self.call(group.ready(), PLACE_TIMEOUT_S)
        except asyncio.TimeoutError:
            free = self.ray.available_resources()
            raise LaunchError(
                f"Ray could not place the replica ({cpus:g} CPU, {gpus:g} GPU on one node) within "
                f"{PLACE_TIMEOUT_S:g}s; the cluster has {free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} "
                "GPU free"
            ) from None
        return group

    def adopt(self, pid: int, port: int) -> RayEngine:
        raise NotImplementedError("Ray replicas end with the daemon's Ray job; they are started again")

    async def release(self, revision: int, replica: str) -> None:
        group = self.groups.pop((revision, replica), None)
        if group is not None and self.ray is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # already gone with its job
                remove_placement_group(group)

    async def close(self) -> None:
        for revision, replica in list(self.groups):
            await self.release(revision, replica)


def _spec_json(spec: DeploymentSpec) -> dict:
    return spec.model_dump(mode="json")


def _env(job: EngineJob) -> dict[str, str]:
    """The daemon's engine settings (LLMDEPLOY_*) minus any key the router reads, plus the owner tag and
    token; the rest of the environment is the node's own."""
    from llmdeploy.control.keys import referenced_env

    secrets = set(referenced_env(job.spec)) | {"LLMDEPLOY_HOME"}
    ours = {k: v for k, v in os.environ.items() if k.startswith("LLMDEPLOY_") and k not in secrets}
    return {**ours, **job.env}


if __name__ == "__main__":
    _exec_child(sys.argv[1:])
