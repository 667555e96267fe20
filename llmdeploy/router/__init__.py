"""The OpenAI-compatible routing proxy: auth, local-first routing, SLA-aware cloud overflow, canary split."""

from llmdeploy.router.app import Router, create_router
from llmdeploy.router.table import EngineEndpoint, RevisionRoute, RoutingTable

__all__ = ["EngineEndpoint", "RevisionRoute", "Router", "RoutingTable", "create_router"]
