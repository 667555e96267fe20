from __future__ import annotations

import pytest
import torch

from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.errors import ParamError
from llmdeploy.engine.sampler import Sampler
from llmdeploy.engine.sequence import Sequence
from llmdeploy.kernels import native_build
from tests.engine.test_engine_parity import hf_greedy, prompts

EOS = 2


def sample(logits, *params_and_outputs, sampler=None):
    sampler = sampler or Sampler(seed=0)
    seqs = []
    for params, prompt, outputs in params_and_outputs:
        s = Sequence(prompt, params)
        for t in outputs:
            s.append(t)
        if params.seed is not None:
            s.generator = sampler.make_generator(params.seed)
        seqs.append(s)
    return sampler(torch.as_tensor(logits, dtype=torch.float32), [(s, i) for i, s in enumerate(seqs)], [EOS])


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01)


# --- sampler unit tests


def test_greedy_is_argmax_and_ties_pick_the_lowest_id():
    tokens, _ = sample([[0.0, 3.0, 3.0, 1.0]], (SamplingParams(temperature=0), [0], []))
    assert tokens == [1]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = [[0.0, 0.0, 9.0, 8.0, 1.0]]
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert sample(logits, (p, [0], []))[0] == [4]
    assert sample(logits, (p, [0], [4, 4]))[0] == [EOS]  # reached: EOS allowed again


def test_repetition_penalty_hf_style_over_prompt_and_output():
    logits = [[0.0, 4.0, 3.0, -1.0]]
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, (p, [1], []))[0] == [2]  # 4/2 < 3
    assert sample(logits, (p, [0], [1]))[0] == [2]
    assert sample([[0.0, -1.0, -1.5, -3.0]], (p, [0], [1]))[0] == [0]  # negative logits are multiplied


def test_extreme_penalties_and_temperatures_still_pick_the_favoured_token():
    # found by the schema fuzzer: repetition_penalty 5e-324 made the seen tokens' logits +inf, softmax NaN, and
    # the pick token 0, which a grammar then rejected (a 500)
    logits = [[0.5, 4.0, 3.0, -1.0]]
    for params in (
        SamplingParams(temperature=0.5, repetition_penalty=5e-324, seed=7),
        SamplingParams(temperature=0.5, repetition_penalty=5e-324),
        SamplingParams(temperature=2e-5, repetition_penalty=5e-324),
    ):
        assert sample(logits, (params, [1, 2], []))[0] in ([1], [2]), (
            params
        )  # both seen tokens: a tie at the top
    big = [[3e38, 1e38, 0.0, -1.0]]
    assert sample(big, (SamplingParams(temperature=2e-5, seed=1), [0], []))[0] == [0]


def test_presence_and_frequency_penalties_count_output_only():
    logits = [[0.0, 3.0, 2.5, 0.0]]
    pres = SamplingParams(temperature=0, presence_penalty=1.0)
    assert sample(logits, (pres, [1, 1, 1], []))[0] == [1]  # prompt tokens are not penalized
    assert sample(logits, (pres, [0], [1]))[0] == [2]
    freq = SamplingParams(temperature=0, frequency_penalty=0.3)
    assert sample(logits, (freq, [0], [1]))[0] == [1]  # 3 - 0.3 > 2.5
    assert sample(logits, (freq, [0], [1, 1]))[0] == [2]  # 3 - 0.6 < 2.5


def penalties_row_by_row(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The definition, one row at a time: repetition (HF) over the row's distinct prompt + output tokens, then
    presence and frequency (OpenAI) over its output tokens' counts."""
    out = logits.clone()
    for row, seq in zip(out, seqs, strict=True):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)))
            v = row[seen]
            hi = torch.finfo(row.dtype).max
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty).clamp(-hi, hi)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def test_penalties_of_a_whole_batch_at_once_are_each_row_s_own():
    g = torch.Generator().manual_seed(11)
    vocab = 300
    logits = torch.randn(7, vocab, generator=g) * 3
    cases = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.7, frequency_penalty=0.4),
        dict(),  # none: untouched
        dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
        dict(frequency_penalty=0.25),  # no output yet below: untouched
        dict(repetition_penalty=5e-324, presence_penalty=2.0),  # a tiny penalty: clamped, never +inf
        dict(repetition_penalty=1.3, frequency_penalty=-0.3),
    ]
    seqs = []
    for i, kw in enumerate(cases):
        prompt = torch.randint(0, vocab, (20,), generator=g).tolist() + [5, 5, 5]
        seq = Sequence(prompt, SamplingParams(temperature=0.7, **kw))
        for t in [] if i == 4 else torch.randint(0, vocab, (9,), generator=g).tolist() + [5, 7, 7]:
            seq.append(t)
        seqs.append(seq)
    got = logits.clone()
    Sampler._apply_penalties(got, seqs)
    want = penalties_row_by_row(logits, seqs)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(got[2], logits[2]) and torch.equal(got[4], logits[4]) and got.isfinite().all()
    assert not torch.equal(got[0], logits[0]) and not torch.equal(got[1], logits[1])


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    params = [(SamplingParams(temperature=1.5, top_k=1), [0], []) for _ in range(8)]
    assert sample(logits, *params)[0] == greedy


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = [(SamplingParams(temperature=1.0, top_p=0.7, seed=i), [0], []) for i in range(200)]
    tokens, _ = sample(probs.log().expand(200, 4), *params)
    assert set(tokens) == {0, 1}


