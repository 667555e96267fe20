"""API keys `apply` generates when auth is required but a key has no value: printed once, stored as sha256.

A key listed with key_env whose variable is unset gets a generated key under the same name; with no keys
listed at all, one key named `default` is generated. A generated key is kept (as its hash) across applies
and daemon restarts until its variable is set, so a client configured once keeps working.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmdeploy.spec.models import DeploymentSpec

DEFAULT_KEY_NAME = "default"


@dataclass(frozen=True)
class KeyPlan:
    hashes: dict[str, str]  # name -> sha256:<hex>, every generated key in effect
    new_keys: dict[str, str] = field(default_factory=dict)  # name -> plaintext, generated now: print once


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def names_needing_keys(spec: DeploymentSpec, env: Mapping[str, str]) -> list[str]:
    if not spec.auth.api_key_required:
        return []
    if not spec.auth.keys:
        return [DEFAULT_KEY_NAME]
    return [k.name for k in spec.auth.keys if k.key_env is not None and not env.get(k.key_env)]


def plan_keys(spec: DeploymentSpec, env: Mapping[str, str], stored: Mapping[str, str]) -> KeyPlan:
    hashes: dict[str, str] = {}
    new: dict[str, str] = {}
    for name in names_needing_keys(spec, env):
        if name in stored:
            hashes[name] = stored[name]
        else:
            new[name] = "sk-llmd-" + secrets.token_urlsafe(32)
            hashes[name] = hash_key(new[name])
    return KeyPlan(hashes, new)


def referenced_env(spec: DeploymentSpec) -> list[str]:
    """Names of the env vars the router reads secrets from."""
    names = [k.key_env for k in spec.auth.keys if k.key_env]
    if spec.cloud.api_key_env:
        names.append(spec.cloud.api_key_env)
    return names


def mirror_env(values: Mapping[str, str | None], names: list[str]) -> None:
    """Copy the caller's values of `names` into the daemon's environment (unset or empty: removed).

    The router reads keys from the environment, so a later hot reload must see what this apply saw.
    """
    for name in names:
        value = values.get(name)
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
