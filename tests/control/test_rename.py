"""Renaming the served model in a gray release: a new `model.served_alias` is a new revision; while both
revisions are listed both names work (each request served by the revision the split picks, and answered under
the name it asked for); promote leaves only the new name, rollback only the old one."""

from __future__ import annotations

import httpx
import pytest

from tests.control.conftest import ALIAS, Cli, base_spec, revision, split_of, write_spec

NAME = "rename"
NEW = "tiny-v2"


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("rename")
    cli = Cli(root / "home")
    v1 = base_spec(NAME, tiny_llama)
    v2 = {**v1, "model": {**v1["model"], "served_alias": NEW}}
    rig = {
        "cli": cli,
        "v1": write_spec(root / "v1.yaml", v1),
        "v2": write_spec(root / "v2.yaml", v2),
        "url": f"http://{v1['listen']}",
    }
    yield rig
    cli.cleanup(NAME)


def ask(rig, model: str, pin: int | None = None) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"x-llmdeploy-revision": str(pin)} if pin else {}
    return httpx.post(f"{rig['url']}/v1/chat/completions", json=body, headers=headers, timeout=60)


def listed(rig) -> list[str]:
    return [m["id"] for m in httpx.get(f"{rig['url']}/v1/models", timeout=10).json()["data"]]


def test_a_new_alias_starts_a_revision_and_both_names_work(rig):
    rig["cli"].ok("apply", str(rig["v1"]))
    r = rig["cli"].ok("apply", str(rig["v2"]))
    assert "new revision" in r.stdout and "revision 2 r1: ready" in r.stdout
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 100.0, 2: 0.0} and revision(st, 2)["state"] == "ready"
    assert listed(rig) == [ALIAS, NEW]  # the stable revision's name first
    for model in (ALIAS, NEW):
        for pin in (1, 2):  # either name on either revision: the router gives each engine the name it answers
            resp = ask(rig, model, pin)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == model and resp.headers["x-llmdeploy-revision"] == str(pin)
    assert ask(rig, "other").json()["error"]["code"] == "model_not_found"
    # the same engine settings under a new name: revision 2's engine read the start measures revision 1's kept
    # (engine/start_measures.py: the owner tag the daemon gives each replica is not part of their key)
    rev2_log = (rig["cli"].home / NAME / "logs" / "engine-rev2-r1.log").read_text()
    assert "kept from an earlier start" in rev2_log


def test_promote_leaves_only_the_new_name(rig):
    rig["cli"].ok("promote", "--name", NAME)
    assert listed(rig) == [NEW]
    assert ask(rig, NEW).status_code == 200
    old = ask(rig, ALIAS)
    assert old.status_code == 404 and old.json()["error"]["code"] == "model_not_found"


def test_rollback_brings_the_old_name_back(rig):
    rig["cli"].ok("rollback", "--name", NAME)  # no canary: re-deploys revision 1's settings as revision 3
    st = rig["cli"].status(NAME)
    assert st["revisions"][-1]["id"] == 3 and split_of(st) == {3: 100.0}
    assert listed(rig) == [ALIAS]
    assert ask(rig, ALIAS).status_code == 200 and ask(rig, NEW).status_code == 404
