"""Which launcher runs a revision's engines (control/launch.py for the local one, control/ray_launcher.py for Ray):
one per backend and Ray address, made on first use, so `ray` is imported only by deployments that use it."""

from __future__ import annotations

import asyncio

from llmdeploy.control.launch import Launcher, LocalLauncher
from llmdeploy.spec.models import DeploymentSpec


class Launchers:
    """The launcher of each backend a revision asks for, made on first use (a Ray connection is opened once)."""

    def __init__(self, owner: str):
        self.owner = owner  # names this deployment's Ray actors
        self._made: dict[tuple[str, str | None], Launcher] = {}

    def for_spec(self, spec: DeploymentSpec) -> Launcher:
        p = spec.parallel
        key = (p.backend, p.ray_address if p.backend == "ray" else None)
        if key not in self._made:
            if p.backend == "ray":
                from llmdeploy.control.ray_launcher import RayLauncher

                self._made[key] = RayLauncher(p.ray_address, self.owner)
            else:
                self._made[key] = LocalLauncher()
        return self._made[key]

    async def close(self) -> None:
        await asyncio.gather(*(launcher.close() for launcher in self._made.values()))