def filter_rows() -> tuple[torch.Tensor, list[int], list[float]]:
    """Logit rows from peaked to flat (a grammar's mask in one), as _sample hands them over, with top_k (also past
    the vocabulary) with and without top_p, and rows with neither."""
    g = torch.Generator().manual_seed(0)
    vocab = 5000
    scales = [
        8.0,
        8.0,
        3.0,
        3.0,
        0.3,
        0.3,
        5.0,
        1.0,
        1.0,
        0.3,
    ]  # peaked -> decided early; flat -> sorted whole
    logits = torch.randn(len(scales), vocab, generator=g) * torch.tensor(scales)[:, None]
    logits[6, ::3] = float("-inf")  # a grammar's mask
    logits -= logits.amax(-1, keepdim=True)  # as _sample hands them over: the best logit at 0
    top_k = [0, 0, 0, -1, 0, 40, 700, 2**70, 0, 10]
    top_p = [0.9, 0.5, 0.95, 0.8, 0.9, 1.0, 0.6, 0.7, 1.0, 0.5]
    return logits, top_k, top_p


def assert_same_kept(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[~got.isinf()], want[~want.isinf()])


def test_top_k_top_p_from_candidates_equals_the_sort_definition(monkeypatch):
    """The candidates-first filter (torch ops: where the native kernel does not run) keeps exactly what sorting
    each whole row keeps: peaked and wider nuclei taken from candidates, rows that need too many sorted whole (flat
    ones), top_k with and without top_p, masked tokens, and rows with neither in the same batch."""
    from llmdeploy.engine import sampling_filters as filters
    from llmdeploy.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "top_k_top_p_rows", lambda *a: None)
    logits, top_k, top_p = filter_rows()
    vocab = logits.shape[1]
    sorted_rows = []
    by_sort = filters.top_k_top_p_by_sort

    def spy(rows_logits, k, p):
        sorted_rows.append(rows_logits.shape[0])
        return by_sort(rows_logits, k, p)

    monkeypatch.setattr(filters, "top_k_top_p_by_sort", spy)
    got = filters.top_k_top_p(logits, top_k, top_p)
    want = by_sort(logits, top_k, top_p)
    assert_same_kept(got, want)
    kept = (~got.isinf()).sum(-1).tolist()
    assert kept[8] == vocab and kept[5] == 40  # neither: untouched; top_k alone
    assert 1 < kept[9] < 10  # top_p over the top_k's own mass: half of a flat top 10
    assert 1 < kept[0] <= 64 and 64 < kept[3] <= 512
    assert kept[2] > 600 and kept[7] > 1500 and kept[4] > vocab / 2
    # sorted whole: the flat row only, whose nucleus needs more than half the vocabulary; every other row is decided
    # from candidates, so each bound held its nucleus
    assert sorted_rows == [1]
    bound = filters.nucleus_bound(logits, torch.tensor(top_p)).tolist()
    assert all(kept[i] <= bound[i] <= 1.25 * kept[i] for i in (0, 1, 2, 3, 7))  # tight: a power-of-two step


