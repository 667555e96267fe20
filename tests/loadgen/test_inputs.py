"""What bench sends and reads: prompts, datasets, the /metrics names of llmdeploy's own servers, SSE events,
and how the command line, a deployment YAML and a baseline combine into one configuration."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llmdeploy.engine.metrics import ServerMetrics
from llmdeploy.engine.outputs import EngineStats
from llmdeploy.loadgen.client import _read_event, _Reading, error_code, http_error_kind
from llmdeploy.loadgen.config import BenchOptions, ConfigError, api_base, metrics_url, resolve, shown_url
from llmdeploy.loadgen.parse import Mix
from llmdeploy.loadgen.probe import combine, read_gauges, summarize
from llmdeploy.loadgen.workload import DatasetError, Workload, load_dataset, synthetic_text
from llmdeploy.router.metrics import RouterMetrics

# ---- prompts ------------------------------------------------------------------------------------------------


def test_synthetic_prompts_have_the_asked_words_and_differ():
    w = Workload(output_len=32, prompt_len=200, seed=3)
    a, b = w.next(), w.next()
    assert len(a.messages[0]["content"].split()) == 200 and a.max_tokens == 32 and a.kind == "synthetic"
    assert a.messages != b.messages  # a prefix cache cannot serve one from the other
    assert Workload(32, 200, seed=3).next() == a  # seeded


def test_synthetic_words_are_about_one_token_each_for_a_bpe_vocabulary(tiny_llama):
    """The approximation --help states, checked with a real byte-level BPE (the tiny test tokenizer's merges
    come from a small corpus, so it is looser than a real model's)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = synthetic_text(500, random.Random(0))
    n = len(tok(text)["input_ids"])
    assert 500 <= n <= 500 * 3.5


def test_mix_sends_long_and_short_prompts_in_the_asked_share():
    w = Workload(16, mix=Mix(300, 20, 0.2), seed=1)
    reqs = [w.next() for _ in range(1000)]
    longs = [r for r in reqs if r.kind == "long"]
    assert len(longs) == pytest.approx(200, abs=40)
    assert all(len(r.messages[0]["content"].split()) == 300 for r in longs)
    assert all(len(r.messages[0]["content"].split()) == 20 for r in reqs if r.kind == "short")


def test_dataset_lines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "Hi"}\n\n{"messages": [{"role": "user", "content": "Yo"}], "max_tokens": 5}\n')
    items = load_dataset(f)
    assert [i.messages for i in items] == [
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Yo"}],
    ]
    w = Workload(output_len=9, dataset=items)
    assert [w.next().max_tokens for _ in range(3)] == [9, 5, 9]  # cycles; its own max_tokens wins


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"prompt": "a", "messages": []}', "exactly one"),
        ("{}", "exactly one"),
        ('{"prompt": ""}', "non-empty"),
        ('{"messages": [{"content": "x"}]}', "role"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
        ('{"prompt": "a", "max_tokens": true}', "max_tokens"),
    ],
)
def test_bad_dataset_lines_name_file_and_line(tmp_path, line, message):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=rf"d.jsonl:2: .*{message}"):
        load_dataset(f)


