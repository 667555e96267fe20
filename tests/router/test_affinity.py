"""Cache-aware replica choice through the real router with two fake engines (real processes, real HTTP)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from tests.helpers.fake_cloud import FakeCloud
from tests.router.conftest import ALIAS, client, make_spec, wait_until

IDLE = {
    "waiting": 0,
    "running": 0,
    "free_blocks": 1000,
    "total_blocks": 1024,
    "block_size": 16,
    "prefill_tokens_per_s": 10000.0,
    "max_num_seqs": 64,
    "ready": True,
}


@pytest.fixture(scope="module")
def engine_pair(tmp_path_factory):
    pair = [FakeCloud(tmp_path_factory.mktemp(f"engine{i}")).start() for i in (1, 2)]
    yield pair
    for fe in pair:
        fe.stop()


@pytest.fixture
def engines(engine_pair):
    for i, fe in enumerate(engine_pair, 1):
        fe.reset()
        fe.control(reply=f"engine {i}", load=IDLE)
    return engine_pair


def conversation(n: int, turns: int) -> dict:
    messages = [
        {"role": "system", "content": "You answer questions about the attached report."},
        {"role": "user", "content": f"Report {n}: " + "figures and findings " * 40},
    ]
    for t in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"Answer {t} about report {n}."},
            {"role": "user", "content": f"Follow-up question {t}?"},
        ]
    return {"model": ALIAS, "messages": messages, "max_tokens": 8}


def served_by(engines: list[FakeCloud]) -> dict[str, int]:
    """Which engine served each conversation: report number -> engine index."""
    where: dict[str, set[int]] = {}
    for i, fe in enumerate(engines):
        for req in fe.requests():
            if req["path"].endswith("/chat/completions"):
                report = req["body"]["messages"][1]["content"].split(":")[0]
                where.setdefault(report, set()).add(i)
    assert all(len(s) == 1 for s in where.values()), where  # every turn of a conversation on one engine
    return {k: next(iter(s)) for k, s in where.items()}


def ask(c, body: dict) -> None:
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmdeploy-backend"] == "local"


def test_each_conversation_stays_on_one_engine_and_conversations_spread(engines, start_router):
    rs = start_router(make_spec(), [fe.base for fe in engines])
    with client(rs) as c:
        for turn in range(1, 4):
            for n in range(12):
                ask(c, conversation(n, turn))
    homes = served_by(engines)
    assert len(homes) == 12
    assert set(homes.values()) == {0, 1}


def test_least_loaded_mode_lets_a_conversation_wander(engines, start_router):
    """The baseline the bench compares against: the same turns, no affinity, land on both engines."""
    rs = start_router(make_spec(routing={"replica_choice": "least_loaded"}), [fe.base for fe in engines])
    body = conversation(0, 1)
    with client(rs) as c, cf.ThreadPoolExecutor(4) as pool:
        engines[0].control(delay_s=0.3)
        engines[1].control(delay_s=0.3)
        list(pool.map(lambda _: ask(c, body), range(8)))
    assert all(fe.stats()["requests"] >= 2 for fe in engines)


def test_a_hot_prefix_spreads_over_both_engines_under_load(engines, start_router):
    """Concurrent requests with one system prompt and opening: the home engine takes its share up to the load
    bound and the rest go to the other one; nothing fails."""
    rs = start_router(make_spec(), [fe.base for fe in engines])
    for fe in engines:
        fe.control(delay_s=1.0)
    body = conversation(7, 1)
    with client(rs) as c, cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: ask(c, body), range(16)))
    counts = [fe.stats()["requests"] for fe in engines]
    assert sum(counts) == 16 and min(counts) >= 5, counts


def test_a_conversation_whose_engine_goes_down_moves_to_the_other_and_back(engines, start_router):
    rs = start_router(make_spec(), [fe.base for fe in engines])
    with client(rs) as c:
        for n in range(8):
            ask(c, conversation(n, 1))
        homes = served_by(engines)
        gone = homes["Report 0"]
        for fe in engines:
            fe.reset()  # clears what arrived (and the load: set after it)
        engines[gone].control(load={**IDLE, "ready": False})
        assert wait_until(lambda: not _usable(rs, engines[gone]))
        for n in range(8):
            ask(c, conversation(n, 2))
        assert engines[gone].stats()["requests"] == 0  # every conversation on the engine still up
        for fe in engines:
            fe.reset()
            fe.control(load=IDLE)
        assert wait_until(lambda: _usable(rs, engines[gone]))
        for n in range(8):
            ask(c, conversation(n, 3))
    assert served_by(engines) == homes  # back home once it is up again


def _usable(rs, fe: FakeCloud) -> bool:
    return any(
        r.usable and r.url == fe.base
        for rev in rs.router.pool.revision_states(time.monotonic())
        for r in rev.replicas
    )
