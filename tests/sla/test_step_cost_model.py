"""The step-cost model and the TTFT prediction over the engine's queue, without a model (pure code)."""

from __future__ import annotations

import pytest

from llmdeploy.engine.load_stats import CostPoint, StepCostMeter, fit_points
from llmdeploy.engine.ttft_model import PendingPrompt, QueueView, predicted_ttft_s, ttft_ladder
from llmdeploy.policies.step_cost import StepCost

TRUE = StepCost(fixed_s=0.020, prefill_token_s=0.0006, decode_seq_s=0.0012)
CALIBRATION = [
    CostPoint(256, 0, TRUE.step_s(256)),
    CostPoint(16, 0, TRUE.step_s(16)),
    CostPoint(0, 1, TRUE.step_s(0, 1)),
    CostPoint(0, 8, TRUE.step_s(0, 8)),
]


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def test_fit_recovers_a_linear_step_cost():
    fit = fit_points(CALIBRATION)
    assert close(fit.fixed_s, TRUE.fixed_s) and close(fit.prefill_token_s, TRUE.prefill_token_s)
    assert close(fit.decode_seq_s, TRUE.decode_seq_s)


def test_tiny_prompts_do_not_collapse_the_prefill_rate():
    """Issue 12: a whole step charged to a 3-token prompt made the engine look 30x slower per token. Here 50 steps
    of 2-3 token prompts keep the per-token cost near its calibration, and a 500-token prompt's prediction stays
    near what it really costs."""
    meter = StepCostMeter(CALIBRATION)
    for i in range(50):
        n = 2 + i % 2
        meter.observe(n, 0, TRUE.step_s(n) * 1.05, now=1000.0 + i * 0.1)
    cost = meter.current()
    assert cost.step_s(500) == pytest.approx(TRUE.step_s(500), rel=0.1)
    assert cost.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=0.25)


def test_the_fit_follows_a_slower_machine_and_returns_to_calibration_when_idle():
    meter = StepCostMeter(CALIBRATION)
    t = 1000.0
    for i in range(60):  # the machine got 2x slower (another process): mixed steps
        p, d = (128, 4) if i % 2 else (0, 4 + i % 8)
        meter.observe(p, d, 2 * TRUE.step_s(p, d), now=t)
        t += 0.1
    slow = meter.current()
    assert slow.step_s(128, 4) == pytest.approx(2 * TRUE.step_s(128, 4), rel=0.15)
    meter.observe(16, 0, TRUE.step_s(16), now=t + 3600)  # an hour idle, then one ordinary step
    assert meter.current().step_s(256) == pytest.approx(TRUE.step_s(256), rel=0.1)


def test_coefficients_stay_non_negative_on_noisy_data():
    meter = StepCostMeter(CALIBRATION)
    for i in range(40):  # decode cost that falls with batch size: noise, not physics
        meter.observe(0, 1 + i % 4, 0.05 - 0.004 * (i % 4), now=1000.0 + i)
    cost = meter.current()
    assert cost.fixed_s >= 0 and cost.prefill_token_s >= 0 and cost.decode_seq_s >= 0


def test_margin_reflects_steps_running_over_their_prediction():
    meter = StepCostMeter(CALIBRATION)
    for i in range(64):
        over = 1.3 if i % 2 else 1.0
        meter.observe(0, 1, TRUE.step_s(0, 1) * over, now=1000.0 + i)
    assert 0.1 < meter.current().margin <= 0.35
    assert meter.decode_step_s[1] > TRUE.step_s(0, 1)


def queue(*pending: PendingPrompt, decoding: int = 0, free_slots: int = 64) -> QueueView:
    return QueueView(pending, decoding, 2048, 512, 128, 256, free_slots, slot_wait_s=1.0)


def test_idle_prediction_is_one_prefill():
    assert predicted_ttft_s(queue(), TRUE, 500) == pytest.approx(TRUE.step_s(500))


def test_short_prompt_waits_for_shorter_ones_only_and_shares_their_step():
    busy = queue(PendingPrompt(100, 0, False), PendingPrompt(300, 0, False), decoding=10)
    t = predicted_ttft_s(busy, TRUE, 200)
    # one step: the 100-token prompt (ahead), this one, and the 300-token one that fits in the budget
    assert t == pytest.approx(TRUE.step_s(600, 10))


def test_long_prompt_goes_after_short_ones_and_is_capped_per_step():
    busy = queue(PendingPrompt(100, 0, False), decoding=4)
    t = predicted_ttft_s(busy, TRUE, 1024)
    steps = 1 + 1024 // 128  # the short prompt's step, then 128 long tokens a step while decodes run
    assert t == pytest.approx(steps * TRUE.step_s(0, 4) + TRUE.prefill_token_s * (100 + 1024))


def test_no_free_slot_adds_the_slot_wait():
    assert predicted_ttft_s(queue(free_slots=0), TRUE, 10) == pytest.approx(TRUE.step_s(10) + 1.0)


def test_ladder_is_ascending_and_ends_at_max_len():
    ladder = ttft_ladder(queue(decoding=3), TRUE, 1000)
    assert [n for n, _ in ladder] == [1, 16, 64, 128, 256, 512, 1000]
    assert all(a[1] <= b[1] for a, b in zip(ladder, ladder[1:], strict=False))


