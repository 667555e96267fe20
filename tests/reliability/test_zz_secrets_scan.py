"""Last in the suite (hence the name): after everything above ran against the deployment, no key and no prompt
text is anywhere in its state directory (state.db, logs), in `status`, `history` or `logs`, and the engines'
internal token is nowhere either. The markers are random per run, so a find is a real leak."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from llmdeploy.control.processes import engine_token
from tests.reliability.deployment import CLIENT_MARKER, CLOUD_MARKER, NAME, PROMPT_MARKER, chat

pytestmark = pytest.mark.slow


def test_no_key_token_or_prompt_in_logs_state_or_status(deployment):
    with httpx.Client(base_url=deployment.url, headers=deployment.headers, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=chat("one more for the scan", max_tokens=2))  # at least one
        assert r.status_code == 200
    engine = deployment.engine()
    token = engine_token(engine["pid"])
    assert token  # the daemon gave its engine one; a local process without it is refused
    refused = httpx.post(f"{engine['url']}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_internal_token"
    files = [p for p in deployment.cli.home.rglob("*") if p.is_file() and p.suffix != ".sock"]
    blobs = {str(p): p.read_bytes() for p in files}
    for args in (("status", "--json"), ("status",), ("history", "--json"), ("logs", "--lines", "5000")):
        blobs[" ".join(args)] = deployment.cli.ok(*args, "--name", NAME).stdout.encode()
    found = [
        (where, name)
        for name, secret in (
            ("client key", CLIENT_MARKER),
            ("cloud key", CLOUD_MARKER),
            ("prompt text", PROMPT_MARKER),
            ("engine token", token),
        )
        for where, blob in blobs.items()
        if secret.encode() in blob
    ]
    assert not found, found
    assert any(p.endswith("state.db") for p in blobs) and any("log" in p for p in blobs)
    # the markers did travel: the prompts reached the cloud (the burst), the key authenticated every request
    assert any(PROMPT_MARKER in json.dumps(r["body"]) for r in deployment.cloud.requests())
    print(
        f"secrets scan: {len(blobs)} files and outputs, {sum(map(len, blobs.values()))} bytes, nothing found"
    )
    report = os.environ.get("LLMDEPLOY_RELIABILITY_REPORT")
    if report:  # the figures for bench/RESULTS.md
        with open(report, "w") as f:
            json.dump(deployment.marks, f, indent=2)
