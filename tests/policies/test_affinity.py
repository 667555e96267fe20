"""Cache-aware replica choice (policies/affinity.py) and the router's prefix key, as pure functions."""

from __future__ import annotations

from collections import Counter

from llmdeploy.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from llmdeploy.policies import affinity
from llmdeploy.policies import overflow as ov
from llmdeploy.policies.affinity import ReplicaChoice
from llmdeploy.policies.egress import CloudState
from llmdeploy.policies.route import LOCAL, decide
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState, RequestFacts, RevisionState
from llmdeploy.router.requests import prefix_key

IDLE = EngineLoad(free_blocks=1000, total_blocks=1024, prefill_tokens_per_s=1000.0, max_num_seqs=64)
LIMITS = ov.OverflowLimits(ttft_p99_ms=1000, max_queue_depth=8)
CLOUD_UP = CloudState(enabled=True, breaker_allows=True)
NAMES = ("r1", "r2", "r3", "r4")


def replica(name: str, inflight: int = 0, **kw) -> ReplicaState:
    return ReplicaState(url=f"http://{name}", replica=name, revision=1, load=IDLE, inflight=inflight, **kw)


def fleet(loads: dict[str, int] | None = None, down: tuple[str, ...] = ()) -> list[ReplicaState]:
    loads = loads or {}
    return [replica(n, loads.get(n, 0), listed_ready=n not in down) for n in NAMES[: max(2, len(loads))]]


def chat(*turns: tuple[str, str], system: str = "You are terse.") -> ChatCompletionRequest:
    messages = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in turns]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


def first_choice(replicas: list[ReplicaState], key: str | None, mode="prefix") -> str:
    facts = RequestFacts(prompt_tokens=20, max_tokens=16, prefix_key=key)
    d = decide(
        [RevisionState(1, "stable", 100, tuple(replicas))],
        facts,
        LIMITS,
        CLOUD_UP,
        replica_choice=ReplicaChoice(mode),
    )
    assert d.action == LOCAL
    return d.plan[0].replica.replica


# ---- the prefix key ---------------------------------------------------------------------------------------


def test_every_turn_of_a_conversation_has_the_same_key_and_other_conversations_differ():
    t1 = chat(("user", "Summarise this report: ..."))
    t2 = chat(("user", "Summarise this report: ..."), ("assistant", "It says X."), ("user", "And Y?"))
    t3 = chat(*[("user", "Summarise this report: ..."), ("assistant", "It says X."), ("user", "And Y?")] * 2)
    other = chat(("user", "Write a poem."))
    other_system = chat(("user", "Summarise this report: ..."), system="You are verbose.")
    assert prefix_key(t1) == prefix_key(t2) == prefix_key(t3)
    assert len({prefix_key(t1), prefix_key(other), prefix_key(other_system)}) == 3


def test_completion_key_is_the_first_bytes_and_holds_no_prompt_text():
    doc = "Background: " + "the quick brown fox " * 60
    a = CompletionRequest.model_validate({"model": "m", "prompt": doc + "Question one?"})
    b = CompletionRequest.model_validate({"model": "m", "prompt": doc + "Question two?"})
    c = CompletionRequest.model_validate({"model": "m", "prompt": "Another document entirely. " * 30})
    ids = CompletionRequest.model_validate({"model": "m", "prompt": list(range(300))})
    assert prefix_key(a) == prefix_key(b) != prefix_key(c)
    assert prefix_key(ids) is not None and prefix_key(ids) != prefix_key(a)
    assert "fox" not in prefix_key(a) and len(prefix_key(a)) == 32
    assert prefix_key(CompletionRequest.model_validate({"model": "m", "prompt": ""})) is None


# ---- the choice -------------------------------------------------------------------------------------------


def test_a_conversation_stays_on_one_replica_while_load_is_even():
    keys = [f"conversation-{i}" for i in range(40)]
    homes = {k: first_choice(fleet({"r1": 0, "r2": 0}), k) for k in keys}
    # each conversation's later turns land where its first did, under small load swings
    for k in keys:
        for loads in ({"r1": 1, "r2": 0}, {"r1": 0, "r2": 1}, {"r1": 3, "r2": 2}):
            assert first_choice(fleet(loads), k) == homes[k]
    # and the conversations spread over both replicas
    assert set(homes.values()) == {"r1", "r2"}


def test_least_loaded_mode_ignores_the_key():
    key = next(k for k in (f"c{i}" for i in range(50)) if first_choice(fleet(), k) == "r2")
    assert first_choice(fleet({"r1": 0, "r2": 1}), key) == "r2"
    assert first_choice(fleet({"r1": 0, "r2": 1}), key, mode="least_loaded") == "r1"


def test_a_hot_prefix_spreads_across_replicas_under_load():
    """One system prompt shared by every request: a closed loop of requests piles onto its home replica only up
    to the bound ceil(1.25 x mean), then goes to the next ones in its order."""
    for names in (NAMES[:2], NAMES):
        loads = {n: 0 for n in names}
        for placed in range(1, 41):
            chosen = first_choice([replica(n, loads[n]) for n in names], "hot-system-prompt")
            loads[chosen] += 1
            assert max(loads.values()) <= -(-1.25 * placed // len(names)), loads  # never over the bound
        home = affinity.hash_order([replica(n) for n in names], "hot-system-prompt")[0].replica
        assert loads[home] == max(loads.values())
        assert sum(1 for v in loads.values() if v >= 8) >= min(3, len(names)), loads


def test_the_bound_follows_the_slack():
    reps = fleet({"r1": 3, "r2": 0})
    assert affinity.load_bound(reps, 0.25) == 3  # ceil(1.25 x 4 / 2)
    assert affinity.load_bound(reps, 1.0) == 4
    home_r1 = next(k for k in (f"k{i}" for i in range(50)) if affinity.hash_order(reps, k)[0].replica == "r1")
    assert affinity.order(reps, home_r1, ReplicaChoice(slack=0.25))[0].replica == "r2"
    assert affinity.order(reps, home_r1, ReplicaChoice(slack=1.0))[0].replica == "r1"


def test_a_replica_down_sends_its_keys_to_the_next_in_their_order_and_only_those_move():
    keys = [f"k{i}" for i in range(60)]
    before = {k: first_choice(fleet({n: 0 for n in NAMES}), k) for k in keys}
    after = {k: first_choice(fleet({n: 0 for n in NAMES}, down=("r2",)), k) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r2"} and moved
    for k in moved:  # each to its second choice
        second = affinity.hash_order(fleet({n: 0 for n in NAMES}), k)[1].replica
        assert after[k] == second
    assert Counter(after.values()).keys() <= {"r1", "r3", "r4"}


def test_a_home_replica_that_would_miss_the_sla_is_passed_over():
    slow = EngineLoad(**{**IDLE.__dict__, "predicted_queue_wait_ms": 5000.0})
    key = next(k for k in (f"c{i}" for i in range(50)) if first_choice(fleet(), k) == "r1")
    reps = [ReplicaState("http://r1", "r1", 1, slow), replica("r2")]
    assert first_choice(reps, key) == "r2"