def test_empty_or_missing_dataset(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no requests"):
        load_dataset(tmp_path / "e.jsonl")
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(tmp_path / "nope.jsonl")


# ---- /metrics -----------------------------------------------------------------------------------------------


def test_reads_the_engines_and_the_routers_own_metric_names():
    stats = EngineStats(
        running=3,
        waiting=5,
        kv_usage=0.42,
        free_blocks=10,
        total_blocks=20,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
    )
    engine_text = ServerMetrics(lambda: stats, "m").render()[0].decode()
    assert read_gauges(engine_text) == {"kv_usage": 0.42, "waiting": 5, "running": 3}
    rm = RouterMetrics()
    rm.inflight.inc(7)
    assert read_gauges(rm.render().decode()) == {"router_inflight": 7}
    vllm = '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="x"} 0.5\n'
    assert read_gauges(vllm) == {"kv_usage": 0.5}
    assert read_gauges("# nothing here\nother_metric 1\n") == {}


def test_samples_combine_and_summarize():
    moment = combine(
        [{"kv_usage": 0.2, "waiting": 1}, {"kv_usage": 0.6, "waiting": 2}, {"router_inflight": 4}]
    )
    assert moment == {"kv_usage": 0.6, "waiting": 3, "router_inflight": 4}
    s = summarize([moment, {"kv_usage": 0.2, "waiting": 1}], ["u"], {})
    assert (
        s["kv_usage"] == {"mean": pytest.approx(0.4), "max": 0.6}
        and s["running"] is None
        and s["samples"] == 2
    )
    assert summarize([], [], {"u": "HTTP 404"}) is None


# ---- the client's reading of answers -----------------------------------------------------------------------


def test_sse_events_give_first_token_usage_and_errors():
    r = _Reading()
    _read_event(
        json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), r, 0.1
    )
    assert r.ttft_s is None  # the role chunk is not a token
    _read_event(json.dumps({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}), r, 0.2)
    _read_event(
        json.dumps({"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop"}]}),
        r,
        0.3,
    )
    _read_event(json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}), r, 0.4)
    _read_event("[DONE]", r, 0.5)
    assert (r.ttft_s, r.chunks, r.usage["completion_tokens"], r.finished, r.done) == (0.2, 2, 3, True, True)
    e = _Reading()
    _read_event(
        json.dumps({"error": {"message": "boom", "type": "server_error", "code": "internal_error"}}), e, 0.1
    )
    assert e.error == "stream_error:internal_error"
    with pytest.raises(ValueError):
        _read_event("not json", _Reading(), 0.1)


def test_error_kinds():
    assert http_error_kind(
        429, b'{"error": {"message": "x", "type": "requests", "code": "rate_limit_exceeded"}}'
    ) == ("http_429:rate_limit_exceeded")
    assert http_error_kind(503, b'{"error": {"message": "x", "type": "overloaded"}}') == "http_503:overloaded"
    assert http_error_kind(502, b"<html>bad gateway</html>") == "http_502"
    assert error_code({"code": 336501, "message": "flat"}) == "336501"


# ---- configuration -----------------------------------------------------------------------------------------


def test_urls():
    assert api_base("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert api_base("https://h/v1/") == "https://h/v1" and api_base("https://qianfan.baidubce.com/v2") == (
        "https://qianfan.baidubce.com/v2"
    )
    assert metrics_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/metrics"
    assert shown_url("http://user:secret@h:1/v1") == "http://h:1/v1"
    with pytest.raises(ConfigError):
        api_base("127.0.0.1:8000")


def _resolve(env=None, **kw):
    return resolve(BenchOptions(**kw), env or {})


def test_defaults_and_flags():
    r = _resolve(url="http://h:1", model="m")
    c = r.config
    assert (c.mode, c.levels, c.stop.duration_s, c.target.stream) == (
        "concurrency",
        [1, 4, 16, 32],
        30.0,
        True,
    )
    assert c.workload.describe() == {"kind": "synthetic", "prompt_len": 128, "output_len": 128}
    assert c.sla.ttft_p99_ms is None and c.metrics_urls == ["http://h:1/metrics"]
    r = _resolve({"K": "sk-secret"}, url="http://h:1", model="m", api_key_env="K", rate="5,2", requests=9)
    assert r.config.target.headers == {"Authorization": "Bearer sk-secret"} and "sk-secret" not in repr(
        r.config
    )
    assert (r.config.mode, r.config.levels, r.config.stop.requests) == ("rate", [2.0, 5.0], 9)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({}, "--url and --model"),
        ({"concurrency": "1", "rate": "2"}, "not both"),
        ({"duration": "1s", "requests": 3}, "not both"),
        ({"concurrency": "0"}, "--concurrency"),
        ({"rate": "fast"}, "--rate"),
        ({"api_key_env": "UNSET_VAR"}, "UNSET_VAR is not set"),
        ({"burst": "3x:5s"}, "--ttft-p99-ms"),
        ({"burst": "3x:5s", "ttft_p99_ms": 100, "stream": False}, "--no-stream"),
        ({"burst": "3x", "ttft_p99_ms": 100}, "--burst"),
        ({"chart": Path("c.svg")}, ".png or .html"),
        ({"json_out": Path("/nonexistent-dir/x.json")}, "does not exist"),
        ({"mix": "10:1", "prompt_len": 5}, "not both"),
        ({"mix_ratio": "1:2"}, "--mix"),
        ({"tolerance": "lots"}, "--tolerance"),
        ({"ttft_p99_ms": -1}, "> 0"),
        ({"sla_from": Path("/nonexistent.yaml")}, "--sla-from"),
        ({"compare": Path("/nonexistent.json")}, "--compare"),
        ({"timeout": "soon"}, "--timeout"),
        ({"requests": 0}, "--requests"),
    ],
)
def test_invalid_input_is_a_config_error(kw, message):
    base = {} if "--url" in message else {"url": "http://h:1", "model": "m"}
    with pytest.raises(ConfigError, match=message):
        _resolve(**{**base, **kw})


