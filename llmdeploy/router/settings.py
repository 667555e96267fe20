"""The router's settings: everything a request reads from the spec, one frozen object swapped on reload.

A request takes the Settings current at its arrival and keeps them to its end; `Router.update_spec` swaps in
new ones for the requests after it (docs/ARCHITECTURE.md section 7).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmdeploy.policies.affinity import ReplicaChoice
from llmdeploy.policies.overflow import OverflowLimits
from llmdeploy.router.auth import KeyStore
from llmdeploy.router.cloud import CloudClient


@dataclass(frozen=True)
class Settings:
    spec: object
    alias: str
    keys: KeyStore
    limits: OverflowLimits
    cloud: CloudClient
    max_body: int
    local_wait_s: float
    sticky_header: str
    bodies: bool
    replica_choice: ReplicaChoice


def build_settings(
    spec,
    key_hashes: dict[str, str],
    environ: Mapping[str, str] | None,
    cloud_backoff_s: float,
    reuse_cloud: CloudClient | None = None,
) -> Settings:
    """The Settings of `spec`; `reuse_cloud` keeps an open cloud client whose endpoint and key are unchanged."""
    cloud = reuse_cloud or CloudClient(spec.cloud, environ=environ, backoff_initial_s=cloud_backoff_s)
    return Settings(
        spec=spec,
        alias=spec.model.served_alias,
        keys=KeyStore(spec.auth, key_hashes, environ),
        limits=OverflowLimits.from_spec(spec),
        cloud=cloud,
        max_body=spec.routing.max_body_bytes,
        local_wait_s=spec.routing.local_wait_s,
        sticky_header=spec.rollout.sticky_header,
        bodies=spec.logging.bodies,
        replica_choice=ReplicaChoice.from_spec(spec),
    )
