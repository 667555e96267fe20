"""Carrying out a routing plan: try each target in order until one commits; keep breakers, in-flight counts,
windows and metrics honest; answer the client once, with the backend and revision that served it.

A backend that rejects the request itself (4xx: bad parameter, context too long) is not failing: that never
counts against its breaker or window, and its answer reaches the client as it is. A client that leaves before
its answer is ready aborts the backend request (499)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import JSONResponse, Response

from llmdeploy.openai_api.errors import OpenAIError, overloaded
from llmdeploy.openai_api.headers import ENGINE_TOKEN_HEADER
from llmdeploy.policies.route import CLOUD, CLOUD_TARGET, LOCAL, Decision, Target
from llmdeploy.router.access_log import AccessRecord
from llmdeploy.router.backends import local_read_timeout_s
from llmdeploy.router.normalize import UpstreamFailure
from llmdeploy.router.relay import (
    Attempt,
    Continuation,
    Exchange,
    RelayEnd,
    RelayResponse,
    fetch_json,
    open_stream,
)
from llmdeploy.router.requests import until_disconnect
from llmdeploy.router.resume import CONTINUED_MARK, continuation_body, resumable

log = logging.getLogger("llmdeploy.router")
CONFIG_KINDS = frozenset({"upstream_auth", "upstream_config"})
# the request's own fault (the backend is fine): no breaker or window counts it
CLIENT_KINDS = frozenset({"client_error", "context_length"})
UNLIMITED_OUTPUT_GUESS = 2048  # no max_tokens and no /load yet: the output a read timeout is sized for


@dataclass
class Call:
    request_id: str
    endpoint: str  # "chat/completions" | "completions"
    body: dict[str, Any]
    stream: bool
    ex: Exchange
    rec: AccessRecord
    finished: bool = False
    reserved: str | None = None  # a local replica counted in flight at decision time (Dispatcher.execute)


def upstream_payload(call: Call, model: str | None, body: dict[str, Any] | None = None) -> bytes:
    """The body the backend gets: `model` is the cloud's model, or the name the chosen revision's engines answer
    (a gray release may rename the model); None leaves the client's."""
    body = call.body if body is None else body
    if model and body.get("model") != model:
        body = {**body, "model": model}
    if call.stream and not call.ex.client_wants_usage:
        # ask for usage anyway (the cost view); the relay drops it from what the client sees
        opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        body = {**body, "stream_options": {**opts, "include_usage": True}}
    return json.dumps(body).encode()


def revision_label(backend: str, revision: int | None) -> str:
    if backend == CLOUD:
        return "cloud"
    return "none" if revision is None else str(revision)


