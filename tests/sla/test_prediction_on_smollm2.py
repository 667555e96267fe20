"""The engine's TTFT prediction against what it then measures, on the embedded SmolLM2 (issue 12: within 25% over
a sweep of prompt lengths). Idle engine, one request at a time, fresh prompts (no prefix-cache hits); the median
of three measurements against the fitted (not the conservative) prediction made just before each."""

from __future__ import annotations

import random
import statistics

import httpx
import pytest

from llmdeploy.openai_api.headers import ENGINE_TTFT_HEADER
from llmdeploy.policies.overflow import interpolate
from llmdeploy.policies.snapshot import EngineLoad
from tests.helpers.procs import ServerProcess, free_port

# full: a minute of SmolLM2 over CI's time budget; tests/router/test_sla_loop.py judges the predictions on the
# tiny model in CI. This one needs a quiet machine (it measures TTFT): scripts/test.sh -m full
pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(1500)]
ALIAS = "smollm2"
LENGTHS = (16, 64, 128, 256, 512, 900)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "llmdeploy.engine", "--model", "builtin:smollm2-135m-instruct", "--served-alias", ALIAS]
    args += ["--port", str(port), "--max-model-len", "1024", "--kv-cache-gb", "0.2", "--max-num-seqs", "8"]
    log_path = tmp_path_factory.mktemp("smollm2-sla") / "engine.log"
    with ServerProcess(args, f"{url}/health", log_path, timeout_s=900) as proc:
        yield url
        proc.logs()


def fitted_ms(url: str, n: int) -> float:
    load = EngineLoad.from_json(httpx.get(f"{url}/load", timeout=30).json())
    assert load.step_cost is not None and load.waiting == 0 and load.running == 0
    return interpolate(load.ttft_ms_by_prompt_len, n) / (1 + min(load.step_cost.margin, 1.0))


def measured_ms(url: str, n: int, rng: random.Random) -> float:
    body = {"model": ALIAS, "prompt": [rng.randrange(100, 40000) for _ in range(n)], "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return float(r.headers[ENGINE_TTFT_HEADER])


def test_predicted_ttft_is_within_25_percent_of_measured(url):
    rng = random.Random(0)
    for n in (32, 300, 32):  # the first steps of a fresh process are slower than the rest: not judged
        measured_ms(url, n, rng)
    rows = []
    for n in LENGTHS:
        predicted = [fitted_ms(url, n)]
        measured = []
        for _ in range(3):
            measured.append(measured_ms(url, n, rng))
            predicted.append(fitted_ms(url, n))
        rows.append((n, statistics.median(predicted), statistics.median(measured)))
    off = [(n, round(p, 1), round(m, 1)) for n, p, m in rows if abs(p - m) > 0.25 * m]
    assert not off, f"prediction off by more than 25% (tokens, predicted ms, measured ms): {off}; all: {rows}"
