"""Constrained decoding's cost per decode step at batch 32, against the engine's own decode step, and the two
grammar libraries side by side (why llguidance).

    .venv/bin/python bench/guided_overhead.py                      # SmolLM2 (builtin), batch 32
    .venv/bin/python bench/guided_overhead.py --steps 24 --skip-libraries

Part 1 (libraries, if xgrammar is installed too): tokenizer set-up, schema compile, mask fill at batch 32 along
a real JSON document, and random walks through 33 schemas (a random model's worst case) checked with
jsonschema. Part 2 (engine): decode steps of 32 unconstrained sequences, then the same batch with every row
constrained by a JSON schema, and the mask work alone (fill + apply on 32 rows) per step; the goal is a mask
cost under 10% of the decode step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdeploy.engine import LLM, SamplingParams  # noqa: E402
from llmdeploy.engine.guided import GuidedSpec, apply_logit_rules  # noqa: E402
from llmdeploy.engine.sequence import Sequence  # noqa: E402
from tests.guided.schemas import SCHEMAS  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
BOUNDED = {"type": "string", "maxLength": 10}
DOC = '{"name": "Bob the builder of things", "age": 42, "tags": ["a", "bb", "ccc", "dddd", "e", "ff", "ggg"]}'


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "unknown"
    )


def ms(samples: list[float]) -> str:
    return f"{statistics.mean(samples) * 1e3:.2f} ms (max {max(samples) * 1e3:.2f})"


# ---- part 1: the libraries --------------------------------------------------------------------------------


def random_walks(allowed, accept, token_bytes, eos, seed, walks: int) -> tuple[int, int]:
    """(completed, invalid) over every schema, `walks` walks each of up to 60 tokens."""
    import jsonschema

    done = bad = 0
    for si, schema in enumerate(SCHEMAS):
        rng = random.Random(seed + si)
        for _ in range(walks):
            step_allowed, step_accept = allowed(schema), accept
            state = step_allowed()
            out, stopped = b"", False
            for _ in range(60):
                ids = state[0]().tolist()
                if eos in ids and rng.random() < 0.5:
                    stopped = True
                    break
                tok = rng.choice(ids)
                if tok == eos:
                    stopped = True
                    break
                step_accept(state[1], tok)
                out += token_bytes[tok]
            if stopped:
                done += 1
                try:
                    jsonschema.validate(json.loads(out.decode()), schema)
                except Exception:
                    bad += 1
    return done, bad


def unpack(bitmask_row: torch.Tensor, vocab: int) -> np.ndarray:
    """The allowed token ids of one bitmask row."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), count=vocab, bitorder="little")
    return np.flatnonzero(bits)


def compare_libraries(tokenizer, vocab: int, eos: int, batch: int, walks: int) -> None:
    from llmdeploy.engine.token_texts import TokenTexts

    texts = TokenTexts(tokenizer)
    token_bytes = [texts.bytes_of(i) for i in range(vocab)]
    doc = tokenizer.encode(DOC, add_special_tokens=False)
    # a token that is one raw control character, which a JSON string must escape (-1: the vocabulary has none)
    ctrl = next(
        (i for i, b in enumerate(token_bytes) if len(b) == 1 and b[0] < 0x20 and b not in b"\t\n\r"), -1
    )
    rows = []

    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    if xgr is not None:
        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        setup = time.perf_counter() - t
        comp = xgr.GrammarCompiler(info, cache_enabled=False)
        t = time.perf_counter()
        cg = comp.compile_json_schema(json.dumps(SCHEMA))
        compile_s = time.perf_counter() - t
        matchers = [xgr.GrammarMatcher(cg) for _ in range(batch)]
        batcher = xgr.BatchGrammarMatcher()
        bm = xgr.allocate_token_bitmask(batch, vocab)
        fills = []
        for tok in doc:
            t = time.perf_counter()
            batcher.batch_fill_next_token_bitmask(matchers, bm)
            fills.append(time.perf_counter() - t)
            for m in matchers:
                m.accept_token(tok)

        def x_allowed(schema):
            g = comp.compile_json_schema(json.dumps(schema), max_whitespace_cnt=4)
            m, b = xgr.GrammarMatcher(g), xgr.allocate_token_bitmask(1, vocab)

            def mask():
                m.fill_next_token_bitmask(b, 0)
                return unpack(b[0], vocab)

            return lambda: (mask, m)

        result = random_walks(x_allowed, lambda m, tok: m.accept_token(tok), token_bytes, eos, 0, walks)
        probe = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(BOUNDED)))
        probe.accept_string('"a')
        probe.fill_next_token_bitmask(bm, 0)
        rows.append(("xgrammar", setup, compile_s, fills, result, ctrl in unpack(bm[0], vocab)))

    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)  # compiled lazily, by the matchers
    matchers = [llguidance.LLMatcher(ltok, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - t
    executor = llguidance.LLExecutor()
    bm = lt.allocate_token_bitmask(batch, vocab)
    fills = []
    for tok in doc:
        t = time.perf_counter()
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bm)
        fills.append(time.perf_counter() - t)
        for m in matchers:
            m.consume_token(tok)

    def l_allowed(schema):
        g = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_pattern": r"[ \t\n]{0,8}"}
        )
        m, b = llguidance.LLMatcher(ltok, g), lt.allocate_token_bitmask(1, vocab)

        def mask():
            lt.fill_next_token_bitmask(m, b, 0)
            return unpack(b[0], vocab)

        return lambda: (mask, m)

    result = random_walks(l_allowed, lambda m, tok: m.consume_token(tok), token_bytes, eos, 0, walks)
    probe = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(BOUNDED))
    probe.consume_tokens(tokenizer.encode('"a', add_special_tokens=False))
    lt.fill_next_token_bitmask(probe, bm, 0)
    rows.append(("llguidance", setup, compile_s, fills, result, ctrl in unpack(bm[0], vocab)))

    print(f"\n== grammar libraries: vocab {vocab}, batch {batch}, {len(doc)}-token JSON document ==")
    for name, setup, compile_s, fills, (done, bad), leak in rows:
        print(
            f"{name:11s} tokenizer set-up {setup:.2f} s | schema compile (+{batch} matchers) {compile_s * 1e3:.1f} ms"
            f" | mask fill x{batch}: {ms(fills)} | random walks: {done} completed, {bad} invalid JSON"
            f" | raw control character allowed in a maxLength string: {'YES (invalid JSON)' if leak else 'no'}"
        )


