"""May this request leave the machine? A key with `allow_cloud: false` or a request with the header
`x-llmdeploy-allow-cloud: false` never reaches the cloud, whatever the load."""

from __future__ import annotations

from dataclasses import dataclass

ALLOW_CLOUD_HEADER = "x-llmdeploy-allow-cloud"
FALSE_VALUES = frozenset({"false", "0", "no", "off"})


def header_allows_cloud(value: str | None) -> bool:
    # anything but an explicit "no" leaves the key's setting in charge; the header can only restrict
    return value is None or value.strip().lower() not in FALSE_VALUES


@dataclass(frozen=True)
class CloudState:
    enabled: bool  # cloud.enabled and its key is present
    breaker_allows: bool


def cloud_denied_reason(key_allows: bool, header_allows: bool, cloud: CloudState) -> str | None:
    """None: the cloud may serve this request; else why not (for logs and the 503 message)."""
    if not key_allows:
        return "key_no_egress"
    if not header_allows:
        return "request_no_egress"
    if not cloud.enabled:
        return "cloud_disabled"
    if not cloud.breaker_allows:
        return "cloud_breaker_open"
    return None