@pytest.mark.skipif(not native_build.available(), reason="needs the native kernels (gcc)")
def test_native_top_k_top_p_equals_the_sort_definition():
    """kernels/csrc/sample_rows.c's filter keeps what the definition keeps, on the same rows as the candidates path
    and on a row with top_p's edge a float32 step past where a float64 top_p would put it; ties at top_k's and top_p's
    edges keep the lower token ids (the definition's sort leaves their order open: same counts); -inf and NaN
    logits are dropped; the input is left as it was."""
    from llmdeploy.engine import sampling_filters as filters
    from llmdeploy.kernels import cpu_native

    logits, top_k, top_p = filter_rows()
    vocab = logits.shape[1]
    before = logits.clone()
    got = filters.top_k_top_p(logits, top_k, top_p)
    assert torch.equal(logits, before)
    assert_same_kept(got, filters.top_k_top_p_by_sort(logits, top_k, top_p))
    assert cpu_native.top_k_top_p_rows(logits, [vocab] * 10, [0.9] * 10) is not None  # the kernel ran
    # at a temperature (a sampled burst's way: the raw logits and 1 / T), and a greedy row (1 / T = 0) untouched
    inv_temp = [1 / 1.7] * 9 + [0.0]
    at_t = cpu_native.top_k_top_p_rows(logits, top_k, top_p, inv_temp)
    want = filters.top_k_top_p_by_sort(logits[:9] / 1.7, top_k[:9], top_p[:9])
    assert torch.equal(at_t[:9].isinf(), want.isinf()) and torch.equal(at_t[9], logits[9])
    # four tokens of 1/4 each: top_p 0.5 keeps three (the third's better tokens hold 0.5, not more); 0.7499999999
    # keeps all four, as float32's 0.75 (a float64 top_p would drop the fourth)
    flat = torch.zeros(3, 4)
    got = filters.top_k_top_p(flat, [0, 0, 3], [0.5, 0.7499999999, 1.0])
    assert (~got.isinf()).sum(-1).tolist() == [3, 4, 3]
    assert_same_kept(got, filters.top_k_top_p_by_sort(flat, [0, 0, 3], [0.5, 0.7499999999, 1.0]))
    ties = torch.tensor([[0.0, -1.0, -1.0, -1.0, -1.0, -5.0, float("-inf"), float("nan")]])
    for k, p in [(3, 1.0), (8, 0.5), (8, 0.9999), (2, 0.99)]:
        want = (
            (~filters.top_k_top_p_by_sort(ties.nan_to_num(nan=float("-inf")), [k], [p]).isinf()).sum().item()
        )
        got = (~filters.top_k_top_p(ties, [k], [p]).isinf())[0]
        assert got.sum().item() == want and got.nonzero().flatten().tolist() == list(range(want))


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=0.8), dict(temperature=1.3, top_p=0.9), dict(temperature=1.5, min_p=0.05, top_k=12)],
)
def test_the_native_draw_picks_what_the_torch_ops_pick(kw, monkeypatch):
    """Same seeds, same uniform numbers: the one-pass native draw (kernels/csrc/sample_rows.c) and the torch ops
    (softmax, min_p, cumsum, searchsorted) pick the same token but where a uniform falls within float rounding of
    a token's edge."""
    from llmdeploy.kernels import cpu_native

    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(5)).mul(2.0).expand(400, 300)
    params = [(SamplingParams(seed=i, **kw), [0], []) for i in range(400)]
    native = sample(logits, *params)[0]
    monkeypatch.setattr(cpu_native, "sample_rows", lambda *a: None)
    torch_ops = sample(logits, *params)[0]
    assert len(set(native)) > 5
    assert sum(a == b for a, b in zip(native, torch_ops, strict=True)) >= 398


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([[0.6, 0.3, 0.06, 0.04]])
    params = [(SamplingParams(temperature=1.0, min_p=0.2, seed=i), [0], []) for i in range(200)]
    assert set(sample(probs.log().expand(200, 4), *params)[0]) == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    params = [(SamplingParams(temperature=1.0), [0], []) for _ in range(2000)]
    tokens, _ = sample(probs.log().expand(2000, 3), *params)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 2000
    assert torch.allclose(freq, probs, atol=0.04)


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.5, logprobs=3, seed=0, repetition_penalty=1.5)
    tokens, lps = sample(logits, (p, [1, 2], []), (SamplingParams(temperature=0), [1], []))
    ref = torch.log_softmax(logits[0], -1)
    assert lps[1] is None and lps[0].token_id == tokens[0]
    assert lps[0].logprob == pytest.approx(ref[tokens[0]].item(), abs=1e-5)
    top_v, top_i = ref.topk(3)
    assert [t for t, _ in lps[0].top] == top_i.tolist()
    assert [v for _, v in lps[0].top] == pytest.approx(top_v.tolist(), abs=1e-5)


