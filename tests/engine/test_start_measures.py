"""What a CPU engine measures at start (attention probe, step-cost calibration) is kept on disk and read back by the
next start of the same engine on the same machine (engine/start_measures.py): real runners on the tiny model."""

from __future__ import annotations

import json
import logging
import os

import pytest

from llmdeploy.engine import attn_probe, kept_files, start_measures
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.model_runner import ModelRunner


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
    folder = tmp_path / "measures"
    monkeypatch.setattr(start_measures, "measures_dir", lambda: folder)
    return folder


@pytest.fixture
def steps(monkeypatch):
    """Every step a runner runs, as (prefill tokens, decoding sequences)."""
    seen: list[tuple[int, int]] = []
    real_run = ModelRunner.run

    def run(self, batch, **kw):
        seen.append((sum(n for _, n in batch.prefills), len(batch.decodes)))
        return real_run(self, batch, **kw)

    monkeypatch.setattr(ModelRunner, "run", run)
    return seen


def config(model, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model), max_model_len=1024, kv_cache_gb=0.05, **overrides)


def probe_steps(seen: list[tuple[int, int]]) -> int:
    return sum(1 for prefill, _ in seen if prefill == attn_probe.PROBE_TOKENS)


def test_a_second_start_reads_what_the_first_measured(tiny_llama, kept_in, steps, caplog):
    caplog.set_level(logging.INFO, logger="llmdeploy.engine")
    first = ModelRunner(config(tiny_llama))
    measured = len(steps)
    assert probe_steps(steps) == 6  # twice each: setup, at context 0, late
    (kept,) = kept_in.glob("*.json")
    assert json.loads(kept.read_text())["attn_how"] == "timed at start"

    steps.clear()
    second = ModelRunner(config(tiny_llama))
    assert probe_steps(steps) == 0
    # the warm-up still runs its prefill and both decode widths once (one-time setup), then the first touch
    assert steps == [(256, 0), (0, 1), (0, 8), (16, 0)]
    assert len(steps) < measured / 2
    assert second.attn_cost_context == pytest.approx(first.attn_cost_context)
    assert second.calibration == first.calibration and len(second.calibration) == 4
    assert any("kept from an earlier start" in r.getMessage() for r in caplog.records)
    assert list(kept_in.glob("*.json")) == [kept]


def test_a_changed_option_or_model_file_is_measured_again(tiny_model, kept_in, steps):
    model = tiny_model(num_hidden_layers=1)
    ModelRunner(config(model))
    ModelRunner(config(model, max_num_seqs=16))
    assert probe_steps(steps) == 12 and len(list(kept_in.glob("*.json"))) == 2
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new download in the same place
    steps.clear()
    ModelRunner(config(model))
    assert probe_steps(steps) == 6 and len(list(kept_in.glob("*.json"))) == 3


def test_a_kernel_switch_is_part_of_the_key_and_a_replicas_owner_tag_is_not(tiny_llama, kept_in, monkeypatch):
    cfg = config(tiny_llama)
    runner = ModelRunner(cfg)
    source = runner.loaded.source
    before = start_measures.measures_path(cfg, source, runner.dtype, runner.max_model_len)
    monkeypatch.setenv("LLMDEPLOY_TILE_AHEAD_ROWS", "8")
    assert start_measures.measures_path(cfg, source, runner.dtype, runner.max_model_len) != before
    with_switch = start_measures.measures_path(cfg, source, runner.dtype, runner.max_model_len)
    # never read: a secret, and what the daemon sets per replica (its revisions and replicas share measures)
    monkeypatch.setenv("LLMDEPLOY_ENGINE_TOKEN", "s3cret-token")
    monkeypatch.setenv("LLMDEPLOY_ENGINE_OWNER", "/home/x/.llmdeploy/chat#2/r3")
    monkeypatch.setenv("LLMDEPLOY_HOME", str(kept_in.parent / "home"))
    monkeypatch.setenv("LLMDEPLOY_CACHE_DIR", str(kept_in.parent / "elsewhere"))
    assert start_measures.measures_path(cfg, source, runner.dtype, runner.max_model_len) == with_switch
    switches = start_measures.kernel_switches()
    assert switches["LLMDEPLOY_TILE_AHEAD_ROWS"] == "8"
    assert not {
        "LLMDEPLOY_ENGINE_TOKEN",
        "LLMDEPLOY_ENGINE_OWNER",
        "LLMDEPLOY_HOME",
        "LLMDEPLOY_CACHE_DIR",
    } & set(switches)


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{not json",
        '{"attn_cost_context": 900.0}',
        '{"attn_cost_context": null, "attn_how": "x", "calibration": []}',
        '{"attn_cost_context": NaN, "attn_how": "x", "calibration": [[1, 0, 0.5]]}',
        '{"attn_cost_context": 900, "attn_how": "x", "calibration": [[1, 0, -0.5]]}',
        '{"attn_cost_context": 900, "attn_how": "x", "calibration": [[1, 0]]}',
    ],
)
def test_a_broken_file_is_measured_again_and_rewritten(tiny_llama, kept_in, steps, caplog, content):
    cfg = config(tiny_llama, max_num_batched_tokens=512)
    ModelRunner(cfg)
    (kept,) = kept_in.glob("*.json")
    good = json.loads(kept.read_text())
    kept.write_text(content)
    steps.clear()
    runner = ModelRunner(cfg)
    assert probe_steps(steps) == 6
    assert len(runner.calibration) == 4 and all(p.seconds > 0 for p in runner.calibration)
    assert json.loads(kept.read_text()).keys() == good.keys()


def test_an_unwritable_folder_still_starts(tiny_llama, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(start_measures, "measures_dir", lambda: blocker / "measures")
    caplog.set_level(logging.WARNING, logger="llmdeploy.engine")
    runner = ModelRunner(config(tiny_llama))
    assert len(runner.calibration) == 4
    assert any("not kept in" in r.getMessage() for r in caplog.records)
    assert list(tmp_path.iterdir()) == [blocker]  # no temporary file left behind


def test_only_the_newest_files_are_kept(tmp_path):
    for i in range(5):
        f = tmp_path / f"{i}.json"
        f.write_text("{}")
        os.utime(f, ns=(i * 10**9, i * 10**9))
    kept_files.prune(tmp_path, keep=3)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["2.json", "3.json", "4.json"]
