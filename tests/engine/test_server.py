"""The engine server over real HTTP: a real `python -m llmdeploy.engine` process on a tiny random Llama."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from llmdeploy.engine import AsyncLLMEngine, EngineConfig
from llmdeploy.engine.chat import chat_prompt_ids
from llmdeploy.engine.errors import RequestFailedError
from llmdeploy.engine.server import create_app
from llmdeploy.engine.serving import TokenTexts
from llmdeploy.openai_api.errors import OpenAIError
from llmdeploy.openai_api.schemas import ChatMessage
from tests.helpers.procs import ServerProcess, free_port

ALIAS = "tiny-chat"
MAX_MODEL_LEN = 512
ENGINE_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "64",
    "--kv-cache-gb",
    "0.01",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--seed",
    "0",
]
CHAT = [{"role": "user", "content": "Hello world! How are you today?"}]


def start_engine(model: Path, log_path: Path, *extra: str) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "llmdeploy.engine",
        "--model",
        str(model),
        "--served-alias",
        ALIAS,
        "--port",
        str(port),
        *ENGINE_ARGS,
        *extra,
    ]
    return ServerProcess(args, f"{url}/health", log_path).start(), url


@pytest.fixture(scope="module")
def server(shared_engine):
    return shared_engine()


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[1]


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def sse_events(resp: httpx.Response) -> list[dict | None]:
    """Every `data:` payload in order; None stands for [DONE]."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(None if payload == "[DONE]" else json.loads(payload))
    return out


def stream(client: httpx.Client, path: str, body: dict) -> list[dict | None]:
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_events(resp)


