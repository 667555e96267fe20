"""The attention cost constant the scheduler sizes chunks by: timed at start on the engine's own model and kernels
(engine/attn_probe.py), and the pure rule that turns two timings into it (policies/step_cost.py)."""

from __future__ import annotations

import pytest

from llmdeploy.engine import attn_probe, start_measures
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.model_runner import ModelRunner
from llmdeploy.policies.step_cost import attn_cost_context_from, chunk_cost


@pytest.mark.parametrize("x", [64.0, 550.0, 1700.0, 20000.0])
@pytest.mark.parametrize("n,context", [(64, 1024), (32, 300)])
def test_two_chunk_timings_give_back_the_constant(x, n, context):
    per_token = 0.7e-3
    fresh, late = per_token * chunk_cost(0, n, x), per_token * chunk_cost(context, n, x)
    assert attn_cost_context_from(fresh, late, n, context) == pytest.approx(x, rel=1e-9)


def test_a_late_chunk_that_is_not_slower_means_no_weighting():
    assert attn_cost_context_from(0.05, 0.05, 64, 1024) is None
    assert attn_cost_context_from(0.05, 0.049, 64, 1024) is None  # noise the other way
    assert attn_cost_context_from(0.0, 0.01, 64, 1024) is None


def test_the_runner_times_a_chunk_at_context_zero_and_at_a_long_context(tiny_llama, monkeypatch, tmp_path):
    """A real runner on the tiny model: the probe's steps are real forwards of one 64-token chunk, at a long context
    (setup, untimed), then at 0 and at that context, each twice; their timings set the constant."""
    # nothing kept from another test's start
    monkeypatch.setattr(start_measures, "measures_dir", lambda: tmp_path)
    seen, timings = [], []
    real_run, real_rule = ModelRunner.run, attn_probe.attn_cost_context_from

    def run(self, batch, **kw):
        if not kw and len(batch.prefills) == 1 and batch.prefills[0][1] == attn_probe.PROBE_TOKENS:
            seq, n = batch.prefills[0]
            seen.append(seq.num_computed_tokens)
        return real_run(self, batch, **kw)

    def rule(fresh, late, n, context):
        timings.append((fresh, late, n, context))
        return real_rule(fresh, late, n, context)

    monkeypatch.setattr(ModelRunner, "run", run)
    monkeypatch.setattr(attn_probe, "attn_cost_context_from", rule)
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), max_model_len=1024, kv_cache_gb=0.05))
    context = min(attn_probe.PROBE_CONTEXT, 1024 - attn_probe.PROBE_TOKENS - 1)
    assert seen == [context] * 2 + [0] * 2 + [context] * 2  # setup (untimed), then the two timed
    ((fresh, late, n, ctx),) = timings
    assert (n, ctx) == (attn_probe.PROBE_TOKENS, context) and fresh > 0 and late > 0
    assert runner.attn_cost_context == real_rule(fresh, late, n, ctx)


def test_a_short_max_model_len_keeps_the_flop_estimate(tiny_llama):
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.05))
    assert runner.attn_cost_context == runner.estimated_attn_cost_context()
    assert runner.attn_cost_context is not None
