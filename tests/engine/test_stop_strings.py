"""Incremental detokenization and stop strings: held back while streaming, never leaked."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmdeploy.engine import SamplingParams
from llmdeploy.engine.detokenizer import Detokenizer
from tests.helpers.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def stream(
    tok, text: str, params: SamplingParams, prompt: str = "Hello"
) -> tuple[list[str], Detokenizer, str | None]:
    """Feed text's tokens one at a time as the engine does; returns the deltas handed out."""
    d = Detokenizer(tok, tok.encode(prompt), params)
    deltas, stop = [], None
    for t in tok.encode(text):
        stop = d.add_token(t)
        if stop is not None:
            break
        deltas.append(d.emit(finished=False))
    d.flush() if stop is None else None
    deltas.append(d.emit(finished=True))
    return deltas, d, stop


ALPHABET = "ab cé中🙂x\n"
texts = st.text(alphabet=ALPHABET, min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    text=texts,
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streamed_text_never_leaks_a_stop_string(tok, text, stops, include):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, d, stop = stream(tok, text, params)
    final = d.output_text
    assert "".join(deltas) == final
    emitted = ""
    for delta in deltas:  # everything handed out stays part of the final text: nothing is ever taken back
        emitted += delta
        assert final.startswith(emitted)
        assert "\ufffd" not in delta
    assert text.startswith(final)
    if stop is None:
        assert final == text and not any(s in text for s in stops)
    else:
        cut = final[: len(final) - len(stop)] if include else final
        assert text[len(cut) :].startswith(stop)
        assert not any(s in cut for s in stops)  # nothing before the cut is a stop string
        assert final == cut + (stop if include else "")


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_incremental_text_equals_full_decode(tok, text):
    deltas, d, _ = stream(tok, text, SamplingParams())
    assert "".join(deltas) == text == tok.decode(tok.encode(text))
    assert all("\ufffd" not in x for x in deltas)


def test_hold_back_is_only_what_could_still_match(tok):
    d = Detokenizer(tok, [], SamplingParams(stop=["xyz"]))
    for t in tok.encode("abc x"):
        d.add_token(t)
    assert d.emit(finished=False) == "abc " and d.text.endswith("x")
    for t in tok.encode("a"):
        d.add_token(t)
    assert d.emit(finished=False) == "xa"  # "xa" can no longer become "xyz"


def test_stop_string_spanning_tokens_is_cut(tok):
    deltas, d, stop = stream(tok, "The quick brown fox jumps", SamplingParams(stop=["brown f"]))
    assert stop == "brown f" and d.output_text == "The quick " and "".join(deltas) == "The quick "


def test_include_stop_str_in_output(tok):
    _, d, stop = stream(
        tok, "Hello world! How are you", SamplingParams(stop=["!"], include_stop_str_in_output=True)
    )
    assert stop == "!" and d.output_text == "Hello world!"


def test_earliest_stop_wins(tok):
    _, d, stop = stream(tok, "one two three four", SamplingParams(stop=["four", "two"]))
    assert stop == "two" and d.output_text == "one "


def test_multibyte_characters_are_never_split(tok):
    text = "中文🙂é" * 3
    ids = tok.encode(text)
    assert len(ids) > len(text)  # byte-level: characters span several tokens
    deltas, d, _ = stream(tok, text, SamplingParams())
    assert "".join(deltas) == text and all("\ufffd" not in x for x in deltas)
    assert any(x == "" for x in deltas)  # some tokens had to wait for the rest of their character


# --- through the engine: streaming deltas of a real generation


def test_engine_stream_holds_back_and_stops(tiny_llama):
    from llmdeploy.engine.config import EngineConfig
    from llmdeploy.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=256, kv_cache_gb=0.01))
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown")
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    full = run(engine)["free"]
    text = "".join(full)
    # a stop string from what the model says (its first run of three letters after the start)
    stop = re.search(r"[a-z]{3}", text[4:]).group(0)
    engine.add_request(
        "stopped", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )
    deltas = run(engine)["stopped"]
    cut = text[: text.index(stop)]
    assert "".join(deltas) == cut
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def run(engine) -> dict[str, list[str]]:
    deltas: dict[str, list[str]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.outputs[0].delta_text)
            if out.finished:
                assert out.outputs[0].text == "".join(deltas[out.request_id])
    return deltas