def test_validate_names_the_param():
    for kw, param in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_k": -2}, "top_k"),
    ]:
        with pytest.raises(ParamError) as e:
            SamplingParams(**kw).validate()
        assert e.value.param == param


# --- through the engine


def test_greedy_is_batch_invariant(llm, tiny_llama):
    target = prompts(1, seed=11, lo=30, hi=30)[0]
    alone = llm.generate([target], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    others = prompts(15, seed=12, lo=1, hi=80)
    mixed = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, ignore_eos=True)] * 15
    outs = llm.generate(
        others[:7] + [target] + others[7:],
        mixed[:7] + [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] + mixed[7:],
    )
    assert outs[7].outputs[0].token_ids == alone.outputs[0].token_ids == hf_greedy(tiny_llama, target, 20)


def test_seed_reproducible_whatever_the_batch(llm):
    p = prompts(1, seed=13)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    a = llm.generate([p], seeded)[0].outputs[0].token_ids
    noise = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 5
    b = llm.generate(prompts(5, seed=14) + [p], noise + [seeded])[-1].outputs[0].token_ids
    c = llm.generate([p], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))[0]
    assert a == b and c.outputs[0].token_ids != a


def test_top_k_one_equals_greedy_in_the_engine(llm):
    p = prompts(2, seed=15)
    greedy = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    topk = llm.generate(p, SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk]


def test_n_streams_are_distinct_and_reproducible_with_a_seed(llm):
    p = prompts(1, seed=16)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate([p], params)[0]
    streams = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in streams}) == 4 and all(len(s) == 12 for s in streams)
    again = llm.generate([p], params)[0]
    assert [c.token_ids for c in again.outputs] == streams
    greedy = llm.generate([p], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_n_with_a_prompt_cached_up_to_its_last_token(llm):
    p = prompts(1, seed=25, lo=33, hi=33)[0]  # two full blocks cached, one token left to compute
    llm.generate([p], SamplingParams(temperature=0, max_tokens=2))
    hits = llm.engine.block_manager.num_hits
    out = llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))[0]
    assert llm.engine.block_manager.num_hits - hits == 32
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]


def test_min_tokens_and_stop_token_ids_in_the_engine(llm):
    p = prompts(1, seed=17)[0]
    first = (
        llm.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    stopped = llm.generate([p], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first[0]]))[
        0
    ].outputs[0]
    assert (
        stopped.token_ids == first[:1] and stopped.finish_reason == "stop" and stopped.stop_reason == first[0]
    )
    held = llm.generate(
        [p],
        SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[first[0]], ignore_eos=True),
    )[0].outputs[0]
    assert first[0] not in held.token_ids[:3]


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.arch.eos_token_ids[0]
    # which prompt's greedy continuation reaches EOS is up to the random model: try a batch, check the first
    batch = prompts(40, seed=18, lo=2, hi=30)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=40))
    hit = next((i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "stop"), None)
    if hit is None:
        pytest.skip("no prompt reached EOS on this random model")
    out = outs[hit].outputs[0]
    assert out.token_ids[-1] == eos and out.stop_reason is None
    ignored = llm.generate([batch[hit]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[
        0
    ].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 40
    assert ignored.token_ids[: len(out.token_ids)] == out.token_ids


def test_logprobs_match_transformers(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    p = prompts(1, seed=19, lo=10, hi=10)[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.logprobs) == 4 and all(len(lp.top) == 5 for lp in out.logprobs)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1 : -1]
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i] == lp.top[0][0]  # greedy: the chosen one is the best
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-4)
        assert [v for _, v in lp.top] == pytest.approx(ref[i].topk(5).values.tolist(), abs=1e-4)


def test_a_top_k_beyond_any_integer_type_is_no_top_k_and_fails_no_neighbour(llm):
    """Schemathesis sent top_k = 2**70: the sampler's tensor overflowed and every request in that step failed."""
    p = prompts(2, seed=17)
    huge = SamplingParams(temperature=1.0, top_k=2**70, seed=5, max_tokens=8, ignore_eos=True)
    off = SamplingParams(temperature=1.0, top_k=-1, seed=5, max_tokens=8, ignore_eos=True)
    neighbour = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(p, [huge, neighbour])
    alone = llm.generate(p[:1], off)[0]
    assert out[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(out[1].outputs[0].token_ids) == 8