class Dispatcher:
    def __init__(self, router) -> None:
        self.r = router  # the Router: pool, cloud, cloud_breaker, metrics, windows, finish()

    async def execute(self, s, call: Call, decision: Decision, receive=None) -> Response:
        """Carry out the plan; with `receive`, a client disconnect first cancels it (the backend aborts)."""
        self._reserve(call, decision)
        try:
            return await self._watched(s, call, decision, receive)
        finally:
            if call.reserved is not None:  # never attempted (cancelled, breaker refused, cloud first)
                self.r.pool.release(call.reserved)
                call.reserved = None

    def _reserve(self, call: Call, decision: Decision) -> None:
        """Count the first local replica of the plan in flight now, before the attempt's task runs: decisions
        made meanwhile (a burst arriving at once) see it, or they would all pick the same replica."""
        first = next((t for t in decision.plan if t.backend == LOCAL), None)
        if first is not None:
            call.reserved = first.replica.url
            self.r.pool.acquire(call.reserved)

    async def _watched(self, s, call: Call, decision: Decision, receive) -> Response:
        if receive is None:
            return await self._execute(s, call, decision)
        task = asyncio.ensure_future(self._execute(s, call, decision))
        watch = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            call.rec.error = "client_closed"
            self.r.finish(call, 499, "none", decision.revision)
            return Response(status_code=499)
        return task.result()

    async def _execute(self, s, call: Call, decision: Decision) -> Response:
        if self._may_resume(s, call, decision):
            call.ex.keep_text = True  # the text so far is the continuation's prefix
        last: UpstreamFailure | None = None
        prev: str | None = None
        for target in decision.plan:
            attempt = self._attempt(s, call, target)
            if attempt is None:
                continue  # breaker refused this backend
            if prev is not None:
                self.r.metrics.failovers.labels(prev, target.backend).inc()
            prev = target.backend
            call.rec.attempts += 1
            try:
                if target.backend == CLOUD:
                    result = await s.cloud.with_retries(
                        lambda a=attempt: self._once(a, call),
                        lambda f: self.r.metrics.retries.labels(f.kind).inc(),
                    )
                else:
                    result = await self._once(attempt, call)
            except UpstreamFailure as f:
                self._failed(target, f, decision.revision)
                if not f.failover:
                    return self._error(call, f.error, target.backend, decision.revision)
                last = f
                continue
            except BaseException:
                self._release(target, ok=None)
                raise
            return self._committed(s, call, target, decision, result)
        return self._error(call, self._final_error(last), prev or "none", decision.revision)

    # ---- one attempt ------------------------------------------------------------------------------------
    def _attempt(self, s, call: Call, target: Target, body: dict[str, Any] | None = None) -> Attempt | None:
        now = time.monotonic()
        if target.backend == CLOUD:
            if not s.cloud.enabled or not self.r.cloud_breaker.acquire(now):
                return None
            return Attempt(
                CLOUD,
                s.cloud.client,
                s.cloud.url(call.endpoint),
                s.cloud.headers(call.request_id),
                upstream_payload(call, s.cloud.model, body),
                s.cloud.secrets,
            )
        url = target.replica.url
        if not self.r.pool.breaker(url).acquire(now):
            return None
        if call.reserved == url:
            call.reserved = None  # the reservation becomes this attempt's count, released with it
        else:
            self.r.pool.acquire(url)
        headers = {"x-request-id": call.request_id}
        if token := self.r.pool.token_for(url):
            headers[ENGINE_TOKEN_HEADER] = token
        load = target.replica.load
        floor_s = s.spec.routing.local_timeout_s
        most = None if call.stream else output_tokens(call.body, load.max_model_len if load else 0)
        timeout_s = local_read_timeout_s(floor_s, most, load)
        return Attempt(
            LOCAL,
            self.r.pool.client,
            f"{url}/v1/{call.endpoint}",
            headers,
            upstream_payload(call, self.r.table.alias_of(target.replica.revision, s.alias)),
            read_timeout_s=timeout_s,
        )

    async def _once(self, a: Attempt, call: Call):
        return await (open_stream(a, call.ex) if call.stream else fetch_json(a, call.ex))

    def _failed(self, target: Target, f: UpstreamFailure, revision: int | None) -> None:
        self.r.metrics.upstream_errors.labels(target.backend, f.kind).inc()
        is_fault = f.kind not in CLIENT_KINDS
        self._release(target, ok=not is_fault)
        if target.backend == LOCAL:
            if f.kind in ("connect_error",):
                self.r.pool.mark_down(target.replica.url)
            if is_fault and revision is not None:
                self.r.windows.record(revision, True, None, time.monotonic())
            log.warning(
                "local engine %s failed before the first token (%s): %s",
                target.replica.replica,
                f.kind,
                f.error.message,
            )
        else:
            log.warning("cloud failed before the first token (%s): %s", f.kind, f.error.message)

    def _release(self, target: Target, ok: bool | None) -> None:
        """End an attempt: breaker outcome (None: no outcome, give back a probe slot) and in-flight count."""
        now = time.monotonic()
        br = self.r.cloud_breaker if target.backend == CLOUD else self.r.pool.breaker(target.replica.url)
        if ok is None:
            br.release()
        else:
            br.record(ok, now)
        if target.backend == LOCAL:
            self.r.pool.release(target.replica.url)

    # ---- answers ----------------------------------------------------------------------------------------
    def _headers(self, call: Call, backend: str, revision: int | None) -> dict[str, str]:
        rev = revision_label(backend, revision)
        call.rec.backend, call.rec.revision = backend, rev
        return {"x-request-id": call.request_id, "x-llmdeploy-backend": backend, "x-llmdeploy-revision": rev}

    def _committed(self, s, call: Call, target: Target, decision: Decision, result) -> Response:
        backend = target.backend
        if backend == CLOUD:
            self.r.cloud_breaker.record(True, time.monotonic())
        else:
            self.r.pool.breaker(target.replica.url).record(True, time.monotonic())
            call.rec.replica = target.replica.replica
        headers = self._headers(call, backend, decision.revision)
        if not call.stream:
            if backend == LOCAL:
                self.r.pool.release(target.replica.url)
            self.r.finish(call, 200, backend, decision.revision)
            return JSONResponse(result, headers=headers)

        def on_end() -> None:
            if backend == LOCAL:
                self.r.pool.release(target.replica.url)
                if call.ex.failed_after_commit:
                    self.r.pool.breaker(target.replica.url).record(False, time.monotonic())
            elif call.ex.failed_after_commit:
                self.r.cloud_breaker.record(False, time.monotonic())
            if call.ex.failed_after_commit:
                self.r.metrics.upstream_errors.labels(backend, call.ex.failed_after_commit).inc()
                call.rec.error = call.ex.failed_after_commit
            call.rec.continued = call.ex.continued
            self.r.finish(call, 200 if call.ex.stream_complete else 499, backend, decision.revision)

        if backend == LOCAL and self._may_resume(s, call, decision):
            result.resume = lambda: self._continue_on_cloud(s, call, decision)
        return RelayResponse(
            result, call.ex, RelayEnd(result, on_end), {**headers, "cache-control": "no-cache"}
        )

    # ---- continue_on_failure: cloud ----------------------------------------------------------------------
    def _may_resume(self, s, call: Call, decision: Decision) -> bool:
        return (
            call.stream
            and s.spec.routing.continue_on_failure == CLOUD
            and decision.egress_denied is None
            and s.cloud.enabled
            and resumable(call.body, call.endpoint)
        )

    async def _continue_on_cloud(self, s, call: Call, decision: Decision) -> Continuation | None:
        """The cloud's stream for the rest of a local one that failed after its first token; None: not possible
        (nothing left to generate, cloud breaker open, the cloud failing too); the stream then ends in error."""
        ex = call.ex
        body = continuation_body(call.body, call.endpoint, "".join(ex.text), ex.content_events)
        attempt = self._attempt(s, call, CLOUD_TARGET, body) if body is not None else None
        if attempt is None:
            return None
        self.r.metrics.failovers.labels(LOCAL, CLOUD).inc()
        cx = Exchange(ex.alias, ex.client_wants_usage, self.r.settings.bodies)
        try:
            stream = await s.cloud.with_retries(
                lambda: open_stream(attempt, cx), lambda f: self.r.metrics.retries.labels(f.kind).inc()
            )
        except UpstreamFailure as f:
            self._failed(CLOUD_TARGET, f, decision.revision)
            return None
        except BaseException:
            self._release(CLOUD_TARGET, ok=None)
            raise
        log.warning(
            "request %s: local stream failed after %d chunks (%s); the cloud continues it",
            call.request_id,
            ex.content_events,
            ex.failed_after_commit,
        )
        ex.continued = CLOUD

        def finish(ok: bool | None) -> None:  # None: the client left, no verdict on the cloud
            if ok is None:
                self.r.cloud_breaker.release()
            else:
                self.r.cloud_breaker.record(ok, time.monotonic())

        return Continuation(stream, cx, CONTINUED_MARK, finish)

    def _final_error(self, last: UpstreamFailure | None) -> OpenAIError:
        if last is None:
            return overloaded(
                "No backend can take the request now (circuit breakers open); retry shortly.", 1.0
            )
        err = last.error
        if last.kind == "timeout":
            return err  # 504 upstream_timeout: the backend was working, not refusing; retrying may not help
        if err.status >= 500 and last.kind not in CONFIG_KINDS:
            # overload or outage: the client should come back, and is told when
            return overloaded(f"No backend could serve the request: {err.message}", last.retry_after_s or 1.0)
        return err

    def _error(self, call: Call, err: OpenAIError, backend: str, revision: int | None) -> Response:
        call.rec.error = err.code or err.type
        self.r.finish(call, err.status, backend, revision)
        resp = err.response()
        for k, v in self._headers(call, backend, revision if backend != "none" else None).items():
            resp.headers[k] = v
        return resp


def output_tokens(body: dict[str, Any], max_model_len: int = 0) -> int:
    """What a (validated) request may generate at most: its limit (else the context) times n."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(limit, int):
        limit = max_model_len or UNLIMITED_OUTPUT_GUESS
    n = body.get("n")
    return limit * (n if isinstance(n, int) and n > 0 else 1)