def test_sla_and_target_from_a_deployment_yaml(tmp_path, tiny_llama):
    spec = tmp_path / "llmdeploy.yaml"
    spec.write_text(
        f"model: {{path: {tiny_llama}, served_alias: chat}}\nlisten: 0.0.0.0:8123\n"
        "auth: {keys: [{name: app, key_env: BENCH_KEY}]}\nsla: {ttft_p99_ms: 750, tpot_p99_ms: 90}\n"
    )
    c = _resolve({"BENCH_KEY": "sk-x"}, sla_from=spec).config
    assert (c.url, c.target.model, c.target.headers["Authorization"]) == (
        "http://127.0.0.1:8123",
        "chat",
        "Bearer sk-x",
    )
    assert (c.sla.ttft_p99_ms, c.sla.tpot_p99_ms, c.sla.source) == (750, 90, str(spec))
    c = _resolve(
        {"BENCH_KEY": "sk-x"}, sla_from=spec, ttft_p99_ms=300, url="http://other:1", model="x"
    ).config
    assert (c.sla.ttft_p99_ms, c.sla.tpot_p99_ms, c.url) == (300, 90, "http://other:1")


def test_a_yaml_invalid_elsewhere_still_gives_its_sla(tmp_path):
    spec = tmp_path / "remote.yaml"
    spec.write_text("model: {path: /only/on/the/server}\nsla: {ttft_p99_ms: 400}\n")
    r = _resolve(sla_from=spec, url="http://h:1", model="m")
    assert r.config.sla.ttft_p99_ms == 400 and r.config.sla.tpot_p99_ms == 200  # the spec's default
    assert any("outside sla" in n for n in r.notes)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: /only/on/the/server}\nsla: {ttft_p99_ms: -4}\n")
    with pytest.raises(ConfigError, match="sla.ttft_p99_ms"):
        _resolve(sla_from=bad, url="http://h:1", model="m")


def test_compare_reruns_the_baselines_load(tmp_path):
    base = {
        "tool": "llmdeploy bench",
        "levels": [],
        "target": {"url": "http://b:2", "model": "bm", "api_key_env": None},
        "load": {
            "mode": "rate",
            "levels": [1.0, 3.0],
            "duration_s": None,
            "requests": 40,
            "stream": False,
            "prompts": {
                "kind": "mix",
                "long_len": 900,
                "short_len": 50,
                "long_share": 0.25,
                "output_len": 64,
            },
        },
        "sla": {"ttft_p99_ms": 800, "tpot_p99_ms": None},
    }
    f = tmp_path / "base.json"
    f.write_text(json.dumps(base))
    r = _resolve(compare=f, tolerance="5%")
    c = r.config
    assert (c.url, c.target.model, c.mode, c.levels, c.stop.requests, c.target.stream) == (
        "http://b:2",
        "bm",
        "rate",
        [1.0, 3.0],
        40,
        False,
    )
    assert c.workload.describe()["long_len"] == 900 and c.workload.output_len == 64
    assert c.sla.ttft_p99_ms == 800 and r.tolerance == pytest.approx(0.05)
    # flags win over the baseline
    c = _resolve(compare=f, concurrency="2", prompt_len=10).config
    assert (c.mode, c.levels, c.workload.describe()["kind"]) == ("concurrency", [2.0], "synthetic")
    f.write_text('{"some": "json"}')
    with pytest.raises(ConfigError, match="not a `llmdeploy bench --json` report"):
        _resolve(compare=f)
