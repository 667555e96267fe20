"""bench/multi_turn.py: its workload and figures (pure), and one short run through a real 2-replica deployment
of the tiny random model (the `llmdeploy apply` path, the router's access log, `down`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.multi_turn import (
    Turn,
    build_conversations,
    hit_rate,
    messages_for,
    parse_access_log,
    ratios,
    split,
    stickiness,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]


def test_conversations_own_prefixes_and_one_hot_prefix():
    convs = build_conversations(3, 2, turns=4, system_words=50, opening_words=20, followup_words=5, seed=1)
    assert [c.group for c in convs] == ["hot", "hot", "own", "own", "own"]  # the hot burst starts first
    assert len({c.cid for c in convs}) == 5
    hot, own = convs[:2], convs[2:]
    assert hot[0].system == hot[1].system and hot[0].opening == hot[1].opening
    assert hot[0].followups != hot[1].followups  # the same opening, then each its own questions
    assert len({(c.system, c.opening) for c in own}) == 3
    assert all(len(c.followups) == 3 for c in convs)
    assert all(len(c.system.split()) > 50 for c in convs)
    again = build_conversations(3, 2, turns=4, system_words=50, opening_words=20, followup_words=5, seed=1)
    assert again == convs


def test_each_turn_resends_the_history_with_the_answers():
    conv = build_conversations(1, 0, turns=3, system_words=5, opening_words=5, followup_words=2)[0]
    first = messages_for(conv, 1, [])
    assert [m["role"] for m in first] == ["system", "user"]
    third = messages_for(conv, 3, ["A1", "A2"])
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third[:2] == first  # the prefix the router keys on and the engine caches stays put
    assert [third[2]["content"], third[4]["content"]] == ["A1", "A2"]
    assert third[5]["content"] == conv.followups[1]
    with pytest.raises(ValueError, match="earlier answers"):
        messages_for(conv, 3, ["A1"])


def _turn(cid: str, turn: int, replica: str | None, prompt: int = 100, cached: int = 0, **kw) -> Turn:
    return Turn(
        f"{cid}-t{turn}",
        cid,
        kw.get("group", "own"),
        turn,
        ok=kw.get("ok", True),
        prompt_tokens=prompt,
        cached_tokens=cached,
        replica=replica,
        ttft_s=0.1,
    )


def test_hit_rate_stickiness_and_split():
    turns = [
        _turn("a", 1, "r1", 100, 0),
        _turn("a", 2, "r1", 200, 96),
        _turn("b", 1, "r2", 100, 0, group="hot"),
        _turn("b", 2, "r1", 200, 0, group="hot"),
        _turn("c", 1, "r2", 100, 0),
        _turn("c", 2, None, 300, 300, ok=False),  # a failed turn counts in neither hit rate nor split
    ]
    assert hit_rate(turns) == pytest.approx(96 / 700)
    assert hit_rate([]) is None
    assert stickiness(turns) == (2, 3)  # a and c (its one served turn) stayed; b moved
    assert split(turns) == {"r1": 3, "r2": 2}
    s = summarize("prefix", turns, wall_s=1.0)
    assert (s["requests"], s["errors"]) == (6, 1)
    assert s["hit_rate_followups"] == pytest.approx(96 / 400)
    assert s["hit_rate_first_turns"] == 0
    assert s["sticky_own"] == [2, 2] and s["sticky_hot"] == [0, 1]
    assert s["hot_split"] == {"r1": 1, "r2": 1}
    other = {**s, "hit_rate": s["hit_rate"] / 2, "ttft_p50_s": 0.2}
    q = ratios(s, other)
    assert q["hit_rate"] == pytest.approx(2.0) and q["ttft_p50_s"] == pytest.approx(0.5)


def test_access_log_names_each_requests_replica():
    log = (
        "2026-12-02 13:29:23,730 INFO llmdeploy.router.backends: engine http://127.0.0.1:45507 is up\n"
        "2026-12-02 13:29:26,127 INFO llmdeploy.router.access: rid=mt-prefix-own0-t1 key=anonymous "
        "method=POST path=/v1/chat/completions status=200 backend=local revision=1 replica=r1 stream=true\n"
        "2026-12-02 13:29:27,001 INFO llmdeploy.router.access: rid=mt-prefix-own0-t2 key=anonymous "
        "method=POST path=/v1/chat/completions status=503 backend=none revision=none replica=- stream=true\n"
    )
    assert parse_access_log(log) == {"mt-prefix-own0-t1": "r1", "mt-prefix-own0-t2": "-"}


@pytest.mark.slow  # two engines and a router (~15-30 s on the 2-core machine)
def test_a_short_run_through_two_replicas(tiny_llama, tmp_path):
    """One mode (prefix), a handful of turns: the whole path works, and with the load bound out of the way
    (prefix_load_slack 10) every conversation stays on its replica and its second turn hits the cache."""
    out = tmp_path / "mt.json"
    args = [
        "--model",
        str(tiny_llama),
        "--max-model-len",
        "1024",
        "--modes",
        "prefix",
        "--conversations",
        "3",
    ]
    args += ["--hot", "1", "--turns", "2", "--system-words", "30", "--opening-words", "10"]
    args += ["--followup-words", "4", "--max-tokens", "4", "--think-s", "0", "--kv-cache-gb", "0.02"]
    args += ["--concurrency", "2", "--slack", "10"]  # a bound that never binds: every conversation stays home
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "multi_turn.py"), *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| prefix | 8 | 0 |" in proc.stdout
    run = json.loads(out.read_text())["runs"][0]
    assert all(t["replica"] in ("r1", "r2") for t in run["turns"])
    assert run["sticky_own"] == [3, 3]
    assert sum(run["split"].values()) == 8
    assert run["hit_rate_followups"] > 0  # the second turns found their first turns' blocks
