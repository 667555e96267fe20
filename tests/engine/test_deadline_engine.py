"""Deadline-aware scheduling on a real engine (the tiny random Llama, in-process, stepped by hand).

The scheduler's clock is virtual and moves by each step's modelled time (the engine's live step-cost model), so the
order of service is checked without asserting anything about wall-clock speed."""

from __future__ import annotations

import random

import pytest

from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.prefill_limits import limits_for_cost, moved
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.policies.deadline import relative_deadline_s
from llmdeploy.policies.step_cost import StepCost, chunk_cost
from tests.engine.sim import VirtualClock

BUDGET, LONG, SHORT = 128, 300, 40
ARRIVAL_STEPS = 30  # three short prompts a step: more than the budget takes, past the long prompt's end


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    from llmdeploy.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(tiny_llama), max_model_len=1024, kv_cache_gb=0.05, max_num_batched_tokens=BUDGET, seed=0
    )
    return LLMEngine(config)


@pytest.fixture()
def engine(loaded):
    loaded.scheduler.clock = VirtualClock(1000.0)
    yield loaded
    for request_id in list(loaded.requests):
        loaded.abort(request_id)
    loaded.scheduler.__dict__.pop("schedule", None)  # watch_batches' wrapper
    loaded.scheduler.__dict__.pop("set_cost", None)


def watch_batches(sch) -> list:
    """Every batch the engine's scheduler makes, in order (the scheduler itself is untouched)."""
    batches, schedule = [], sch.schedule

    def recorded():
        batches.append(schedule())
        return batches[-1]

    sch.schedule = recorded
    return batches


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 440) for _ in range(n)]  # fresh ids: no prefix-cache hits


def test_order_of_service_follows_the_deadlines_and_neither_class_starves(engine):
    """A long prompt, then three short ones every step, enough to fill the token budget: the short ones overtake
    the long one while their deadlines are earlier; once the long one's is the earliest it goes first, and short
    ones still get theirs before it ends. Every step's first chunk belongs to the pending request due soonest."""
    rng, sch, clock = random.Random(0), engine.scheduler, engine.scheduler.clock
    # a fixed cost model: the tiny model's live fit is mostly fixed cost, which makes every prompt's own prefill
    # (and so every deadline) about the same, and how much so depends on the CPU
    sch.cost = StepCost(
        fixed_s=0.005, prefill_token_s=1e-3, decode_seq_s=1e-4, attn_cost_context=sch.cost.attn_cost_context
    )
    sch.set_cost = lambda cost: False  # the instance attribute hides the method; popped by the fixture
    batches = watch_batches(sch)
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request("long", prompt(rng, LONG), params)
    assert sch.is_long(sch.waiting[0])
    first_step: dict[str, int] = {}
    heads: list[str] = []
    for n in range(1, 150):
        if n <= ARRIVAL_STEPS:
            for i in range(3):
                engine.add_request(f"s{n}-{i}", prompt(rng, SHORT), params)
        due = {s.request_id: sch.deadline(s) for s in sch.waiting + sch.running if s.num_uncomputed > 1}
        outputs = engine.step()
        prefill = sum(
            chunk_cost(q.num_computed_tokens - k, k, sch.attn_cost_context) for q, k in batches[-1].prefills
        )
        clock.t += sch.cost.step_s(
            prefill, len(batches[-1].decodes)
        )  # virtual time: the step's modelled length
        if batches[-1].prefills:
            heads.append(batches[-1].prefills[0][0].request_id)
            assert due[heads[-1]] == min(due.values()), f"step {n}: {heads[-1]} is not the most urgent"
        for out in outputs:
            first_step.setdefault(out.request_id, n)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished() and len(first_step) == 3 * ARRIVAL_STEPS + 1
    done = first_step["long"]
    assert heads[0] != "long"  # the short ones arrived later but are due sooner
    assert "long" in heads, "the long prompt never became the most urgent: make the short ones denser"
    start = heads.index("long") + 1  # steps are numbered from 1
    # after that a short one may still go first, only when it is due sooner (checked every step above): how many
    # do depends on the live step-cost model, i.e. on the CPU
    served_meanwhile = [r for r, k in first_step.items() if r != "long" and start <= k <= done]
    assert served_meanwhile, "short requests starved while the long prompt went first"
    assert done < max(first_step.values()), "the long prompt waited for the whole stream"


def test_deadlines_come_from_the_live_step_cost_model_and_the_sla(engine):
    rng, sch = random.Random(1), engine.scheduler
    for i in range(4):  # a few real steps move the fit
        engine.add_request(f"w{i}", prompt(rng, 40), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for n in (16, LONG):
        engine.add_request(f"d{n}", prompt(rng, n), SamplingParams(max_tokens=1))
        cost = engine.cost.current()
        assert sch.cost is cost  # passed on when a request arrives (and after steps with prefill work)
        assert not moved(sch.limits, limits_for_cost(BUDGET, cost))  # the limits follow it (within 10%)
        seq = sch.waiting[-1]
        assert sch.deadline(seq) == pytest.approx(sch.clock() + relative_deadline_s(cost, n, sch.ttft_sla_s))
    engine.step()  # a step with prefill work passes the fit on too
    assert sch.cost is engine.cost.current()
    assert sch.ttft_sla_s == pytest.approx(engine.config.ttft_sla_ms / 1e3)


def test_load_reports_per_class_predictions_deadlines_and_slack(engine):
    rng, clock = random.Random(2), engine.scheduler.clock
    engine.add_request("long", prompt(rng, LONG), SamplingParams(max_tokens=2))
    engine.add_request("short", prompt(rng, SHORT), SamplingParams(max_tokens=2))
    clock.t += 10.0  # both wait past their deadlines
    load = engine.load()
    assert load["ttft_sla_ms"] == engine.config.ttft_sla_ms
    short, long = load["ttft_by_class"]["short"], load["ttft_by_class"]["long"]
    assert short["prompt_tokens"] == engine.scheduler.long_prefill_threshold < long["prompt_tokens"]
    assert short["pending"] == long["pending"] == 1 and short["late"] == long["late"] == 1
    assert long["most_urgent_slack_ms"] < 0 and short["most_urgent_slack_ms"] < 0
    assert 0 < short["predicted_ttft_ms"] < long["predicted_ttft_ms"]
    deadlines = load["deadline_ms_by_prompt_len"]
    assert [n for n, _ in deadlines] == [n for n, _ in load["ttft_ms_by_prompt_len"]]
    assert all(a[1] <= b[1] for a, b in zip(deadlines, deadlines[1:], strict=False))


def test_load_answers_when_the_fit_prices_decodes_at_zero(engine, monkeypatch):
    """A prefill-heavy stretch can pin the fit's fixed and per-sequence terms at zero (non-negative least squares);
    /load must still answer (it once raised ZeroDivisionError there, a 500 on every poll, and the router then held
    requests as if the engine were gone). Rates it cannot price are reported as 0, as prefill's already were."""
    from llmdeploy.policies.step_cost import StepCost

    free_decodes = StepCost(0.0, 1e-4, 0.0, 0.0, engine.cost.current().attn_cost_context)
    monkeypatch.setattr(engine.cost, "current", lambda: free_decodes)
    load = engine.load()
    assert load["decode_tokens_per_s"] == 0.0
    assert load["prefill_tokens_per_s"] > 0
