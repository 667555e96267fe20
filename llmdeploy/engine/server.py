"""The engine's OpenAI-compatible HTTP server: `create_app(engine, served_alias)` (__main__.py runs it).

Every request is checked in full (JSON, alias, fields, engine.check_request) before it reaches the engine,
so a bad request is a 400 at once and never stalls the loop. Streams commit at the first engine output:
failures before it are plain HTTP errors, after it an error event ends the stream (never a fake `stop`).
A client that goes away, streaming or not, aborts its request, which frees its KV blocks at once.
The HTTP plumbing this leans on (request ids, body limits, disconnect watching, the draining uvicorn) is in
asgi.py, so this file is only the path from an OpenAI request to the engine and back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from llmdeploy.engine.asgi import (
    MAX_BODY_BYTES,
    ClientGone,
    install_plumbing,
    read_object,
    unless_disconnected,
)
from llmdeploy.engine.chat import chat_prompt_ids
from llmdeploy.engine.metrics import RequestTracker, ServerMetrics
from llmdeploy.engine.outputs import RequestOutput
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.serving import (
    Formatter,
    Prompt,
    TokenTexts,
    chat_logprobs_k,
    chat_prompts,
    check_alias,
    completion_logprobs_k,
    completion_prompts,
    engine_error,
    sampling_params,
    validate,
)
from llmdeploy.openai_api.errors import OpenAIError, install_error_handlers, invalid_request, model_not_found
from llmdeploy.openai_api.headers import ENGINE_TTFT_HEADER
from llmdeploy.openai_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmdeploy.openai_api.sse import DONE, MEDIA_TYPE, STREAM_HEADERS, sse_data, sse_error_end

log = logging.getLogger("llmdeploy.engine.server")
Schema = TypeVar("Schema", bound=BaseModel)


# ---- one request ------------------------------------------------------------------------------------------


def aborted(out: RequestOutput) -> bool:
    return any(c.finish_reason == "abort" for c in out.outputs)


def aborted_error() -> OpenAIError:
    return OpenAIError(503, "The request was aborted by the engine (shutting down?).", code="aborted")


def ttft_header(finals: list[RequestOutput]) -> dict[str, str]:
    ttfts = [
        f.metrics.first_token_time - f.metrics.arrival_time
        for f in finals
        if f.metrics.first_token_time is not None
    ]
    return {ENGINE_TTFT_HEADER: f"{max(ttfts) * 1000:.1f}"} if ttfts else {}


@dataclass
class Job:
    """One OpenAI request on its way through the engine."""

    request: Request
    fmt: Formatter
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    prompt_param: str  # the field a too-long prompt is blamed on: messages | prompt
    started: float = field(default_factory=time.perf_counter)

    @property
    def rid(self) -> str:
        return self.request.state.request_id


# ---- the app ----------------------------------------------------------------------------------------------


class EngineServer:
    def __init__(
        self, engine: Any, served_alias: str, log_bodies: bool = False, max_body_bytes: int = MAX_BODY_BYTES
    ):
        self.engine, self.alias, self.log_bodies = engine, served_alias, log_bodies
        self.max_body_bytes = max_body_bytes
        self.tokenizer = engine.tokenizer
        self.texts = TokenTexts(self.tokenizer)
        self.max_model_len = engine.config.max_model_len
        self.metrics = ServerMetrics(engine.stats, served_alias)
        self.created = int(time.time())

    # -- engine streams

    async def engine_stream(
        self, prompt: Prompt, params: SamplingParams, rid: str
    ) -> AsyncIterator[RequestOutput]:
        tracker: RequestTracker = self.metrics.tracker()
        agen = self.engine.generate(prompt.token_ids, params, rid, check=False)  # serve() checked it
        try:
            async for out in agen:
                tracker.on_output(out)
                yield out
        finally:
            if not tracker.done:  # cancelled, disconnected or failed: the engine must drop it now
                with anyio.CancelScope(shield=True):
                    await agen.aclose()
                    await self.engine.abort(rid)
                tracker.on_abort(params.n)

    async def merged(
        self, prompts: list[Prompt], params: SamplingParams, rid: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts as they come, tagged with the prompt's index."""
        streams = [self.engine_stream(p, params, f"{rid}-{i}") for i, p in enumerate(prompts)]
        if len(streams) == 1:
            try:
                async for out in streams[0]:
                    yield 0, out
            finally:
                with anyio.CancelScope(shield=True):
                    await streams[0].aclose()
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out, None))
                queue.put_nowait((i, None, None))
            except Exception as exc:
                queue.put_nowait((i, None, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    remaining -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- one OpenAI request

    async def serve(self, job: Job) -> Response:
        for p in job.prompts:
            try:
                self.engine.check_request(p.token_ids, job.params)
            except Exception as exc:
                raise engine_error(exc, job.prompt_param) from None
        events = self.merged(job.prompts, job.params, job.fmt.id)
        try:
            if not job.stream:
                finals = await unless_disconnected(job.request, self.collect(events, len(job.prompts)))
                self.log_done(job, finals)
                return JSONResponse(job.fmt.response(finals), headers=ttft_header(finals))
            first = await unless_disconnected(job.request, anext(events))
        except ClientGone:
            log.info("request %s: client disconnected before the response; aborted", job.rid)
            return Response(status_code=499)
        except Exception as exc:
            with anyio.CancelScope(shield=True):
                await events.aclose()
            raise engine_error(exc, job.prompt_param) from None
        return StreamingResponse(
            self.stream_body(job, first, events), media_type=MEDIA_TYPE, headers=STREAM_HEADERS
        )

    async def collect(self, events: AsyncIterator[tuple[int, RequestOutput]], n: int) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * n
        async for i, out in events:
            finals[i] = out
        done = [f for f in finals if f is not None and f.finished]
        if len(done) != n or any(aborted(f) for f in done):
            raise aborted_error()
        return done

    async def stream_body(
        self, job: Job, first: tuple[int, RequestOutput], events: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[bytes]:
        finals: dict[int, RequestOutput] = {}
        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                i, out = item
                if aborted(out):
                    raise aborted_error()
                finals[i] = out
                for chunk in job.fmt.chunks(i, out):
                    yield sse_data(chunk)
                item = await anext(events, None)
            ordered = [finals[i] for i in sorted(finals)]
            if job.fmt.include_usage:
                yield sse_data(job.fmt.usage_chunk(ordered))
            yield DONE
            self.log_done(job, ordered)
        except Exception as exc:
            err = engine_error(exc, job.prompt_param)
            log.warning("request %s: stream ended with an error: %s", job.rid, err.message)
            yield sse_error_end(err)
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()

    def log_done(self, job: Job, finals: list[RequestOutput]) -> None:
        outs = [c for f in finals for c in f.outputs]
        log.info(
            "request %s %s: prompt_tokens=%d completion_tokens=%d finish=%s time=%.3fs",
            job.rid,
            job.fmt.object,
            sum(len(p.token_ids) for p in job.prompts),
            sum(len(c.token_ids) for c in outs),
            ",".join(sorted({str(c.finish_reason) for c in outs})),
            time.perf_counter() - job.started,
        )
        if self.log_bodies:
            log.info(
                "request %s prompt: %r", job.rid, [self.tokenizer.decode(p.token_ids) for p in job.prompts]
            )
            log.info("request %s completion: %r", job.rid, [c.text for c in outs])

    # -- endpoints

    async def parse_body(self, request: Request, schema: type[Schema], alias_required: bool) -> Schema:
        """The body as `schema`: its size, JSON and model alias checked first (413, 400, 404)."""
        body = await read_object(request, self.max_body_bytes)
        check_alias(body, self.alias, required=alias_required)
        return validate(schema, body)

    async def chat(self, request: Request) -> Response:
        req = await self.parse_body(request, ChatCompletionRequest, alias_required=True)
        k = chat_logprobs_k(req)
        prompts = chat_prompts(self.tokenizer, req)
        fmt = Formatter("chat", self.alias, req.n, self.texts, k, prompts, include_usage=req.include_usage)
        return await self.serve(Job(request, fmt, prompts, sampling_params(req, k), req.stream, "messages"))

    async def completions(self, request: Request) -> Response:
        req = await self.parse_body(request, CompletionRequest, alias_required=True)
        k = completion_logprobs_k(req)
        prompts = completion_prompts(self.tokenizer, req)
        fmt = Formatter("completion", self.alias, req.n, self.texts, k, prompts, req.echo, req.include_usage)
        return await self.serve(Job(request, fmt, prompts, sampling_params(req, k), req.stream, "prompt"))

    async def tokenize(self, request: Request) -> dict[str, Any]:
        req = await self.parse_body(request, TokenizeRequest, alias_required=False)
        if req.messages is not None:
            tokens = chat_prompt_ids(self.tokenizer, req.messages)
        else:
            tokens = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req = await self.parse_body(request, DetokenizeRequest, alias_required=False)
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise invalid_request(f"Token ids must be in [0, {vocab}).", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.alias,
            "object": "model",
            "created": self.created,
            "owned_by": "llmdeploy",
            "root": self.alias,
            "max_model_len": self.max_model_len,
        }

    def ready(self) -> bool:
        try:
            return bool(self.engine.load().get("ready"))
        except Exception:
            return False


def create_app(
    engine: Any,
    served_alias: str,
    *,
    log_bodies: bool = False,
    manage_engine: bool = True,
    internal_token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app over an already built engine; with manage_engine the app's lifespan starts and stops it. With an
    internal token (a deployment's engine) the routes that do work answer only requests that carry it."""
    srv = EngineServer(engine, served_alias, log_bodies, max_body_bytes)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await engine.shutdown()

    app = FastAPI(
        title="llmdeploy engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = srv
    install_error_handlers(app)
    install_plumbing(app, internal_token)

    app.post("/v1/chat/completions")(srv.chat)
    app.post("/v1/completions")(srv.completions)
    app.post("/tokenize")(srv.tokenize)
    app.post("/detokenize")(srv.detokenize)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [srv.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != served_alias:
            raise model_not_found(model)
        return srv.model_card()

    @app.get("/health")
    async def health() -> Response:
        if srv.ready():
            return JSONResponse({"status": "ok"})
        return OpenAIError(503, "The engine is not ready.", code="engine_not_ready").response()

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return engine.load()

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = srv.metrics.render()
        return Response(data, media_type=content_type)

    return app
