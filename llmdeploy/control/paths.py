"""Where a deployment keeps its state: $LLMDEPLOY_HOME/<name>/ (default ~/.llmdeploy/<name>/)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# sun_path is 108 bytes on Linux (104 on macOS); a longer socket path cannot be bound at all
MAX_SOCKET_PATH = 100


class DeploymentNotFound(RuntimeError):
    """No deployment, or several where one was expected; the message says which --name to pass."""


def home() -> Path:
    return Path(os.environ.get("LLMDEPLOY_HOME") or Path.home() / ".llmdeploy").expanduser().resolve()


@dataclass(frozen=True)
class DeploymentPaths:
    name: str
    root: Path

    @classmethod
    def of(cls, name: str) -> DeploymentPaths:
        return cls(name, home() / name)

    @property
    def state_db(self) -> Path:
        return self.root / "state.db"

    @property
    def admin_sock(self) -> Path:
        return self.root / "admin.sock"

    @property
    def lock_file(self) -> Path:
        return self.root / "lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def daemon_log(self) -> Path:
        return self.logs / "daemon.log"

    def engine_log(self, revision: int, replica: str) -> Path:
        return self.logs / f"engine-rev{revision}-{replica}.log"

    def create(self) -> DeploymentPaths:
        # the directory is the admin boundary: only the owner may reach admin.sock or read state.db
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        self.logs.mkdir(exist_ok=True, mode=0o700)
        if len(os.fsencode(self.admin_sock)) > MAX_SOCKET_PATH:
            raise RuntimeError(
                f"state directory {self.root} is too long for a unix socket path; set LLMDEPLOY_HOME to a shorter folder"
            )
        return self


def deployment_names() -> list[str]:
    root = home()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "state.db").is_file())


def resolve_name(name: str | None) -> str:
    """--name, or the only deployment in $LLMDEPLOY_HOME."""
    names = deployment_names()
    if name:
        if name not in names:
            known = f"; known: {', '.join(names)}" if names else ""
            raise DeploymentNotFound(f"no deployment named {name!r} in {home()}{known}")
        return name
    if not names:
        raise DeploymentNotFound(f"no deployment in {home()}; start one with `llmdeploy apply FILE`")
    if len(names) > 1:
        raise DeploymentNotFound(f"several deployments in {home()} ({', '.join(names)}); pass --name")
    return names[0]
