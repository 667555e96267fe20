"""State store (real SQLite file), generated keys, the CLI lock and name resolution: no daemon needed."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from llmdeploy.control import revisions as rv
from llmdeploy.control.keys import hash_key, plan_keys
from llmdeploy.control.locking import deployment_lock
from llmdeploy.control.paths import DeploymentNotFound, DeploymentPaths, resolve_name
from llmdeploy.control.state import SCHEMA_VERSION, StateStore
from llmdeploy.spec.models import DeploymentSpec


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDEPLOY_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_state_is_sqlite_in_wal_mode_and_private(home):
    paths = DeploymentPaths.of("chat").create()
    store = StateStore(paths.state_db)
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert oct(paths.state_db.stat().st_mode & 0o777) == "0o600"
    assert oct(paths.root.stat().st_mode & 0o777) == "0o700"
    store.close()


def test_revisions_events_and_deployment_survive_reopening(home):
    paths = DeploymentPaths.of("chat").create()
    spec = DeploymentSpec()
    store = StateStore(paths.state_db)
    store.ensure_deployment("chat")
    r1 = store.create_revision(rv.spec_dict(spec), rv.revision_hash(spec), rv.STARTING)
    store.set_revision_state(r1, rv.SERVING)
    store.mark_served(r1)
    store.update_deployment(spec=rv.spec_dict(spec), stable=r1, candidate=None, candidate_percent=0.0)
    store.add_event("apply", "new deployment", r1, {"changes": []})
    store.record_engine(r1, "r1", 4242, 5555)
    store.close()

    again = StateStore(paths.state_db)  # a new daemon after kill -9 reads the same
    dep = again.deployment()
    assert (dep.name, dep.stable, dep.candidate, dep.spec) == ("chat", r1, None, rv.spec_dict(spec))
    (rev,) = again.revisions()
    assert (rev.id, rev.state, rev.served, rev.spec_hash) == (r1, rv.SERVING, True, rv.revision_hash(spec))
    assert [(e.kind, e.revision, e.data) for e in again.events()] == [("apply", r1, {"changes": []})]
    assert [(e.pid, e.port) for e in again.engines()] == [(4242, 5555)]
    assert again.create_revision(rv.spec_dict(spec), "h", rv.STARTING) == r1 + 1  # ids never reused


def test_revision_hash_covers_only_model_engine_parallel():
    a = DeploymentSpec()
    assert rv.revision_hash(a) == rv.revision_hash(
        a.model_copy(update={"sla": a.sla.model_copy(update={"ttft_p99_ms": 5})})
    )
    assert rv.revision_hash(a) != rv.revision_hash(DeploymentSpec(engine={"max_num_seqs": 8}))


def test_split_gives_stable_the_rest():
    assert rv.split(1, None, 0) == {1: 100.0}
    assert rv.split(1, 2, 10) == {1: 90.0, 2: 10}
    assert rv.split(None, 2, 10) == {2: 100.0}


def test_generated_keys_are_printed_once_and_stored_as_hashes():
    spec = DeploymentSpec(auth={"api_key_required": True, "keys": [{"name": "app", "key_env": "APP_KEY"}]})
    first = plan_keys(spec, env={}, stored={})
    (key,) = first.new_keys.values()
    assert key.startswith("sk-llmd-") and len(key) > 40
    assert first.hashes == {"app": hash_key(key)} and key not in str(first.hashes)
    again = plan_keys(spec, env={}, stored=first.hashes)  # next apply: same key, nothing new to print
    assert again.hashes == first.hashes and again.new_keys == {}
    assert plan_keys(spec, env={"APP_KEY": "from-env"}, stored=first.hashes).hashes == {}  # the env var wins
    anonymous = DeploymentSpec(auth={"api_key_required": True})
    assert list(plan_keys(anonymous, {}, {}).new_keys) == ["default"]
    assert plan_keys(DeploymentSpec(auth={"api_key_required": False}), {}, {}).hashes == {}


def test_a_second_cli_call_waits_for_the_lock(home, tmp_path):
    paths = DeploymentPaths.of("chat").create()
    waited = []
    code = (
        "import sys, time; from llmdeploy.control.locking import deployment_lock; from pathlib import Path\n"
        "with deployment_lock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(1.0)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(paths.lock_file)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    with deployment_lock(paths.lock_file, on_wait=lambda: waited.append(holder.poll())):
        pass  # reached only once the holder let go
    assert waited == [None]  # it was still holding the lock when we asked, so we waited
    assert holder.wait(5) == 0


def test_name_defaults_to_the_single_deployment(home):
    with pytest.raises(DeploymentNotFound, match="no deployment in"):
        resolve_name(None)
    for name in ("one", "two"):
        paths = DeploymentPaths.of(name).create()
        StateStore(paths.state_db).close()
        if name == "one":
            assert resolve_name(None) == "one"
    with pytest.raises(DeploymentNotFound, match=r"several deployments .*one, two.*pass --name"):
        resolve_name(None)
    assert resolve_name("two") == "two"
    with pytest.raises(DeploymentNotFound, match="no deployment named 'three'"):
        resolve_name("three")


def test_a_state_dir_too_long_for_a_socket_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDEPLOY_HOME", str(tmp_path / ("x" * 120)))
    with pytest.raises(RuntimeError, match="too long for a unix socket"):
        DeploymentPaths.of("chat").create()


def test_schema_version_is_recorded(home):
    paths = DeploymentPaths.of("chat").create()
    StateStore(paths.state_db).close()
    with sqlite3.connect(paths.state_db) as db:
        assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )


def _rev(id: int, served: bool, spec_hash: str, state: str = "retired"):
    from llmdeploy.control.state import Revision

    return Revision(id, {}, spec_hash, 0.0, state, "", "apply", served)


def test_undo_goes_to_the_latest_earlier_revision_that_served_other_settings():
    revs = [
        _rev(1, True, "a"),
        _rev(2, False, "b", "rolled-back"),
        _rev(3, True, "c"),
        _rev(4, True, "a", "serving"),
    ]
    assert rv.undo_target(revs, stable=4).id == 3
    assert rv.undo_target(revs[:3] + [_rev(4, True, "c", "serving")], stable=4).id == 1  # skips its own twin
    assert rv.undo_target(revs, stable=4, to_revision=1).id == 1
    for to, message, bad_input in (
        (2, "never served", False),
        (4, "already the stable", False),
        (9, "no revision 9", True),
    ):
        with pytest.raises(rv.NoRollbackTarget, match=message) as e:
            rv.undo_target(revs, stable=4, to_revision=to)
        assert e.value.bad_input is bad_input
    with pytest.raises(rv.NoRollbackTarget, match="nothing to roll back to"):
        rv.undo_target([_rev(1, True, "a", "serving")], stable=1)


def test_restart_backoff_doubles_up_to_a_cap():
    from llmdeploy.control.supervisor import BACKOFF_MAX_S, backoff_s

    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_s(50) == BACKOFF_MAX_S


def test_what_the_supervisor_cannot_run_is_refused_up_front(monkeypatch):
    from llmdeploy.control.supervisor import unsupported

    assert unsupported(DeploymentSpec()) is None
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    refusal = unsupported(DeploymentSpec(parallel={"backend": "ray", "ray_address": "ray://h:1"}))
    assert "pip install 'llmdeploy[ray]'" in refusal
    assert unsupported(DeploymentSpec(parallel={"tensor_parallel": 2})) is None  # the engine runs its ranks
