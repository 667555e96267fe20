"""API keys: resolved once into sha256 digests; requests are compared in constant time; only names leave.

key_env keys are read from the environment at startup (or reload) and only their digest is kept; `key:
sha256:...` entries are used as they are; the control plane adds the keys it generated as name -> hex digest.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass

from llmdeploy.openai_api.errors import invalid_api_key

log = logging.getLogger("llmdeploy.router.auth")
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class KeyInfo:
    name: str
    allow_cloud: bool = True
    rpm: int | None = None


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    info: KeyInfo


def sha256_digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def presented_key(headers) -> str | None:
    """`Authorization: Bearer <key>` or `api-key: <key>` (Azure-style clients)."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    api_key = headers.get("api-key")
    return api_key.strip() if api_key and api_key.strip() else None


class KeyStore:
    def __init__(self, auth_spec, generated_key_hashes: dict[str, str] | None = None, environ=None) -> None:
        self.required = auth_spec.api_key_required
        self.metrics_public = auth_spec.metrics_public
        self.entries = self._resolve(
            auth_spec, generated_key_hashes or {}, os.environ if environ is None else environ
        )
        self.anonymous = KeyInfo(ANONYMOUS)

    @staticmethod
    def _resolve(auth_spec, generated: dict[str, str], environ) -> list[_Entry]:
        entries: list[_Entry] = []
        spec_names = set()
        for k in auth_spec.keys:
            spec_names.add(k.name)
            info = KeyInfo(k.name, k.allow_cloud, k.rpm)
            if k.key is not None:
                entries.append(_Entry(bytes.fromhex(k.key.removeprefix("sha256:")), info))
                continue
            value = environ.get(k.key_env, "")
            if value:
                entries.append(_Entry(sha256_digest(value), info))
            elif k.name not in generated:
                log.warning(
                    "api key %r: environment variable %s is not set; this key is disabled", k.name, k.key_env
                )
        for name, hexdigest in generated.items():
            spec = next((k for k in auth_spec.keys if k.name == name), None)
            info = KeyInfo(name, spec.allow_cloud, spec.rpm) if spec else KeyInfo(name)
            try:
                entries.append(_Entry(bytes.fromhex(hexdigest.removeprefix("sha256:")), info))
            except ValueError:
                log.warning("generated key %r: not a sha256 hex digest; ignored", name)
        return entries

    def rpm_limits(self) -> dict[str, int | None]:
        return {e.info.name: e.info.rpm for e in self.entries}

    def authenticate(self, headers) -> KeyInfo:
        """The key's info, or raise 401 invalid_api_key. Every entry is compared, so timing says nothing
        about which (or whether any) key matched."""
        value = presented_key(headers)
        if not self.required:
            if value is None:
                return self.anonymous
            match = self._match(value)
            return match or self.anonymous
        if value is None:
            raise invalid_api_key()
        match = self._match(value)
        if match is None:
            raise invalid_api_key()
        return match

    def _match(self, value: str) -> KeyInfo | None:
        digest = sha256_digest(value)
        found: KeyInfo | None = None
        for e in self.entries:
            if hmac.compare_digest(digest, e.digest) and found is None:
                found = e.info
        return found
