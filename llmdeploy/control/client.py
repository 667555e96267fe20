"""The CLI side of the admin API: httpx over the deployment's unix socket."""

from __future__ import annotations

from typing import Any

import httpx

from llmdeploy.control.paths import DeploymentPaths


class AdminError(RuntimeError):
    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.message, self.status = message, status


class DaemonNotRunning(AdminError):
    pass


class AdminClient:
    def __init__(self, paths: DeploymentPaths, timeout_s: float = 180.0):
        self.paths = paths
        self.http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(paths.admin_sock)),
            base_url="http://llmdeploy-admin",
            timeout=httpx.Timeout(timeout_s, connect=2.0),
            trust_env=False,
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def alive(self) -> dict | None:
        """The daemon's /ping ({name, pid}), or None when no daemon answers."""
        if not self.paths.admin_sock.exists():
            return None
        try:
            return self.request("GET", "/ping", timeout=2.0)
        except AdminError:
            return None

    def request(self, method: str, path: str, json: dict | None = None, timeout: float | None = None) -> dict:
        kw: dict[str, Any] = {"json": json}
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            resp = self.http.request(method, path, **kw)
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as e:
            raise DaemonNotRunning(f"the daemon of {self.paths.name!r} is not running ({e})") from None
        except httpx.HTTPError as e:
            raise AdminError(f"admin API of {self.paths.name!r}: {type(e).__name__}: {e}") from None
        try:
            body = resp.json()
        except ValueError:
            body = {"error": resp.text[:500]}
        if resp.status_code >= 400:
            raise AdminError(body.get("error") or str(body), resp.status_code)
        return body

    def status(self) -> dict:
        return self.request("GET", "/status")

    def apply(self, body: dict) -> dict:
        return self.request("POST", "/apply", body)

    def canary(self, percent: float) -> dict:
        return self.request("POST", "/canary", {"percent": percent})

    def promote(self) -> dict:
        return self.request("POST", "/promote")

    def rollback(self, to_revision: int | None) -> dict:
        return self.request("POST", "/rollback", {"to_revision": to_revision})

    def down(self) -> dict:
        return self.request("POST", "/down")
