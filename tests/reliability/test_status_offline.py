"""`status` while the daemon is down shows the last applied spec's settings and the engines still running (it
said `cloud off` and listed no replica), and a re-adopted engine keeps its restart count (it was reset)."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from llmdeploy.cli.deploy_views import status_view
from llmdeploy.control import revisions as rv
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.processes import OWNER_ENV, owner_tag
from llmdeploy.control.state import StateStore
from llmdeploy.control.status import offline_status
from llmdeploy.control.supervisor import Supervisor
from llmdeploy.openai_api.headers import ENGINE_TOKEN_ENV
from llmdeploy.spec.models import DeploymentSpec
from tests.helpers.procs import ServerProcess, free_port

FAKE_CLOUD = Path(__file__).resolve().parents[1] / "helpers" / "fake_cloud.py"
TOKEN = "orphan-token-5b7d1e"
# the fake answers /health and /load; its argv carries what marks our engine (the module name and the port)
POSE_AS_ENGINE = (
    "import runpy, sys; sys.argv = ['fake', '--port', sys.argv[2]]; "
    f"runpy.run_path({str(FAKE_CLOUD)!r}, run_name='__main__')"
)


def cloud_spec() -> DeploymentSpec:
    return DeploymentSpec.model_validate(
        {
            "name": "offline",
            "model": {"served_alias": "chat-x"},
            "listen": f"127.0.0.1:{free_port()}",
            "cloud": {
                "enabled": True,
                "base_url": "http://127.0.0.1:9/v1",
                "api_key_env": "NOPE_KEY",
                "model": "m",
            },
        }
    )


@pytest.fixture
def orphan(tmp_path, monkeypatch):
    """A deployment whose daemon died: state.db with a cloud-on spec and an engine still running."""
    monkeypatch.setenv("LLMDEPLOY_HOME", str(tmp_path / "home"))
    paths = DeploymentPaths.of("offline").create()
    spec = cloud_spec()
    store = StateStore(paths.state_db)
    store.ensure_deployment("offline")
    rev = store.create_revision(rv.spec_dict(spec), rv.revision_hash(spec), rv.SERVING)
    store.update_deployment(spec=rv.spec_dict(spec), stable=rev, running=True)
    port = free_port()
    env = {OWNER_ENV: owner_tag(paths, rev, "r1"), ENGINE_TOKEN_ENV: TOKEN}
    proc = ServerProcess(
        ["-c", POSE_AS_ENGINE, "llmdeploy.engine", str(port)],
        f"http://127.0.0.1:{port}/health",
        tmp_path / "engine.log",
        env=env,
        timeout_s=60,
    ).start()
    try:
        store.record_engine(rev, "r1", proc.proc.pid, port, restarts=3)
        yield paths, store, spec, proc
    finally:
        proc.stop()
        store.close()


def test_offline_status_shows_the_last_spec_and_the_running_engines(orphan):
    paths, store, spec, proc = orphan
    st = offline_status(paths)
    assert st["daemon"]["running"] is False
    assert st["cloud"] is True and st["settings_from"] == "last applied spec"
    assert st["served_alias"] == "chat-x" and st["url"].endswith(str(spec.listen_port))
    (rep,) = st["replicas"]
    assert rep["pid"] == proc.proc.pid and rep["restarts"] == 3 and rep["ready"] is True
    assert rep["total_blocks"] == 1024  # the engine's /load, read at once
    console = Console(record=True, width=160)
    console.print(status_view(st))
    text = console.export_text()
    assert "on (last applied spec)" in text and str(proc.proc.pid) in text
    assert TOKEN not in json.dumps(st) and TOKEN.encode() not in paths.state_db.read_bytes()


def test_readoption_keeps_the_restart_count_and_the_engines_token(orphan):
    paths, store, spec, proc = orphan

    async def adopt():
        sup = Supervisor(paths, store, lambda: None, lambda *a, **kw: None)
        sup.start_revision(1, spec, store.engines())
        (r,) = sup.replicas[1]
        deadline = time.monotonic() + 30
        while r.phase not in ("adopted", "ready") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await sup.detach()
        return r

    r = asyncio.run(adopt())
    assert r.pid == proc.proc.pid and r.restarts == 3
    assert r.token == TOKEN and TOKEN not in json.dumps(r.to_json()) and TOKEN not in repr(r)
    assert proc.proc.poll() is None  # adopting left it running
    assert httpx.get(f"{r.url}/health", timeout=5).status_code == 200


def test_a_state_db_from_before_the_restart_column_is_migrated(tmp_path):
    db = tmp_path / "state.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        c.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        c.execute(
            "CREATE TABLE engines (revision INTEGER NOT NULL, replica TEXT NOT NULL, pid INTEGER NOT NULL, "
            "port INTEGER NOT NULL, started REAL NOT NULL, PRIMARY KEY (revision, replica))"
        )
        c.execute("INSERT INTO engines VALUES (1, 'r1', 42, 4242, 0)")
    store = StateStore(db)
    assert [(e.pid, e.restarts) for e in store.engines()] == [(42, 0)]
    store.record_engine(1, "r1", 43, 4243, restarts=2)
    assert [(e.pid, e.restarts) for e in store.engines()] == [(43, 2)]
    store.close()


def test_status_cli_offline_names_the_cloud_and_the_engine(orphan):
    paths, _, _, proc = orphan
    import subprocess

    out = subprocess.run(
        [str(Path(sys.executable).with_name("llmdeploy")), "status", "--name", "offline"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "on (last applied spec)" in out.stdout and str(proc.proc.pid) in out.stdout
