"""`python -m llmdeploy.router` as a real process: HTTPS with a self-signed certificate, the openai SDK
unchanged (streaming included), access logs without keys or prompt text, SIGHUP reload; cloud TLS verification."""

from __future__ import annotations

import os
import signal
import ssl
import time

import httpx
import openai
import pytest
import yaml

from tests.helpers.fake_cloud import FakeCloud
from tests.helpers.procs import ServerProcess, free_port
from tests.router.conftest import (
    ALIAS,
    CLIENT_KEY,
    CLOUD_KEY,
    ENV,
    LOCAL_ONLY_KEY,
    chat_body,
    client,
    make_spec,
    spec_dict,
    wait_until,
)

MARKER = "PURPLE-ELEPHANT-4242"
BUSY = {
    "waiting": 100,
    "running": 64,
    "free_blocks": 1000,
    "total_blocks": 1024,
    "max_num_seqs": 64,
    "ready": True,
}


def write_config(path, cloud_base: str, port: int, tls: tuple[str, str], bodies: bool = False) -> None:
    d = spec_dict(
        f"{cloud_base}/v1",
        listen=f"127.0.0.1:{port}",
        tls={"cert_file": tls[0], "key_file": tls[1]},
        logging={"level": "info", "bodies": bodies},
    )
    path.write_text(yaml.safe_dump(d))


@pytest.fixture
def standalone(fakes, tmp_path, self_signed):
    cloud, engine = fakes
    port = free_port()
    cfg = tmp_path / "llmdeploy.yaml"
    write_config(cfg, cloud.base, port, self_signed)
    proc = ServerProcess(
        ["-m", "llmdeploy.router", "--config", str(cfg), "--engine", engine.base],
        f"https://127.0.0.1:{port}/health",
        tmp_path / "router.log",
        env=ENV,
        timeout_s=60,
    ).start()
    yield proc, f"https://127.0.0.1:{port}", cfg
    proc.stop()


def sdk(url: str, cert: str, key: str = CLIENT_KEY) -> openai.OpenAI:
    http = httpx.Client(verify=ssl.create_default_context(cafile=cert))
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, http_client=http, max_retries=0)


def test_openai_sdk_over_https_and_clean_logs(fakes, standalone, self_signed, tmp_path):
    cloud, engine = fakes
    proc, url, cfg = standalone
    api = sdk(url, self_signed[0])
    out = api.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": f"say {MARKER}"}])
    assert out.choices[0].message.content == "Hello from the local engine" and out.model == ALIAS
    chunks = list(
        api.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": MARKER}], stream=True)
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        == "Hello from the local engine"
    )
    comp = api.completions.create(model=ALIAS, prompt=MARKER, max_tokens=2)
    assert comp.choices[0].text == "Hello from"
    assert [m.id for m in api.models.list()] == [ALIAS]
    raw = api.chat.completions.with_raw_response.create(
        model=ALIAS, messages=[{"role": "user", "content": "x"}]
    )
    assert raw.headers["x-llmdeploy-backend"] == "local" and raw.headers["x-llmdeploy-revision"] == "1"

    engine.control(load=BUSY)  # now the cloud takes it, with the cloud key from the router's environment
    time.sleep(0.5)
    chunks = list(
        api.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": MARKER}], stream=True)
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        == "Hello from the fake cloud"
    )
    assert all(ch.model == ALIAS for ch in chunks)
    assert cloud.requests()[-1]["auth_ok"]

    with pytest.raises(openai.NotFoundError) as nf:
        api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        sdk(url, self_signed[0], key=LOCAL_ONLY_KEY + "-wrong").chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "x"}], temperature=9)

    logs = (tmp_path / "router.log").read_text()
    access = [line for line in logs.splitlines() if "llmdeploy.router.access" in line]
    assert len(access) == 8 and any("key=app" in line and "backend=cloud" in line for line in access)
    for secret in (CLIENT_KEY, CLOUD_KEY, LOCAL_ONLY_KEY, MARKER, "Hello from the"):
        assert secret not in logs, secret
    assert any("status=401" in line and "key=-" in line for line in access)


def test_sighup_reload_turns_on_body_logging(fakes, standalone, self_signed, tmp_path):
    proc, url, cfg = standalone
    port = int(url.rsplit(":", 1)[1])
    write_config(cfg, fakes[0].base, port, self_signed, bodies=True)
    os.kill(proc.proc.pid, signal.SIGHUP)
    log_path = tmp_path / "router.log"
    assert wait_until(lambda: "settings reloaded" in log_path.read_text())
    sdk(url, self_signed[0]).chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": MARKER}]
    )
    assert wait_until(lambda: MARKER in log_path.read_text())  # the same check above can fail


def test_cloud_certificate_is_verified(fakes, start_router, self_signed, tmp_path):
    cloud, engine = fakes
    tls_cloud = FakeCloud(tmp_path, expected_key=CLOUD_KEY, tls=self_signed).start()
    try:
        engine.control(load=BUSY)
        untrusted = start_router(make_spec(f"{tls_cloud.base}/v1", cloud={"max_retries": 0}), [engine.base])
        trusted = start_router(
            make_spec(f"{tls_cloud.base}/v1", cloud={"ca_file": self_signed[0]}), [engine.base]
        )
        with client(untrusted) as c:
            r = c.post("/v1/chat/completions", json=chat_body())
            assert r.headers["x-llmdeploy-backend"] == "local" and tls_cloud.stats()["requests"] == 0
        with client(trusted) as c:
            r = c.post("/v1/chat/completions", json=chat_body())
            assert r.headers["x-llmdeploy-backend"] == "cloud" and tls_cloud.stats()["requests"] == 1
    finally:
        tls_cloud.stop()


def test_router_cli_rejects_a_bad_config(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: 127.0.0.1:8000\nrouting:\n  max_body_byte: 10\n")
    r = subprocess.run(
        [sys.executable, "-m", "llmdeploy.router", "--config", str(bad), "--engine", "http://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "max_body_byte" in r.stderr
