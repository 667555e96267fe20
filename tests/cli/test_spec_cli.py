"""`llmdeploy validate / plan / schema`: output and exit codes, through typer's runner and the installed script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmdeploy import __version__
from llmdeploy.cli.main import app
from tests.spec.test_estimate import fake_model

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "llmdeploy.yaml.example"
SCRIPT = Path(sys.executable).parent / "llmdeploy"
POSITION = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<path>[\w.\[\]]+): (?P<msg>.+)$")
SECRET = "sk-test-DO-NOT-PRINT-4242"

BAD = """\
name: chat
listen: 0.0.0.0:8000
auth:
  api_key_required: false
engine:
  blok_size: 32
sla:
  ttft_p99_ms: ${SLA_TTFT_UNSET}
"""


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env={"LLMDEPLOY_API_KEY": SECRET, **(env or {})})


@pytest.fixture
def bad_yaml(tmp_path) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(BAD)
    return p


@pytest.fixture
def small_spec(tmp_path) -> Path:
    """A valid spec over a config-only model folder on CPU: plan needs no torch import and no weights."""
    fake_model(tmp_path / "model")
    p = tmp_path / "small.yaml"
    p.write_text(
        "model:\n  path: model\n  max_model_len: 1024\n  dtype: bfloat16\n"
        "engine:\n  device: cpu\n  kv_cache_gb: 0.25\n"
        "auth:\n  keys: [{name: app, key_env: LLMDEPLOY_API_KEY}]\n"
    )
    return p


def test_validate_example_prints_a_summary_and_exits_0():
    r = invoke("validate", str(EXAMPLE))
    assert r.exit_code == 0, r.output
    for fragment in (
        "builtin:smollm2-135m-instruct",
        "chat-model-v1",
        "127.0.0.1:8000",
        "LLMDEPLOY_API_KEY",
        "TTFT p99 1000 ms",
    ):
        assert fragment in r.stdout
    assert "cloud" in r.stdout and "off" in r.stdout
    assert r.stdout.rstrip().endswith(f"{EXAMPLE}: valid")
    assert SECRET not in r.output


def test_validate_warns_about_an_unset_key_and_still_exits_0():
    r = CliRunner().invoke(app, ["validate", str(EXAMPLE)], env={"LLMDEPLOY_API_KEY": None})
    assert r.exit_code == 0
    assert (
        f"{EXAMPLE}:" in r.stderr
        and "warning: auth.keys[0].key_env" in r.stderr
        and "generate a key" in r.stderr
    )


def test_validate_invalid_prints_every_error_on_its_own_line_and_exits_2(bad_yaml):
    r = invoke("validate", str(bad_yaml))
    assert r.exit_code == 2
    lines = r.stdout.splitlines()
    parsed = [POSITION.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m["line"], m["path"]) for m in parsed] == [
        ("2", "listen"),
        ("6", "engine.blok_size"),
        ("8", "sla.ttft_p99_ms"),
    ]
    assert "did you mean 'block_size'?" in lines[1] and "SLA_TTFT_UNSET" in lines[2]
    assert all(m["file"] == str(bad_yaml) for m in parsed)
    assert "3 errors" in r.stderr


def test_validate_missing_file_is_one_line_and_exits_1(tmp_path):
    r = invoke("validate", str(tmp_path / "nope.yaml"))
    assert r.exit_code == 1
    assert r.stdout == "" and r.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope.yaml'}: no such file"
    ]


def test_yaml_syntax_error_exits_2_with_position(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: chat\nmodel:\n  path: [unclosed\n")
    r = invoke("validate", str(p))
    assert r.exit_code == 2 and r.stdout.startswith(f"{p}:4:1: YAML syntax error")


def test_schema_is_json_with_the_top_level_keys():
    r = invoke("schema")
    assert r.exit_code == 0
    schema = json.loads(r.stdout)
    assert schema["title"] == "llmdeploy.yaml" and schema["additionalProperties"] is False
    for key in (
        "name",
        "model",
        "listen",
        "tls",
        "logging",
        "auth",
        "parallel",
        "engine",
        "sla",
        "cloud",
        "routing",
        "rollout",
    ):
        assert key in schema["properties"]
    assert schema["$defs"]["EngineSpec"]["additionalProperties"] is False


def test_plan_prints_the_normalised_spec_and_the_estimate(small_spec):
    r = invoke("plan", str(small_spec))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert (
        "served_alias: chat-model-v1" in out and "max_num_batched_tokens: 2048" in out
    )  # defaults filled in
    assert f"path: {small_spec.parent / 'model'}" in out  # made absolute
    per_token = 2 * 4 * 2 * 32 * 2
    blocks = (1 << 28) // (per_token * 16)
    assert f"{per_token:,} B" in out
    assert f"{blocks * 16:,} tokens = {blocks * 16 // 1024:,} sequences of max_model_len 1024" in out
    assert "weights memory" in out and "none applied yet" in out  # this name was never applied here
    assert f"= {blocks * 16 // 768:,} concurrent sequences of 512 + 256 tokens (average)" in out
    assert SECRET not in r.output


def test_plan_of_an_invalid_spec_exits_2(bad_yaml):
    r = invoke("plan", str(bad_yaml))
    assert r.exit_code == 2 and POSITION.match(r.stdout.splitlines()[0])


def test_render_plan_shows_a_diff_when_given():
    from rich.console import Console

    from llmdeploy.cli.cmd_spec import render_plan
    from llmdeploy.spec import DeploymentSpec

    console = Console(record=True, width=120)
    console.print(render_plan(DeploymentSpec(), diff=["- parallel.replicas: 1", "+ parallel.replicas: 2"]))
    text = console.export_text()
    assert "+ parallel.replicas: 2" in text and "none applied yet" not in text


def test_version_and_help_with_examples():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"llmdeploy {__version__}"
    for command in ("validate", "plan", "schema"):
        r = invoke(command, "--help")
        assert r.exit_code == 0 and "Examples" in r.stdout and f"llmdeploy {command}" in r.stdout


def run_script(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMDEPLOY_API_KEY": SECRET, "COLUMNS": "100"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_installed_script_exit_codes(tmp_path, bad_yaml):
    assert SCRIPT.is_file(), "the console script is installed with pip install -e ."
    ok = run_script("validate", "llmdeploy.yaml.example")
    assert (
        ok.returncode == 0
        and "llmdeploy.yaml.example: valid" in ok.stdout
        and SECRET not in ok.stdout + ok.stderr
    )
    bad = run_script("validate", "bad.yaml", cwd=bad_yaml.parent)
    assert bad.returncode == 2 and bad.stdout.splitlines()[0].startswith(
        "bad.yaml:2:1: listen: listen address 0.0.0.0:8000"
    )
    missing = run_script("validate", str(tmp_path / "gone.yaml"))
    assert (
        missing.returncode == 1 and missing.stderr.strip() == f"error: {tmp_path / 'gone.yaml'}: no such file"
    )
    schema = run_script("schema")
    assert schema.returncode == 0 and "cloud" in json.loads(schema.stdout)["properties"]


@pytest.mark.slow
@pytest.mark.full  # CI's time budget: scripts/test.sh -m full
def test_plan_of_the_example_estimates_the_builtin_model():
    r = run_script("plan", "llmdeploy.yaml.example")
    assert r.returncode == 0, r.stderr
    assert "llama: 30 layers, 9 heads (3 KV), head_dim 64" in r.stdout and "KV capacity" in r.stdout