def assert_error(resp: httpx.Response, status: int, code: str | None, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param, err
    assert err["message"]
    return err


def wait_idle(client: httpx.Client, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        load = client.get("/load").json()
        if load["running"] == 0 and load["waiting"] == 0 and load["free_blocks"] == load["total_blocks"]:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {load}")
        time.sleep(0.1)


# ---- happy paths ------------------------------------------------------------------------------------------


def test_chat_response_shape_usage_and_request_id(client):
    resp = client.post(
        "/v1/chat/completions", json={"model": ALIAS, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"]
    body = resp.json()
    assert (
        body["object"] == "chat.completion" and body["model"] == ALIAS and body["id"].startswith("chatcmpl-")
    )
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    prompt_ids = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_client_request_id_is_echoed(client):
    resp = client.get("/v1/models", headers={"x-request-id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    assert client.get("/health").headers["x-request-id"] != "abc-123"


def test_max_tokens_ends_with_length(client):
    body = {
        "model": ALIAS,
        "prompt": "The quick brown fox",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert (
        client.post("/tokenize", json={"prompt": choice["text"], "add_special_tokens": False}).json()["count"]
        <= 6
    )


def test_chat_stream_matches_non_stream_and_first_chunk_has_role(client):
    body = {"model": ALIAS, "messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    events = stream(client, "/v1/chat/completions", body)
    assert events[-1] is None and all(e is not None for e in events[:-1])
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == ALIAS for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "usage" not in chunks[-1]


def test_completion_stream_with_include_usage(client):
    body = {
        "model": ALIAS,
        "prompt": "Paris is the capital",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    full = client.post("/v1/completions", json={**body, "stream_options": None}).json()
    events = stream(client, "/v1/completions", body)
    assert events[-1] is None
    *chunks, last = events[:-1]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert last["choices"] == [] and last["usage"] == full["usage"]
    assert last["usage"]["completion_tokens"] == 10


def test_n_choices_are_indexed(client):
    body = {"model": ALIAS, "messages": CHAT, "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 1}
    resp = client.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") for c in resp["choices"])
    assert 3 <= resp["usage"]["completion_tokens"] <= 18
    chunks = [e for e in stream(client, "/v1/chat/completions", body) if e is not None]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1, 2]


def test_multiple_prompts_in_one_completion(client):
    body = {
        "model": ALIAS,
        "prompt": ["Hello world", "The quick brown fox"],
        "max_tokens": 4,
        "n": 2,
        "temperature": 0,
    }
    resp = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    single = client.post("/v1/completions", json={**body, "prompt": "The quick brown fox", "n": 1}).json()
    assert resp["choices"][2]["text"] == single["choices"][0]["text"]  # greedy: n copies are identical


def test_chat_logprobs_shape(client):
    body = {
        "model": ALIAS,
        "messages": CHAT,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["logprob"] <= 0 and len(item["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert item["top_logprobs"][0]["token"] == item["token"]
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"], abs=1e-4)
    assert b"".join(bytes(i["bytes"]) for i in content).decode() == choice["message"]["content"]
    chunks = [e for e in stream(client, "/v1/chat/completions", body) if e is not None]
    streamed = [
        i for c in chunks if c["choices"][0]["logprobs"] for i in c["choices"][0]["logprobs"]["content"]
    ]
    assert [i["token"] for i in streamed] == [i["token"] for i in content]


def test_completion_legacy_logprobs_shape(client):
    body = {
        "model": ALIAS,
        "prompt": "Hello",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(t) <= 2 and lp["tokens"][i] in t for i, t in enumerate(lp["top_logprobs"]))
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == choice["text"]


def test_echo_prepends_the_prompt(client):
    body = {"model": ALIAS, "prompt": "Hello world", "max_tokens": 3, "temperature": 0, "echo": True}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith("Hello world") and len(text) > len("Hello world")
    chunks = [e for e in stream(client, "/v1/completions", body) if e is not None]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_stop_string_is_not_leaked_in_the_stream(client):
    body = {
        "model": ALIAS,
        "prompt": "The quick brown fox",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert len(full) >= 8, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    for path_body in ({**body, "stop": [stop]},):
        resp = client.post("/v1/completions", json=path_body).json()["choices"][0]
        assert resp["text"] == expected and resp["finish_reason"] == "stop" and resp["stop_reason"] == stop
        chunks = [e for e in stream(client, "/v1/completions", path_body) if e is not None]
        pieces = [c["choices"][0]["text"] for c in chunks]
        assert "".join(pieces) == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_unknown_fields_are_tolerated(client):
    body = {
        "model": ALIAS,
        "messages": CHAT,
        "max_tokens": 2,
        "some_future_field": {"x": 1},
        "parallel_tool_calls": False,
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_concurrent_requests_match_their_solo_results(client, url):
    prompts = [f"Hello world {i} " * (1 + i % 5) for i in range(12)]
    bodies = [
        {"model": ALIAS, "prompt": p, "max_tokens": 8 + i, "temperature": 0} for i, p in enumerate(prompts)
    ]
    solo = [client.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:

            async def one(i: int, body: dict) -> str:
                if i % 2:  # half of them streamed
                    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                        lines = [line async for line in resp.aiter_lines() if line.startswith("data: {")]
                    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)
                return (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]

            return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))

    assert asyncio.run(together()) == solo  # greedy output does not depend on what else is in the batch
    wait_idle(client)


def test_prompts_are_not_logged_by_default(client, server):
    marker = "zebra-unicorn-marker"
    client.post("/v1/completions", json={"model": ALIAS, "prompt": marker, "max_tokens": 2})
    client.post("/v1/completions", json={"model": "nope", "prompt": marker})
    client.post("/v1/completions", json={"model": ALIAS, "prompt": marker, "max_tokens": "x"})
    logs = server[0].log_path.read_text(errors="replace")
    assert "prompt_tokens=" in logs  # requests are logged, with sizes only
    assert marker not in logs


# ---- errors -----------------------------------------------------------------------------------------------


def test_invalid_json(client):
    resp = client.post(
        "/v1/chat/completions",
        content=b'{"model": "tiny-chat", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_error(resp, 400, "invalid_json", None)


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"null", b"42"])
def test_body_that_is_not_an_object(client, body):
    assert_error(client.post("/v1/completions", content=body), 400, "invalid_body", None)


def test_wrong_model_is_404(client):
    resp = client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": CHAT})
    err = assert_error(resp, 404, "model_not_found", "model")
    assert "gpt-4o" in err["message"]
    assert_error(client.get("/v1/models/gpt-4o"), 404, "model_not_found", "model")


def test_prompt_too_long(client):
    long_chat = [{"role": "user", "content": "hello " * 1000}]
    resp = client.post("/v1/chat/completions", json={"model": ALIAS, "messages": long_chat, "max_tokens": 4})
    assert_error(resp, 400, "context_length_exceeded", "messages")
    resp = client.post(
        "/v1/completions", json={"model": ALIAS, "prompt": "hello " * 1000, "max_tokens": 4, "stream": True}
    )
    assert_error(resp, 400, "context_length_exceeded", "prompt")


def test_prompt_plus_max_tokens_over_max_model_len(client):
    resp = client.post(
        "/v1/completions", json={"model": ALIAS, "prompt": "Hello world", "max_tokens": MAX_MODEL_LEN}
    )
    err = assert_error(resp, 400, "context_length_exceeded", "prompt")
    assert str(MAX_MODEL_LEN) in err["message"]


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", 5, "temperature"),
        ("temperature", "hot", "temperature"),
        ("max_tokens", "ten", "max_tokens"),
        ("max_tokens", 0, "max_tokens"),
        ("top_p", 0, "top_p"),
        ("n", 0, "n"),
        ("stop", ["a"] * 20, "stop"),
        ("messages", "hi", "messages"),
        ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ],
)
def test_bad_parameter_names_its_param(client, field, value, param):
    body = {"model": ALIAS, "messages": CHAT, "max_tokens": 2, field: value}
    assert_error(client.post("/v1/chat/completions", json=body), 400, None, param)


def test_engine_param_check_names_its_param(client):
    body = {"model": ALIAS, "messages": CHAT, "max_tokens": 2, "min_tokens": 5}
    assert_error(client.post("/v1/chat/completions", json=body), 400, None, "min_tokens")


def test_suffix_is_rejected_and_echo_with_logprobs_served(client):
    resp = client.post("/v1/completions", json={"model": ALIAS, "prompt": "Hi", "suffix": "end"})
    assert_error(resp, 400, None, "suffix")
    resp = client.post("/v1/completions", json={"model": ALIAS, "prompt": "Hi", "echo": True, "logprobs": 1})
    assert resp.status_code == 200 and resp.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_missing_model_and_unknown_route(client):
    assert_error(client.post("/v1/chat/completions", json={"messages": CHAT}), 400, None, "model")
    assert client.get("/v1/nope").status_code == 404


def test_bad_requests_do_not_stall_the_engine(client):
    for _ in range(3):
        client.post("/v1/completions", content=b"{")
        client.post("/v1/completions", json={"model": ALIAS, "prompt": "x " * 2000})
    resp = client.post("/v1/completions", json={"model": ALIAS, "prompt": "Hello", "max_tokens": 2})
    assert resp.status_code == 200


# ---- other endpoints --------------------------------------------------------------------------------------


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [ALIAS]
    assert models["data"][0]["object"] == "model"
    assert client.get(f"/v1/models/{ALIAS}").json()["id"] == ALIAS
    assert client.get("/health").status_code == 200


def test_load_fields(client):
    load = wait_idle(client)
    assert set(load) >= {
        "waiting",
        "running",
        "free_blocks",
        "total_blocks",
        "block_size",
        "pending_prefill_tokens",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "predicted_queue_wait_ms",
        "kv_usage",
        "max_model_len",
        "max_num_seqs",
        "num_preemptions",
        "ready",
    }
    assert load["ready"] is True and load["max_model_len"] == MAX_MODEL_LEN and load["max_num_seqs"] == 8
    assert load["block_size"] == 16 and load["total_blocks"] > 0


METRIC_NAMES = [  # the stable metrics contract: renaming any of these breaks users' dashboards
    "llmdeploy:num_requests_running",
    "llmdeploy:num_requests_waiting",
    "llmdeploy:kv_cache_usage_perc",
    "llmdeploy:prefix_cache_queries_total",
    "llmdeploy:prefix_cache_hits_total",
    "llmdeploy:num_preemptions_total",
    "llmdeploy:prompt_tokens_total",
    "llmdeploy:generation_tokens_total",
    "llmdeploy:time_to_first_token_seconds_bucket",
    "llmdeploy:inter_token_latency_seconds_bucket",
    "llmdeploy:e2e_request_latency_seconds_bucket",
    "llmdeploy:request_queue_time_seconds_bucket",
    "llmdeploy:request_success_total",
]


def metric_samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_names_labels_and_counts(client):
    before = metric_samples(client.get("/metrics").text)
    body = {"model": ALIAS, "prompt": "Hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    after = metric_samples(resp.text)
    names = {k.split("{")[0] for k in after}
    missing = [n for n in METRIC_NAMES if n not in names]
    assert not missing, missing
    label = f'model_name="{ALIAS}"'
    assert all(label in k for k in after if k.startswith("llmdeploy:"))
    key = f"llmdeploy:generation_tokens_total{{{label}}}"
    assert after[key] - before.get(key, 0) >= 5
    ok = f'llmdeploy:request_success_total{{finished_reason="length",{label}}}'
    assert after[ok] - before.get(ok, 0) == 1
    count = f"llmdeploy:e2e_request_latency_seconds_count{{{label}}}"
    assert after[count] - before.get(count, 0) == 1
    itl = f"llmdeploy:inter_token_latency_seconds_count{{{label}}}"
    assert after[itl] - before.get(itl, 0) == 4


def test_tokenize_and_detokenize(client):
    resp = client.post("/tokenize", json={"model": ALIAS, "prompt": "Hello world!"}).json()
    assert resp["count"] == len(resp["tokens"]) > 0 and resp["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": resp["tokens"]}).json()["prompt"] == "Hello world!"
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > resp["count"]  # the template's role markers are counted too
    assert_error(
        client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "model_not_found", "model"
    )
    assert_error(client.post("/tokenize", json={"prompt": "x", "messages": CHAT}), 400, None, None)
    assert_error(client.post("/detokenize", json={"tokens": [10**9]}), 400, None, "tokens")


# ---- disconnects and shutdown -----------------------------------------------------------------------------


def aborted_count(client: httpx.Client) -> float:
    key = f'llmdeploy:request_success_total{{finished_reason="abort",model_name="{ALIAS}"}}'
    return metric_samples(client.get("/metrics").text).get(key, 0.0)


def wait_running(client: httpx.Client, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while (load := client.get("/load").json())["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    return load


# A request that runs for seconds, so a disconnect always lands while it is generating: a wider, deeper
# tiny model (a few ms per token) with room for 2,000 tokens, started once for the disconnect tests.
SLOW_MODEL = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)
LONG = {"model": ALIAS, "prompt": "Hello", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow_engine(tiny_model, tmp_path_factory):
    model = tiny_model("llama", **SLOW_MODEL)
    log = tmp_path_factory.mktemp("slow-engine") / "engine.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "llmdeploy.engine", "--model", str(model), "--served-alias", ALIAS, "--port", str(port)]
    args += ["--max-model-len", "2048", "--kv-cache-gb", "0.05", "--device", "cpu", "--dtype", "float32"]
    proc = ServerProcess(args, f"{url}/health", log).start()
    with httpx.Client(base_url=url, timeout=60) as c:
        yield url, c
    proc.stop()


def test_stream_disconnect_frees_blocks(slow_engine):
    url, client = slow_engine
    wait_idle(client)
    aborted = aborted_count(client)
    with (
        httpx.Client(base_url=url, timeout=30) as other,
        other.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp,
    ):
        lines = resp.iter_lines()  # held: a dropped line iterator would close the connection itself
        first = next(line for line in lines if line.startswith("data: "))
        busy = client.get("/load").json()
        assert busy["running"] == 1 and busy["free_blocks"] < busy["total_blocks"], (first, busy)
    # the connection is closed: the engine must drop the request and free its blocks right away
    wait_idle(client, timeout_s=60)
    assert aborted_count(client) == aborted + 1


def test_non_stream_disconnect_frees_blocks(slow_engine):
    url, client = slow_engine
    wait_idle(client)
    aborted = aborted_count(client)
    payload = json.dumps(LONG).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + payload)
        wait_running(client)
    wait_idle(client, timeout_s=60)
    assert aborted_count(client) == aborted + 1


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


def test_sigterm_drains_in_flight_requests(tiny_llama, tmp_path):
    proc, url = start_engine(tiny_llama, tmp_path / "engine.log", "--drain-timeout", "30", "--log-bodies")
    try:
        # long enough to still be running after the signal
        body = {**LONG, "prompt": "zebra-unicorn-marker", "max_tokens": 400, "n": 8, "stream": True}
        events: list[str] = []
        first = threading.Event()

        def consume() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        consumer = threading.Thread(target=consume)
        consumer.start()
        assert first.wait(30)
        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not refused(url):  # new connections are refused at once ...
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.02)
        assert "[DONE]" not in events  # ... while the in-flight stream goes on
        consumer.join(60)
        assert proc.proc.wait(60) == 0, proc.logs()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finishes == ["length"] * 8
        assert "zebra-unicorn-marker" in proc.log_path.read_text(errors="replace")  # --log-bodies
    finally:
        proc.stop()


# ---- in-process: the real engine with an injected fault ---------------------------------------------------


class FailsAfterFirstOutput:
    """The real engine, except that each request fails right after its first output (a model error mid-stream)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, *args, **kwargs):
        async for out in self.engine.generate(*args, **kwargs):
            yield out
            raise RequestFailedError("injected fault")


def test_engine_failure_mid_stream_ends_with_an_error_event_not_a_stop(tiny_llama):
    engine = AsyncLLMEngine(
        EngineConfig(model=str(tiny_llama), max_model_len=128, kv_cache_gb=0.01, device="cpu")
    )
    app = create_app(FailsAfterFirstOutput(engine), ALIAS, manage_engine=False)
    body = {"model": ALIAS, "prompt": "Hello", "max_tokens": 50, "temperature": 0, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
            assert (await c.get("/health")).status_code == 503  # loop not started yet
            await engine.start()
            try:
                assert (await c.get("/health")).status_code == 200
                resp = await c.post("/v1/completions", json={**body, "stream": True})
                assert resp.status_code == 200
                events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert (
                    chunks[-1]["error"]["type"] == "server_error"
                    and chunks[-1]["error"]["code"] == "internal_error"
                )
                assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
                resp = await c.post("/v1/completions", json=body)
                assert_error(resp, 500, "internal_error", None)
                load = (await c.get("/load")).json()  # the failed requests' blocks are free again
                assert load["running"] == 0 and load["free_blocks"] == load["total_blocks"]
            finally:
                await engine.shutdown()
            assert (await c.get("/health")).status_code == 503

    asyncio.run(scenario())


def test_token_bytes_rebuild_the_text(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = TokenTexts(tokenizer)
    text = "Hello wörld! é 日本 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(texts.get(i)[1]) for i in ids).decode() == text


def test_model_without_chat_template_gets_a_clear_400(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = None
    with pytest.raises(OpenAIError) as e:
        chat_prompt_ids(tokenizer, [ChatMessage(role="user", content="hi")])
    assert e.value.status == 400 and e.value.param == "messages" and e.value.code == "chat_template_missing"
    assert "/v1/completions" in e.value.message
