"""A real OpenAI-compatible server for tests: the cloud (and, serving /load, a stand-in local engine).

Run as a process: `python tests/helpers/fake_cloud.py --port N [--tls-cert C --tls-key K]`; the key it expects
comes from the env var FAKE_CLOUD_EXPECTED_KEY (absent: any key is accepted). Tests steer it over HTTP:

  POST /_control  {"delay_s", "chunk_delay_s", "reply", "cut_after", "stall_after", "error_after",
                   "error_event", "no_permission", "load": {...}, "fail": [{"status", "body", "headers", "times"}]}
  POST /_reset    back to defaults, requests and counters cleared
  GET  /_requests what arrived: path, model, stream, headers (authorization/api-key removed), auth_ok, body
  GET  /_stats    {"requests", "active", "cancelled", "completed"}

`fail` entries answer the next requests in order (each `times` times, default 1) with that status, body and
headers: Qianfan shapes, HTTP 200 with an error body (code 336501), vLLM nested and flat shapes, 429 with
Retry-After. Streams can be cut after k chunks (connection dropped), stall after k chunks, or carry an error
event after k chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmdeploy.openai_api.headers import ENGINE_TTFT_HEADER

DEFAULTS: dict[str, Any] = {
    "delay_s": 0.0,
    "chunk_delay_s": 0.0,
    "reply": "Hello from the fake cloud",
    "cut_after": None,
    "stall_after": None,
    "error_after": None,
    "error_event": {
        "error": {"message": "upstream broke mid-stream", "type": "server_error", "code": "internal_error"}
    },
    "no_permission": False,
    "load": {
        "waiting": 0,
        "running": 0,
        "free_blocks": 1000,
        "total_blocks": 1024,
        "block_size": 16,
        "pending_prefill_tokens": 0,
        "prefill_tokens_per_s": 10000.0,
        "decode_tokens_per_s": 100.0,
        "predicted_queue_wait_ms": 0.0,
        "kv_usage": 0.0,
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "num_preemptions": 0,
        "ready": True,
    },
    "fail": [],
    # tool calls and JSON mode (issue 16): the dialect of the tool-call answers, JSON wrapped in a fence
    "tool_dialect": "openai",  # openai | legacy (function_call, object arguments) | loose (no ids/index)
    "json_fence": False,
}
SECRET_HEADERS = {"authorization", "api-key"}


class State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.cfg = json.loads(json.dumps(DEFAULTS))
        self.requests: list[dict[str, Any]] = []
        self.stats = {"requests": 0, "active": 0, "cancelled": 0, "completed": 0}

    def next_failure(self) -> dict[str, Any] | None:
        fails = self.cfg["fail"]
        if not fails:
            return None
        f = fails[0]
        f["times"] = f.get("times", 1) - 1
        if f["times"] <= 0:
            fails.pop(0)
        return f


def create_app(expected_key: str | None = None) -> FastAPI:
    app = FastAPI()
    st = State()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/load")
    async def load():
        return st.cfg["load"]

    @app.post("/_control")
    async def control(request: Request):
        st.cfg.update(await request.json())
        return {"ok": True}

    @app.post("/_reset")
    async def reset():
        st.reset()
        return {"ok": True}

    @app.get("/_requests")
    async def requests():
        return st.requests

    @app.get("/_stats")
    async def stats():
        return st.stats

    @app.get("/{ver}/models")
    async def models(ver: str):
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "fake"}]}

    async def serve(request: Request, kind: str) -> Response:
        arrived = time.monotonic()
        body = await request.json()
        presented = request.headers.get("authorization", "")
        auth_ok = expected_key is None or presented == f"Bearer {expected_key}"
        st.stats["requests"] += 1
        st.requests.append(
            {
                "path": request.url.path,
                "model": body.get("model"),
                "stream": bool(body.get("stream")),
                "headers": {k: v for k, v in request.headers.items() if k.lower() not in SECRET_HEADERS},
                "auth_ok": auth_ok,
                "body": body,
                "time": time.time(),
            }
        )
        if not auth_ok:
            return JSONResponse(
                {
                    "error": {
                        "code": "invalid_iam_token",
                        "message": "IAM token invalid",
                        "type": "invalid_request_error",
                    }
                },
                401,
            )
        if st.cfg["no_permission"]:
            return JSONResponse(
                {
                    "error": {
                        "code": "invalid_model",
                        "message": "No permission to use the model",
                        "type": "invalid_request_error",
                    }
                },
                401,
            )
        if st.cfg["delay_s"]:
            await asyncio.sleep(st.cfg["delay_s"])
        fail = st.next_failure()
        if fail is not None:
            content = fail.get("body", {"error": {"message": "fake failure", "type": "server_error"}})
            data = json.dumps(content) if not isinstance(content, str) else content
            return Response(
                data,
                fail.get("status", 500),
                headers=fail.get("headers") or {},
                media_type="application/json",
            )
        structured = structured_reply(body, st.cfg)
        if structured is not None and body.get("stream"):
            return StreamingResponse(
                structured_stream(kind, structured, body, st.cfg), media_type="text/event-stream"
            )
        if structured is not None:
            st.stats["completed"] += 1
            return JSONResponse(structured_answer(kind, structured, body, st.cfg))
        words = st.cfg["reply"].split(" ")
        words = [w if i == 0 else " " + w for i, w in enumerate(words)]
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        if limit:
            words = words[: int(limit)]
        prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt") or "")) // 4 + 1
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(words),
            "total_tokens": prompt_tokens + len(words),
        }
        rid, created, model = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time()), body.get("model")
        if not body.get("stream"):
            if kind == "chat":
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(words)},
                    "finish_reason": "stop",
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": "".join(words), "finish_reason": "stop", "logprobs": None}
                obj = "text_completion"
            st.stats["completed"] += 1
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                },
                # as our engines do: its own time to the first token (all of it here, the answer is instant)
                headers={ENGINE_TTFT_HEADER: f"{(time.monotonic() - arrived) * 1000:.1f}"},
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            stream(kind, words, rid, created, model, usage, include_usage), media_type="text/event-stream"
        )

    async def stream(kind, words, rid, created, model, usage, include_usage):
        cfg = st.cfg
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta_text: str | None, finish: str | None = None, role: bool = False) -> bytes:
            if kind == "chat":
                delta = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({"content": delta_text} if delta_text else {})
                )
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [choice]})}\n\n".encode()

        st.stats["active"] += 1
        try:
            if kind == "chat":
                yield chunk(None, role=True)
            for i, w in enumerate(words):
                if cfg["cut_after"] is not None and i >= cfg["cut_after"]:
                    raise ConnectionAbortedError("fake cloud cuts the stream")
                if cfg["stall_after"] is not None and i >= cfg["stall_after"]:
                    await asyncio.sleep(3600)
                if cfg["error_after"] is not None and i >= cfg["error_after"]:
                    yield f"data: {json.dumps(cfg['error_event'])}\n\n".encode()
                    return
                if cfg["chunk_delay_s"]:
                    await asyncio.sleep(cfg["chunk_delay_s"])
                yield chunk(w)
            yield chunk(None, finish="stop")
            if include_usage:
                tail = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(tail)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            st.stats["completed"] += 1
        except asyncio.CancelledError:
            st.stats["cancelled"] += 1
            raise
        finally:
            st.stats["active"] -= 1

    @app.post("/{ver}/chat/completions")
    async def chat(ver: str, request: Request):
        return await serve(request, "chat")

    @app.post("/{ver}/completions")
    async def completions(ver: str, request: Request):
        return await serve(request, "text")

    return app


# ---- tool calls and JSON mode, in the provider's shape ----------------------------------------------------


def sample(schema: Any) -> Any:
    """A small value that fits a JSON schema (the kinds tests send)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return sample(schema[key][0])
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        return {k: sample(v) for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [sample(schema.get("items") or {}) for _ in range(schema.get("minItems", 1))]
    return {"string": "text", "integer": schema.get("minimum", 1), "number": 1.5, "boolean": True}.get(kind)


def structured_reply(body: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any] | None:
    """{"call": (name, args)} or {"json": text} when the request asks for a tool call or JSON, else None."""
    tools = [t.get("function") or {} for t in body.get("tools") or []]
    choice = body.get("tool_choice")
    if tools and choice not in (None, "none", "auto"):
        name = choice["function"]["name"] if isinstance(choice, dict) else tools[0].get("name")
        fn = next(t for t in tools if t.get("name") == name)
        return {"call": (name, sample(fn.get("parameters") or {"type": "object"}))}
    rf = body.get("response_format") or {}
    if rf.get("type") in ("json_object", "json_schema"):
        schema = (rf.get("json_schema") or {}).get("schema") if rf["type"] == "json_schema" else None
        text = json.dumps(sample(schema) if schema else {"answer": cfg["reply"]})
        return {"json": f"```json\n{text}\n```" if cfg["json_fence"] else text}
    return None


def _usage(body: dict[str, Any]) -> dict[str, int]:
    prompt = len(json.dumps(body.get("messages") or body.get("prompt") or "")) // 4 + 1
    return {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}


def structured_answer(kind: str, reply: dict[str, Any], body: dict[str, Any], cfg: dict[str, Any]) -> dict:
    if "json" in reply:
        msg: dict[str, Any] = {"role": "assistant", "content": reply["json"]}
        finish = "stop"
    else:
        name, args = reply["call"]
        dialect = cfg["tool_dialect"]
        if dialect == "legacy":
            msg, finish = (
                {"role": "assistant", "content": "", "function_call": {"name": name, "arguments": args}},
                "function_call",
            )
        elif dialect == "loose":
            msg, finish = (
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": name, "arguments": args}}],
                },
                "stop",
            )
        else:
            call = {
                "id": f"call_{uuid.uuid4().hex[:8]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            msg, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
        "usage": _usage(body),
    }


