"""The ASGI plumbing the router and the engine share (llmdeploy/openai_api/asgi.py), over real HTTP on loopback:
request ids on every answer (a bug's 500 included), the capped body read, the disconnect watch."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmdeploy.openai_api.asgi import (
    ClientGone,
    RequestIdMiddleware,
    read_capped,
    request_id,
    unless_disconnected,
)
from llmdeploy.openai_api.errors import OpenAIError
from tests.helpers.procs import free_port

BODY_LIMIT = 16
EXTRA = ((b"x-llmdeploy-backend", b"none"),)


def build_app(watched: dict[str, object]) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"rid": request.scope["state"]["request_id"]})

    async def own(request: Request) -> JSONResponse:
        return JSONResponse({}, headers={"x-llmdeploy-backend": "local"})

    async def boom(request: Request) -> JSONResponse:
        raise RuntimeError("injected bug")

    async def body(request: Request) -> JSONResponse:
        try:
            return JSONResponse({"bytes": len(await read_capped(request, BODY_LIMIT))})
        except OpenAIError as e:
            return e.response()

    async def wait(request: Request) -> JSONResponse:
        async def work() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                watched["cancelled"] = True
                raise

        try:
            await unless_disconnected(request.receive, work())
        except ClientGone:
            watched["gone"] = True
            return Response(status_code=499)
        return JSONResponse({})

    routes = [
        Route("/echo", echo),
        Route("/own", own),
        Route("/boom", boom),
        Route("/body", body, methods=["POST"]),
        Route("/wait", wait, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(RequestIdMiddleware, server="test", max_id_length=8, default_headers=EXTRA)
    return app


@pytest.fixture(scope="module")
def served():
    watched: dict[str, object] = {}
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(watched), host="127.0.0.1", port=port, log_level="critical")
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "test server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", watched
    server.should_exit = True
    thread.join(15)


def test_request_id_keeps_sane_ids_and_replaces_others():
    assert request_id("abc-1.2:x_", 10) == "abc-1.2:x_"
    for bad in ("", None, "a" * 11, "has space", "new\nline", "ünï"):
        made = request_id(bad, 10)
        assert made != bad and len(made) == 32 and made.isalnum()


def test_every_answer_carries_the_ids(served):
    url, _ = served
    r = httpx.get(f"{url}/echo", headers={"x-request-id": "ok-1"})
    assert r.json() == {"rid": "ok-1"} and r.headers["x-request-id"] == "ok-1"
    assert r.headers["x-llmdeploy-backend"] == "none"
    r = httpx.get(f"{url}/echo", headers={"x-request-id": "too-long-for-8"})
    assert r.headers["x-request-id"] == r.json()["rid"] != "too-long-for-8"
    r = httpx.get(f"{url}/missing")
    assert r.status_code == 404 and len(r.headers["x-request-id"]) == 32


def test_headers_the_app_sets_are_not_doubled(served):
    url, _ = served
    r = httpx.get(f"{url}/own")
    assert r.headers.get_list("x-llmdeploy-backend") == ["local"]
    assert len(r.headers.get_list("x-request-id")) == 1


def test_a_bug_is_a_500_in_openai_shape_with_the_ids(served):
    url, _ = served
    r = httpx.get(f"{url}/boom", headers={"x-request-id": "bug-1"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["x-request-id"] == "bug-1" and r.headers["x-llmdeploy-backend"] == "none"


def test_bodies_are_capped_while_read(served):
    url, _ = served
    ok = httpx.post(f"{url}/body", content=b"x" * BODY_LIMIT)
    assert ok.json() == {"bytes": BODY_LIMIT}
    declared = httpx.post(f"{url}/body", content=b"x" * (BODY_LIMIT + 1))
    chunked = httpx.post(f"{url}/body", content=iter([b"x" * 10, b"x" * 10]))  # no length: counted
    for r in (declared, chunked):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    wrong = httpx.post(f"{url}/body", content=b"{}", headers={"content-type": "text/plain"})
    assert wrong.status_code == 415


def test_a_client_that_leaves_cancels_the_work(served):
    url, watched = served
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/wait", content=b"", timeout=0.5)
    deadline = time.monotonic() + 10
    while not (watched.get("gone") and watched.get("cancelled")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watched == {"gone": True, "cancelled": True}
