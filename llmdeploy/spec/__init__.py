"""The deployment spec: pydantic models of the YAML (models.py) and the file loader with positions (loader.py)."""

from llmdeploy.spec.models import (
    APIKeySpec,
    AuthSpec,
    AutoRollbackSpec,
    CloudSpec,
    DeploymentSpec,
    EngineSpec,
    ModelSpec,
    ParallelSpec,
    RolloutSpec,
    RoutingSpec,
    SLASpec,
    is_loopback,
    split_listen,
)

__all__ = [
    "APIKeySpec",
    "AuthSpec",
    "AutoRollbackSpec",
    "CloudSpec",
    "DeploymentSpec",
    "EngineSpec",
    "ModelSpec",
    "ParallelSpec",
    "RolloutSpec",
    "RoutingSpec",
    "SLASpec",
    "is_loopback",
    "split_listen",
]
