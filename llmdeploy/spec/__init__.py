"""The deployment spec: pydantic models of the YAML (models.py) and the file loader with positions (loader.py)."""

from llmdeploy.spec.loader import SpecFileError, SpecIssue, SpecResult, load_spec_file, load_spec_text
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
    RuleError,
    SLASpec,
    is_loopback,
    split_listen,
)
from llmdeploy.spec.parallel import ReplicaRange

__all__ = [
    "APIKeySpec",
    "AuthSpec",
    "AutoRollbackSpec",
    "CloudSpec",
    "DeploymentSpec",
    "EngineSpec",
    "ModelSpec",
    "ParallelSpec",
    "ReplicaRange",
    "RolloutSpec",
    "RoutingSpec",
    "RuleError",
    "SLASpec",
    "SpecFileError",
    "SpecIssue",
    "SpecResult",
    "is_loopback",
    "load_spec_file",
    "load_spec_text",
    "split_listen",
]
