"""uvicorn servers embedded in the daemon: the router on `listen` (TCP, optional TLS) and the admin API on a
unix socket. We bind the sockets ourselves: a taken port is a clear error instead of uvicorn's sys.exit, and
admin.sock is created 0600 (uvicorn would chmod its own to 0666)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn

from llmdeploy.openai_api.guard import uvicorn_settings
from llmdeploy.spec.models import DeploymentSpec


class ListenError(RuntimeError):
    pass


class _EmbeddedServer(uvicorn.Server):
    # the daemon owns SIGTERM/SIGINT; an embedded server must not swallow or re-raise them
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Listener:
    def __init__(self, app: Any, sock: socket.socket, label: str, **config: Any):
        self.sock, self.label = sock, label
        self.server = _EmbeddedServer(
            uvicorn.Config(app, access_log=False, log_config=None, log_level="warning", **config)
        )
        self.task: asyncio.Task | None = None

    async def start(self) -> Listener:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name=f"listener-{self.label}")
        while not self.server.started:
            if self.task.done():
                exc = self.task.exception() if not self.task.cancelled() else None
                raise ListenError(f"{self.label} failed to start: {exc or 'server exited'}")
            await asyncio.sleep(0.02)
        return self

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded by timeout_graceful_shutdown)."""
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(BaseException):
            await self.task
        self.task = None

    def bound_port(self) -> int | None:
        try:
            return self.sock.getsockname()[1]
        except OSError:  # the socket is closed (the server stopped): no port to compare with
            return None


def tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def unix_socket(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


async def open_router_listener(app: Any, spec: DeploymentSpec, drain_s: float = 30.0) -> Listener:
    sock = tcp_socket(spec.listen_host, spec.listen_port)
    tls = {"ssl_certfile": spec.tls.cert_file, "ssl_keyfile": spec.tls.key_file} if spec.tls.enabled else {}
    listener = Listener(
        app,
        sock,
        f"router on {spec.listen}",
        lifespan="off",
        timeout_graceful_shutdown=drain_s,
        timeout_keep_alive=30,
        **uvicorn_settings(),
        **tls,
    )
    return await listener.start()


async def open_admin_listener(app: Any, path: Path) -> Listener:
    return await Listener(
        app, unix_socket(path), "admin API", lifespan="off", timeout_graceful_shutdown=5
    ).start()


def router_url(spec: DeploymentSpec) -> str:
    host = spec.listen_host
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if spec.tls.enabled else 'http'}://{host}:{spec.listen_port}"