# ---- part 2: the engine -----------------------------------------------------------------------------------


def decode_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """(seconds, tokens, steps) of the steps in which every sequence of the batch decodes (no prefill)."""
    engine = llm.engine
    engine.stream = True  # an output per step, so tokens are counted as they come
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", p, params)
    seconds, tokens, steps = 0.0, 0, 0
    while engine.has_unfinished():
        full = len(engine.scheduler.running) == len(prompts) and all(
            s.num_output_tokens for s in engine.scheduler.running
        )
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if full:
            seconds += dt
            tokens += sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
            steps += 1
    return seconds, tokens, steps


def mask_cost(llm: LLM, batch: int, steps: int) -> list[float]:
    """fill + apply for `batch` constrained rows along a real JSON document, on [batch, vocab] logits."""
    engine = llm.engine
    vocab = engine.arch.vocab_size
    spec = GuidedSpec.json_schema(SCHEMA, "response_format")
    seqs = []
    for _ in range(batch):
        seq = Sequence([1], SamplingParams(guided=spec))
        seq.guided = engine.guided.new_state(spec)
        seqs.append(seq)
    doc = engine.tokenizer.encode(DOC, add_special_tokens=False)[:steps]
    times = []
    for tok in doc:
        logits = torch.randn(batch, vocab)
        t = time.perf_counter()
        apply_logit_rules(logits, seqs)
        times.append(time.perf_counter() - t)
        for s in seqs:
            s.guided.accept(tok)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--skip-libraries", action="store_true")
    ap.add_argument("--walks", type=int, default=4, help="random walks per schema and library")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}  torch threads: {torch.get_num_threads()}", flush=True)
    llm = LLM(model=args.model, max_num_seqs=args.batch, max_model_len=512, kv_cache_gb=0.5)
    tok, vocab = llm.engine.tokenizer, llm.engine.arch.vocab_size
    eos = llm.engine.arch.eos_token_ids[0]
    if not args.skip_libraries:
        compare_libraries(tok, vocab, eos, args.batch, args.walks)
    assert llm.engine.guided.available
    prompts = [tok.encode(f"Describe person number {i} as JSON:") for i in range(args.batch)]
    free = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    guided = SamplingParams(
        temperature=0,
        max_tokens=args.steps,
        guided=GuidedSpec.json_schema(
            {"type": "array", "items": {"type": "integer"}, "minItems": 64}, "response_format"
        ),
    )
    decode_steps(llm, prompts[:4], free)  # warm-up
    base_s, base_n, base_steps = decode_steps(llm, prompts, free)
    g_s, g_n, g_steps = decode_steps(llm, prompts, guided)
    masks = mask_cost(llm, args.batch, args.steps)
    step, g_step = base_s / max(1, base_steps), g_s / max(1, g_steps)
    print(f"\n== engine: {args.model}, batch {args.batch}, {args.steps} decode steps ==")
    print(f"unconstrained decode: {base_n / base_s:.1f} tok/s, {step * 1e3:.1f} ms/step ({base_steps} steps)")
    print(
        f"all rows constrained: {g_n / g_s:.1f} tok/s, {g_step * 1e3:.1f} ms/step ({g_steps} steps): "
        f"{g_step / step - 1:+.1%} per step"
    )
    print(f"mask work alone (fill + apply, {args.batch} rows): {ms(masks)} per step")
    print(f"mask cost / decode step: {statistics.mean(masks) / step:.1%} (goal < 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
