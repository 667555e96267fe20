"""tensor_parallel 2 through the real engine process: `python -m llmdeploy.engine --tensor-parallel 2` on CPU
(two gloo ranks) answers greedy requests token for token as transformers does, and the replica lives and dies
as one: SIGTERM drains and stops both ranks, kill -9 of either rank leaves nothing running."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from llmdeploy.engine.token_texts import TokenTexts
from tests.engine.test_engine_parity import _hf_models, hf_greedy, prompts
from tests.helpers.procs import ServerProcess, free_port

ALIAS = "tiny-tp"
MAX_NEW = 16


def start_tp_engine(model: Path, log_path: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "llmdeploy.engine", "--model", str(model), "--served-alias", ALIAS, "--port", str(port)]
    args += ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-gb", "0.01"]
    args += ["--max-num-batched-tokens", "64", "--tensor-parallel", "2", "--drain-timeout", "5"]
    return ServerProcess(args, f"{url}/health", log_path).start(), url


def proc_state(pid: int) -> str | None:
    """The /proc state letter of `pid` (Z: exited, not yet reaped), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def running(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_pids(engine: ServerProcess) -> list[int]:
    """Ranks 1.. of the engine: its `llmdeploy.engine.parallel.worker` children."""
    pids = []
    for pid in children(engine.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"llmdeploy.engine.parallel.worker" in cmdline:
            pids.append(pid)
    return pids


def wait_until(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": ALIAS, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]


def hf_chosen_logprobs(path: Path, prompt: list[int], continuation: list[int]) -> list[float]:
    """transformers' log-probability of each continuation token, from one forward over prompt + continuation."""
    model = _hf_models[str(path)]  # loaded by hf_greedy
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(continuation)[:, None])[:, 0].tolist()


def assert_same_tokens(path: Path, prompt: list[int], ours: dict) -> None:
    """The legacy logprobs carry each token's text, not its id: the texts must be transformers' tokens' texts,
    and each one's logprob transformers' logprob of its token (two ids with one text, say two invalid UTF-8
    bytes, would not also share the logprob), so the ids are the same."""
    theirs = hf_greedy(path, prompt, MAX_NEW)
    texts = TokenTexts(AutoTokenizer.from_pretrained(path))
    assert ours["tokens"] == [texts.get(t)[0] for t in theirs], f"prompt of {len(prompt)} tokens"
    expected = hf_chosen_logprobs(path, prompt, theirs)
    assert ours["token_logprobs"] == pytest.approx(expected, abs=1e-3)


def test_greedy_over_http_matches_transformers_and_sigterm_stops_both_ranks(tiny_llama, tmp_path):
    engine, url = start_tp_engine(tiny_llama, tmp_path / "engine.log")
    try:
        (rank1,) = rank_pids(engine)
        assert "tensor parallel: 2 ranks (gloo, float32)" in engine.logs()
        for prompt in prompts(4, seed=5, lo=3, hi=60):
            assert_same_tokens(tiny_llama, prompt, complete(url, prompt))
    finally:
        code = engine.stop(signal.SIGTERM, timeout_s=60)
    assert code == 0, engine.logs()
    assert wait_until(lambda: not running(rank1), 10), "rank 1 outlived the drained engine"


@pytest.mark.parametrize("victim", ["rank 1", "rank 0"])
def test_kill_9_of_either_rank_stops_the_whole_replica(tiny_llama, tmp_path, victim):
    engine, _ = start_tp_engine(tiny_llama, tmp_path / "engine.log")
    try:
        (rank1,) = rank_pids(engine)
        os.kill(rank1 if victim == "rank 1" else engine.proc.pid, signal.SIGKILL)
        try:
            code = engine.proc.wait(30)
        except Exception:
            pytest.fail(f"the engine kept running without {victim}:\n{engine.logs()}")
        assert code != 0
        assert wait_until(lambda: not running(rank1), 10), "rank 1 outlived its engine"
        if victim == "rank 1":
            assert "rank 1" in engine.logs() and "the engine stops" in engine.logs()
    finally:
        engine.stop(signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.full  # CI's time budget; the engine-level kill -9 tests above cover a rank's crash
def test_a_deployment_with_tensor_parallel_restarts_the_replica_when_rank_1_dies(tiny_llama, tmp_path):
    """Through the real CLI and daemon: apply starts rank 0 with --tensor-parallel 2, requests go through the
    router, kill -9 of rank 1 makes the supervisor restart the whole replica, and `down` leaves no rank."""
    from tests.control.conftest import Cli, base_spec, send_many, wait_for, write_spec

    cli = Cli(tmp_path / "home")
    spec = base_spec("tp", tiny_llama, parallel={"tensor_parallel": 2})
    spec["model"]["dtype"] = "float32"
    url = f"http://{spec['listen']}"
    try:
        cli.ok("apply", str(write_spec(tmp_path / "tp.yaml", spec)))
        (replica,) = cli.status("tp")["replicas"]
        rank0 = replica["pid"]
        (rank1,) = [p for p in children(rank0) if running(p)]
        assert {r.status_code for r in send_many(url, [None] * 4, concurrency=2)} == {200}
        os.kill(rank1, signal.SIGKILL)

        def restarted() -> dict | None:
            (r,) = cli.status("tp")["replicas"]
            return r if r["ready"] and r["pid"] != rank0 and r["restarts"] == 1 else None

        new = wait_for(restarted, 180, 0.5, "the replica to be restarted")
        assert not running(rank0) and not running(rank1)
        new_ranks = [p for p in children(new["pid"]) if running(p)]
        assert len(new_ranks) == 1
        assert {r.status_code for r in send_many(url, [None] * 4, concurrency=2)} == {200}
        cli.ok("down", "--name", "tp", timeout=120)
        assert wait_until(lambda: not running(new["pid"]) and not running(new_ranks[0]), 30)
    finally:
        cli.cleanup("tp")
