"""The grammar masks on their own: random logits stand in for a random model, a whole batch of constrained,
biased and free rows at once, as the sampler applies them."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from llmdeploy.engine.errors import ParamError
from llmdeploy.engine.guided import GrammarBackend, GuidedSpec, apply_logit_rules
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.sequence import Sequence
from tests.guided.schemas import SCHEMAS

STEPS = 120


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def run_batch(backend, tokenizer, params: list[SamplingParams], seed: int) -> list[tuple[str, bool]]:
    """Sample every row from random logits through the masks until each stops or STEPS pass."""
    gen = torch.Generator().manual_seed(seed)
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    seqs = []
    for p in params:
        seq = Sequence([1, 2, 3], p)
        seq.guided = backend.new_state(p.guided) if p.guided else None
        seqs.append(seq)
    done = [False] * len(seqs)
    for _ in range(STEPS):
        live = [s for s, d in zip(seqs, done, strict=True) if not d]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 3
        apply_logit_rules(logits, live)
        tokens = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0].tolist()
        for seq, tok in zip(live, tokens, strict=True):
            i = seqs.index(seq)
            if tok == eos:
                done[i] = True
                continue
            seq.append(tok)
            if seq.guided:
                seq.guided.accept(tok)
    return [(tokenizer.decode(s.output_token_ids), d) for s, d in zip(seqs, done, strict=True)]


def test_random_logits_through_every_schema_give_valid_json(backend, tokenizer):
    params = [SamplingParams(guided=GuidedSpec.json_schema(s, "response_format")) for s in SCHEMAS]
    finished = 0
    for seed in range(3):
        for schema, (text, stopped) in zip(SCHEMAS, run_batch(backend, tokenizer, params, seed), strict=True):
            if stopped:
                finished += 1
                value = json.loads(text)
                jsonschema.validate(value, schema)
                if isinstance(value, dict) and schema.get("required") == list(schema.get("properties", {})):
                    assert list(value) == schema["required"]  # keys come in the schema's order, as at OpenAI
    assert finished >= len(SCHEMAS)  # most walks end well before STEPS


def test_mixed_batch_regex_choice_bias_and_free_rows(backend, tokenizer):
    ban = tokenizer.convert_tokens_to_ids("a")
    params = [
        SamplingParams(guided=GuidedSpec("regex", "[0-9]{2,4}", "guided_regex")),
        SamplingParams(guided=GuidedSpec.choice(["left", "right"])),
        SamplingParams(logit_bias={ban: -100.0}),
        SamplingParams(),
        SamplingParams(guided=GuidedSpec("json_object", "", "response_format")),
    ]
    out = run_batch(backend, tokenizer, params, seed=7)
    assert out[0][1] and out[0][0].isdigit() and 2 <= len(out[0][0]) <= 4
    assert out[1] == ("left", True) or out[1] == ("right", True)
    seq_ids = tokenizer.encode(out[2][0], add_special_tokens=False)
    assert ban not in seq_ids
    if out[4][1]:
        assert isinstance(json.loads(out[4][0]), dict)


def test_forks_follow_their_own_path(backend, tokenizer):
    p = SamplingParams(guided=GuidedSpec.choice(["ab", "cd"]))
    a = Sequence([1], p)
    a.guided = backend.new_state(p.guided)
    b = a.fork(1)
    a.guided.accept(tokenizer.convert_tokens_to_ids("a"))
    b.guided.accept(tokenizer.convert_tokens_to_ids("c"))
    with pytest.raises(RuntimeError):
        b.guided.accept(tokenizer.convert_tokens_to_ids("b"))


@pytest.mark.parametrize(
    "spec",
    [
        GuidedSpec("json_schema", '{"type": "nope"}', "response_format"),
        GuidedSpec("regex", "(", "guided_regex"),
    ],
)
def test_unusable_grammars_name_their_param(backend, spec):
    with pytest.raises(ParamError) as err:
        backend.check(SamplingParams(guided=spec))
    assert err.value.param == spec.param


def test_logit_bias_outside_the_vocabulary(backend, tokenizer):
    with pytest.raises(ParamError) as err:
        backend.check(SamplingParams(logit_bias={len(tokenizer) + 5: 1.0}))
    assert err.value.param == "logit_bias"


def test_the_offline_api_builds_the_grammar_tokenizer_only_when_a_request_needs_it(tiny_llama):
    """A server builds it at start (its readiness waits for it); the offline LLM would have run its first
    generate() beside the build's thread, so it builds it on first use, and a constrained request still works."""
    from llmdeploy.engine import LLM

    llm = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=4, max_model_len=256)
    backend = llm.engine.guided
    assert backend.settled and backend.tokenizer is None  # nothing built, nothing under way
    plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(plain.outputs[0].token_ids) == 4 and backend.tokenizer is None  # a free request builds nothing
    choice = GuidedSpec("choice", json.dumps(["yes", "no"]), "guided_choice")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, guided=choice))[0]
    assert out.outputs[0].text in ("yes", "no") and backend.settled and backend.available
