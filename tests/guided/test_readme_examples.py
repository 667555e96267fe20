"""The README's structured-output and tool-call examples, run as written against the embedded SmolLM2 behind a
real engine server (only the URL and the key are this test's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.procs import ServerProcess, free_port
from tests.test_readme import REPO, fenced, section

# full: SmolLM2's start and answers, a minute over CI's time budget; the same requests run on the tiny model in
# tests/guided (structured output, tools, one shape from local and cloud): scripts/test.sh -m full
pytestmark = [pytest.mark.slow, pytest.mark.full]
EXAMPLE_URL = "http://127.0.0.1:8000/v1"


@pytest.fixture(scope="module")
def smollm2_url(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "llmdeploy.engine",
        "--model",
        "builtin:smollm2-135m-instruct",
        "--served-alias",
        "chat-model-v1",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--kv-cache-gb",
        "0.1",
        "--max-num-seqs",
        "4",
    ]
    with ServerProcess(
        args, f"{url}/health", tmp_path_factory.mktemp("readme") / "engine.log", timeout_s=600
    ):
        yield url


@pytest.mark.timeout(1500)  # SmolLM2's start and three answers on a busy 2-core machine
def test_structured_output_and_tool_call_examples_run(smollm2_url, tmp_path):
    (code,) = fenced("python", section("## Structured output and tool calls"))
    assert EXAMPLE_URL in code and 'model="chat-model-v1"' in code
    script = tmp_path / "example.py"
    script.write_text(code.replace(EXAMPLE_URL, f"{smollm2_url}/v1"))
    env = {**os.environ, "LLMDEPLOY_API_KEY": "unused-by-a-bare-engine"}
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("{'name': ") and "'age': " in lines[0]
    assert lines[1].startswith("get_weather {'city': ")