async def structured_stream(kind: str, reply: dict[str, Any], body: dict[str, Any], cfg: dict[str, Any]):
    head = {
        "id": f"cmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.get("model"),
    }

    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return f"data: {json.dumps({**head, 'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()

    yield event({"role": "assistant", "content": ""})
    if "json" in reply:
        text = reply["json"]
        for i in range(0, len(text), 7):
            yield event({"content": text[i : i + 7]})
        yield event({}, "stop")
    else:
        name, args = reply["call"]
        text = json.dumps(args)
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        dialect = cfg["tool_dialect"]
        if dialect == "legacy":
            yield event({"function_call": {"name": name, "arguments": ""}})
            for p in pieces:
                yield event({"function_call": {"arguments": p}})
            yield event({}, "function_call")
        elif dialect == "loose":
            yield event({"content": "", "tool_calls": [{"function": {"name": name}}]})
            for p in pieces:
                yield event({"tool_calls": [{"function": {"arguments": p}}]})
            yield event({}, "stop")
        else:
            first = {
                "index": 0,
                "id": f"call_{uuid.uuid4().hex[:8]}",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            yield event({"tool_calls": [first]})
            for p in pieces:
                yield event({"tool_calls": [{"index": 0, "function": {"arguments": p}}]})
            yield event({}, "tool_calls")
    if (body.get("stream_options") or {}).get("include_usage"):
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(body)})}\n\n".encode()
    yield b"data: [DONE]\n\n"


