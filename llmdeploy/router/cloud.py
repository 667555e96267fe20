"""The cloud endpoint: one pooled httpx.AsyncClient (timeouts, verified TLS), provider presets, the key from
the environment, and tenacity retries with exponential backoff and jitter before the commit point.

The key lives only in this object's request headers: never logged, never in an error, never in metrics.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from llmdeploy.policies.capability import Capabilities
from llmdeploy.router.normalize import UpstreamFailure
from llmdeploy.router.provider import ProviderTransport

log = logging.getLogger("llmdeploy.router.cloud")
T = TypeVar("T")

MAX_HONOURED_RETRY_AFTER_S = 10.0  # a longer Retry-After is not waited out in-request: fail over instead


@dataclass(frozen=True)
class Preset:
    base_url: str | None
    auth_header: str = "authorization"
    auth_prefix: str = "Bearer "


PRESETS = {
    "qianfan": Preset("https://qianfan.baidubce.com/v2"),  # v2: OpenAI-compatible, Bearer bce-v3/... key
    "openai-compatible": Preset(None),
}


def ssl_context(ca_file: str | None) -> ssl.SSLContext:
    try:
        import certifi

        ctx = ssl.create_default_context(cafile=certifi.where())
    except ImportError:  # pragma: no cover - certifi comes with httpx
        ctx = ssl.create_default_context()
    if ca_file:
        ctx.load_verify_locations(cafile=ca_file)  # in addition to the public roots
    return ctx


class CloudClient:
    def __init__(
        self, cloud_spec, *, environ=None, backoff_initial_s: float = 0.25, backoff_max_s: float = 4.0
    ):
        environ = os.environ if environ is None else environ
        self.spec = cloud_spec
        preset = PRESETS[cloud_spec.provider]
        self.base_url = (cloud_spec.base_url or preset.base_url or "").rstrip("/")
        self.model = cloud_spec.model
        key = environ.get(cloud_spec.api_key_env, "") if cloud_spec.api_key_env else ""
        self.enabled = bool(cloud_spec.enabled and self.base_url and key)
        if cloud_spec.enabled and not key:
            log.warning(
                "cloud.enabled but environment variable %s is not set: the cloud is off",
                cloud_spec.api_key_env,
            )
        self._headers = {preset.auth_header: f"{preset.auth_prefix}{key}"} if key else {}
        self._secrets = (key,) if key else ()
        self.max_retries = cloud_spec.max_retries
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        # the provider's dialect is translated at the transport (router/provider.py): the relay sees OpenAI's
        transport = httpx.AsyncHTTPTransport(
            verify=ssl_context(cloud_spec.ca_file),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(cloud_spec.timeout_s, connect=cloud_spec.connect_timeout_s),
            transport=ProviderTransport(transport),
        )
        self.capabilities = Capabilities.for_cloud(
            cloud_spec.provider, cloud_spec.capabilities, cloud_spec.max_model_len
        )

    def key_matches(self, cloud_spec, environ=None) -> bool:
        environ = os.environ if environ is None else environ
        key = environ.get(cloud_spec.api_key_env, "") if cloud_spec.api_key_env else ""
        return (key,) == self._secrets if key else not self._secrets

    @property
    def secrets(self) -> tuple[str, ...]:
        """Values that must never leave: redacted from any upstream message we pass on."""
        return self._secrets

    def url(self, endpoint: str) -> str:
        return f"{self.base_url}/{endpoint}"

    def headers(self, request_id: str) -> dict[str, str]:
        return {**self._headers, "x-request-id": request_id}

    async def with_retries(
        self, attempt: Callable[[], Awaitable[T]], on_retry: Callable[[UpstreamFailure], None]
    ) -> T:
        """Run `attempt` (one try up to the commit point), again on retryable failures, with backoff."""
        backoff = wait_exponential(multiplier=self.backoff_initial_s, max=self.backoff_max_s) + wait_random(
            0, self.backoff_initial_s
        )

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            after = getattr(exc, "retry_after_s", None)
            return max(backoff(state), after or 0.0)

        def should_retry(exc: BaseException) -> bool:
            ok = isinstance(exc, UpstreamFailure) and exc.retryable
            return ok and (exc.retry_after_s or 0.0) <= MAX_HONOURED_RETRY_AFTER_S

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=wait,
            retry=retry_if_exception(should_retry),
            before_sleep=lambda state: on_retry(state.outcome.exception()),
            reraise=True,
        )
        async for try_ in retrying:
            with try_:
                return await attempt()
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        await self.client.aclose()
