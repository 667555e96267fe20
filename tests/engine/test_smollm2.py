"""The embedded SmolLM2-135M-Instruct behind a real engine server answers like a real model does."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.procs import ServerProcess, free_port

# full: the same model's greedy parity (tests/engine/test_models.py) and its HTTP serving (tests/sla,
# tests/guided/test_readme_examples.py) run in CI; this end-to-end check runs with scripts/test.sh -m full
pytestmark = [pytest.mark.slow, pytest.mark.full]
ALIAS = "smollm2"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "llmdeploy.engine",
        "--model",
        "builtin:smollm2-135m-instruct",
        "--served-alias",
        ALIAS,
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--kv-cache-gb",
        "0.1",
        "--max-num-seqs",
        "4",
    ]
    log_path = tmp_path_factory.mktemp("smollm2") / "engine.log"
    with ServerProcess(args, f"{url}/health", log_path, timeout_s=600) as proc:
        yield url
        logs = proc.logs()
    assert "listening on" in logs and "KV cache" in logs
    assert "capital of France" not in logs  # prompts are not logged unless --log-bodies


def test_capital_of_france(url):
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 32,
    }
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]


def test_capital_of_france_streamed(url):
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 32,
        "stream": True,
    }
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["delta"].get("content", "") if choices else ""
    assert "Paris" in text