class FakeCloud:
    """Test-side handle of a running fake: start/stop it as a real process and steer it."""

    def __init__(self, tmp_dir: Path, expected_key: str | None = None, tls: tuple[str, str] | None = None):
        from tests.helpers.procs import ServerProcess, free_port

        self.port = free_port()
        scheme = "https" if tls else "http"
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        args = [str(Path(__file__).resolve()), "--port", str(self.port)]
        if tls:
            args += ["--tls-cert", tls[0], "--tls-key", tls[1]]
        env = {"FAKE_CLOUD_EXPECTED_KEY": expected_key} if expected_key else {}
        self.proc = ServerProcess(
            args, f"{self.base}/health", Path(tmp_dir) / f"fake-cloud-{self.port}.log", env=env, timeout_s=60
        )
        self.http = httpx.Client(base_url=self.base, timeout=60, verify=False)

    def start(self) -> FakeCloud:
        self.proc.start()
        return self

    def stop(self) -> None:
        self.http.close()
        self.proc.stop()

    def control(self, **settings) -> None:
        self.http.post("/_control", json=settings).raise_for_status()

    def reset(self) -> None:
        self.http.post("/_reset").raise_for_status()

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get("/_requests").json()

    def stats(self) -> dict[str, int]:
        return self.http.get("/_stats").json()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    args = ap.parse_args()
    import uvicorn

    from llmdeploy.router.__main__ import Server  # drops idle TLS connections at shutdown

    app = create_app(os.environ.get("FAKE_CLOUD_EXPECTED_KEY") or None)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=1,
        ssl_certfile=args.tls_cert,
        ssl_keyfile=args.tls_key,
    )
    Server(config).run()


if __name__ == "__main__":
    main()
