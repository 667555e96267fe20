"""Spec diff classification: what `apply` does with each kind of change (pure)."""

from __future__ import annotations

import pytest

from llmdeploy.control.diff import diff_specs
from llmdeploy.spec.models import DeploymentSpec

BASE = {"name": "chat", "model": {"path": "/m", "served_alias": "a"}, "auth": {"api_key_required": False}}


def spec(**over) -> DeploymentSpec:
    data = {**BASE}
    for dotted, value in over.items():
        node = data
        *parents, leaf = dotted.split("__")
        for p in parents:
            node[p] = dict(node.get(p, {}))
            node = node[p]
        node[leaf] = value
    return DeploymentSpec.model_validate(data)


def test_nothing_applied_yet_is_a_new_deployment():
    d = diff_specs(None, spec())
    assert d.created and d.new_revision and not d.unchanged
    assert d.summary() == "new deployment"


def test_same_spec_and_spelled_out_defaults_are_unchanged():
    explicit = spec(engine__block_size=16, rollout__canary_percent=0, logging__level="info")
    d = diff_specs(spec(), explicit)
    assert d.unchanged and d.changes == () and d.summary() == "unchanged"


def test_a_stored_dict_compares_like_a_fresh_spec():
    assert diff_specs(spec().model_dump(mode="json"), spec()).unchanged


@pytest.mark.parametrize(
    "key, value",
    [
        ("auth__api_key_required", True),
        ("routing__burst__local_rps", 5.0),
        ("sla__ttft_p99_ms", 250.0),
        ("cloud__timeout_s", 10.0),
        ("rollout__canary_percent", 20.0),
        ("rollout__auto_rollback__min_requests", 3),
        ("logging__level", "debug"),
    ],
)
def test_router_settings_hot_reload(key, value):
    d = diff_specs(spec(), spec(**{key: value}))
    assert d.kinds == {"hot-reload"} and d.hot_reload and not d.new_revision and not d.restart
    assert [c.path for c in d.changes] == [key.replace("__", ".")]


@pytest.mark.parametrize(
    "key, value",
    [
        ("model__path", "/other"),
        ("model__served_alias", "b"),
        ("model__max_model_len", 512),
        ("engine__max_num_seqs", 8),
        ("engine__prefix_caching", False),
        ("parallel__replicas", 2),
    ],
)
def test_engine_settings_make_a_new_revision(key, value):
    d = diff_specs(spec(), spec(**{key: value}))
    assert d.kinds == {"new-revision"} and d.new_revision and not d.hot_reload


@pytest.mark.parametrize(
    "key, value", [("listen", "127.0.0.1:9000"), ("tls__cert_file", "/c"), ("name", "other")]
)
def test_listen_tls_name_need_a_restart(key, value):
    over = {key: value, "tls__key_file": "/k"} if key.startswith("tls") else {key: value}
    d = diff_specs(spec(), spec(**over))
    assert d.restart and d.kinds == {"restart"}


def test_mixed_changes_report_each_kind_and_old_new_values():
    d = diff_specs(spec(), spec(engine__max_num_seqs=8, sla__ttft_p99_ms=300.0))
    assert d.kinds == {"new-revision", "hot-reload"}
    assert d.summary() == "new revision, hot reload"
    change = next(c for c in d.changes if c.path == "engine.max_num_seqs")
    assert (change.old, change.new, change.kind) == (64, 8, "new-revision")
    lines = d.lines()
    assert "- engine.max_num_seqs: 64" in lines and "+ engine.max_num_seqs: 8    (new-revision)" in lines
    assert d.to_json()["changes"][0]["path"] in ("engine.max_num_seqs", "sla.ttft_p99_ms")