def test_margin_makes_the_prediction_conservative():
    cost = StepCost(TRUE.fixed_s, TRUE.prefill_token_s, TRUE.decode_seq_s, margin=0.2)
    assert predicted_ttft_s(queue(), cost, 64) == pytest.approx(1.2 * TRUE.step_s(64))
    back = StepCost.from_json(cost.to_json())
    assert back is not None and back.step_s(64, 2) == pytest.approx(cost.step_s(64, 2), rel=1e-4)
    assert StepCost.from_json({"fixed_ms": "x"}) is None and StepCost.from_json(None) is None


def test_throughput_ceiling_counts_decode_and_the_replacing_prefill():
    from llmdeploy.policies.step_cost import throughput_ceiling

    c = throughput_ceiling(TRUE, batch=16, prompt_tokens=128, output_tokens=64)
    step = TRUE.fixed_s + 16 * TRUE.decode_seq_s + TRUE.prefill_token_s * 16 * 128 / 64
    assert c.output_tokens_per_s == pytest.approx(16 / step) and c.requests_per_s == pytest.approx(
        16 / step / 64
    )
    assert throughput_ceiling(TRUE, 32, 128, 64).output_tokens_per_s > c.output_tokens_per_s


def test_a_negative_intercept_is_pinned_at_zero_and_the_slopes_refitted():
    """Prefill data steeper than the warm-up (the machine got busier on long prompts only): the unconstrained fit
    wants a negative fixed cost; the fit keeps every coefficient >= 0 instead of failing."""
    meter = StepCostMeter([CostPoint(10, 0, 0.001), CostPoint(100, 0, 0.05), CostPoint(200, 0, 0.1)])
    cost = meter.current()
    assert cost.fixed_s == 0.0 and cost.prefill_token_s > 0 and cost.decode_seq_s >= 0
    assert cost.step_s(200) == pytest.approx(0.1, rel=0.1)


def test_decode_terms_pinned_at_zero_keep_their_previous_values():
    """A busy machine's noise (a mixed step faster than the prefill-only ones, short prompts near zero) pinned
    both decode terms at zero (seen in the schemathesis fuzz: /load divided by zero); a decode step must still
    cost what the fit last said, and the prefill rate still follows the data."""
    meter = StepCostMeter([CostPoint(256, 0, 0.2), CostPoint(16, 0, 0.02), CostPoint(0, 1, 0.008)])
    short, long, mixed = (12, 0, 0.001), (200, 0, 0.531), (200, 6, 0.265)
    steps = [short] * 12 + [long, mixed, short, short, long, short, long, long]
    decode_1 = []
    for i, (p, d, y) in enumerate(steps):
        meter.observe(p, d, y, now=1000.0 + i)
        decode_1.append(meter.current().decode_step_s(1))
    assert min(decode_1) > 0
    assert decode_1[-1] == pytest.approx(decode_1[-2])  # held, not refitted to zero
    assert meter.current().prefill_token_s > 1.5 * meter.calibrated.prefill_token_s  # steeper, as the data


def test_a_prefill_step_premium_is_fitted_apart_from_the_decode_step():
    """Prefill steps run the Python layers, decode-only steps one native call: with one intercept for both, a
    16-token prompt's TTFT came out 1.5x what it took. The fit separates them, and a decode step keeps its cost."""
    true = StepCost(0.008, 0.0006, 0.0005, prefill_step_s=0.012)
    points = [CostPoint(p, d, true.step_s(p, d)) for p, d in ((256, 0), (16, 0), (0, 1), (0, 8))]
    fit = fit_points(points)
    assert close(fit.fixed_s, true.fixed_s) and close(fit.prefill_step_s, true.prefill_step_s)
    assert close(fit.prefill_token_s, true.prefill_token_s) and close(fit.decode_seq_s, true.decode_seq_s)
    meter = StepCostMeter(points)
    for i in range(40):  # mixed steps and decode-only ones, as served
        p, d = (64, 3) if i % 3 == 0 else (0, 4)
        meter.observe(p, d, true.step_s(p, d), now=1000.0 + i)
    cost = meter.current()
    assert cost.decode_step_s(4) == pytest.approx(true.decode_step_s(4), rel=0.01)
    assert cost.step_s(16) == pytest.approx(true.step_s(16), rel=0.01)
    back = StepCost.from_json(cost.to_json())
    assert back is not None and back.prefill_step_s == pytest.approx(cost.prefill_step_s, rel=1e-3)
    older = {k: v for k, v in cost.to_json().items() if k != "prefill_step_ms"}  # an engine before the term
    assert StepCost.from_json(older).prefill_step_s == 0.0


def test_prefill_only_data_leaves_the_premium_at_zero():
    """Every step with prefill tokens: the premium and the fixed term are the same column; the fit keeps one."""
    fit = fit_points([CostPoint(10, 0, 0.011), CostPoint(100, 0, 0.056), CostPoint(200, 0, 0.106)])
    assert fit.prefill_step_s == 0.0 and fit.fixed_s == pytest.approx(0.006, rel=0.01)
    assert fit.step_s(50) == pytest.approx(0.031, rel=0.01)


def test_a_fresh_process_first_slow_prefill_does_not_price_decode_steps():
    """A fresh engine's first prefill took 350-530 ms against ~30 (start-up work beside it, first page touches): counted
    at most twice its prediction, it moves neither the decode step nor a short prompt's TTFT far."""
    meter = StepCostMeter(CALIBRATION)
    before = meter.current()
    meter.observe(32, 0, 0.5, now=1000.0)
    cost = meter.current()
    assert cost.decode_step_s(1) == pytest.approx(before.decode_step_s(1), rel=0.05)
    assert cost.step_s(16) < 1.5 * before.step_s(16)
    assert meter.errors[-1] > 10  # the margin still sees how far off that step was
