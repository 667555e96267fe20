"""Carrying out a routing plan: try each target in order until one commits; keep breakers and in-flight counts
honest; answer the client once, with the backend and revision that served it, and conclude what the request
came to (an Outcome, router/outcome.py) for the caller to record.

A backend that rejects the request itself (4xx: bad parameter, context too long) is not failing: that never
counts against its breaker or window, and its answer reaches the client as it is. A client that leaves before
its answer is ready aborts the backend request (499)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from llmdeploy.openai_api.asgi import ClientGone, unless_disconnected
from llmdeploy.openai_api.errors import OpenAIError, overloaded
from llmdeploy.openai_api.headers import ENGINE_TOKEN_HEADER
from llmdeploy.policies.breaker import CircuitBreaker
from llmdeploy.policies.route import CLOUD, CLOUD_TARGET, LOCAL, Decision, Target
from llmdeploy.router.backends import EnginePool, local_read_timeout_s
from llmdeploy.router.normalize import UpstreamFailure
from llmdeploy.router.outcome import AttemptFailure, Call, Outcome, ServedBy, conclude, revision_label
from llmdeploy.router.relay import (
    Attempt,
    Continuation,
    Exchange,
    RelayEnd,
    RelayResponse,
    fetch_json,
    open_stream,
)
from llmdeploy.router.resume import CONTINUED_MARK, continuation_body, resumable
from llmdeploy.router.settings import Settings
from llmdeploy.router.table import RoutingTable

log = logging.getLogger("llmdeploy.router")
CONFIG_KINDS = frozenset({"upstream_auth", "upstream_config"})
# the request's own fault (the backend is fine): no breaker or window counts it
CLIENT_KINDS = frozenset({"client_error", "context_length"})
UNLIMITED_OUTPUT_GUESS = 2048  # no max_tokens and no /load yet: the output a read timeout is sized for


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


@dataclass(frozen=True)
class Dispatched:
    response: Response
    outcome: Outcome | None  # None: a committed stream, whose Outcome goes to `stream_ended` when it ends


def reservation(decision: Decision) -> str | None:
    """The replica a plan counts in flight at once: its first target when that is local. A plan that starts with
    the cloud reserves nothing: counting its local fallback made every request the cloud was serving look queued
    on the engine, so the predicted TTFT stayed over the SLA and even an idle engine got no traffic."""
    first = decision.plan[0] if decision.plan else None
    return first.replica.url if first is not None and first.backend == LOCAL and first.replica else None


class Dispatcher:
    """Carries plans out against the engines (`pool`, `table`) and the cloud (`Settings.cloud` and its breaker).
    It keeps the backends' breakers and in-flight counts; it books nothing: each request's Outcome goes back to
    the caller, which records it once (router/bookkeeping.py)."""

    def __init__(
        self,
        pool: EnginePool,
        table: RoutingTable,
        cloud_breaker: CircuitBreaker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool, self.table, self.cloud_breaker, self.clock = pool, table, cloud_breaker, clock

    async def execute(
        self,
        s: Settings,
        call: Call,
        decision: Decision,
        stream_ended: Callable[[Outcome], None],
        receive: Receive | None = None,
    ) -> Dispatched:
        """Carry out the plan; with `receive`, a client disconnect first cancels it (the backend aborts)."""
        self._reserve(call, decision)
        try:
            work = self._execute(s, call, decision, stream_ended)
            if receive is None:
                return await work
            return await unless_disconnected(receive, work)
        except ClientGone:
            return Dispatched(
                Response(status_code=499), self._conclude(call, 499, "none", decision, "client_closed")
            )
        finally:
            if call.reserved is not None:  # never attempted (cancelled, breaker refused, cloud first)
                self.pool.release(call.reserved)
                call.reserved = None

    def _reserve(self, call: Call, decision: Decision) -> None:
        """Count the plan's replica in flight now, before the attempt's task runs: decisions made meanwhile (a
        burst arriving at once) see it, or they would all pick the same replica."""
        if (url := reservation(decision)) is not None:
            call.reserved = url
            self.pool.acquire(url)

    def _conclude(
        self, call: Call, status: int, backend: ServedBy, decision: Decision, error: str | None = None
    ) -> Outcome:
        return conclude(call, self.clock(), status, backend, decision.revision, error)

    async def _execute(
        self, s: Settings, call: Call, decision: Decision, stream_ended: Callable[[Outcome], None]
    ) -> Dispatched:
        if self._may_resume(s, call, decision):
            call.ex.keep_text = True  # the text so far is the continuation's prefix
        last: UpstreamFailure | None = None
        prev: ServedBy | None = None
        for target in decision.plan:
            attempt = self._attempt(s, call, target)
            if attempt is None:
                continue  # breaker refused this backend
            if prev is not None:
                call.failovers.append((prev, target.backend))
            prev = target.backend
            call.attempts += 1
            try:
                if target.backend == CLOUD:
                    result = await s.cloud.with_retries(
                        lambda a=attempt: self._once(a, call), lambda f: call.retries.append(f.kind)
                    )
                else:
                    result = await self._once(attempt, call)
            except UpstreamFailure as f:
                self._failed(call, target, f)
                if not f.failover:
                    return self._error(call, f.error, target.backend, decision)
                last = f
                continue
            except BaseException:
                self._release(target, ok=None)
                raise
            return self._committed(s, call, target, decision, result, stream_ended)
        return self._error(call, self._final_error(last), prev or "none", decision)

    # ---- one attempt ------------------------------------------------------------------------------------
    def _attempt(
        self, s: Settings, call: Call, target: Target, body: dict[str, Any] | None = None
    ) -> Attempt | None:
        now = self.clock()
        if target.backend == CLOUD:
            if not s.cloud.enabled or not self.cloud_breaker.acquire(now):
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
        if not self.pool.breaker(url).acquire(now):
            return None
        if call.reserved == url:
            call.reserved = None  # the reservation becomes this attempt's count, released with it
        else:
            self.pool.acquire(url)
        headers = {"x-request-id": call.request_id}
        if token := self.pool.token_for(url):
            headers[ENGINE_TOKEN_HEADER] = token
        load = target.replica.load
        floor_s = s.spec.routing.local_timeout_s
        most = None if call.stream else output_tokens(call.body, load.max_model_len if load else 0)
        timeout_s = local_read_timeout_s(floor_s, most, load)
        return Attempt(
            LOCAL,
            self.pool.client,
            f"{url}/v1/{call.endpoint}",
            headers,
            upstream_payload(call, self.table.alias_of(target.replica.revision, s.alias)),
            read_timeout_s=timeout_s,
        )

    async def _once(self, a: Attempt, call: Call):
        return await (open_stream(a, call.ex) if call.stream else fetch_json(a, call.ex))

    def _failed(self, call: Call, target: Target, f: UpstreamFailure) -> None:
        is_fault = f.kind not in CLIENT_KINDS
        call.failures.append(AttemptFailure(target.backend, f.kind, is_fault))
        self._release(target, ok=not is_fault)
        if target.backend == LOCAL:
            if f.kind in ("connect_error",):
                self.pool.mark_down(target.replica.url)
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
        now = self.clock()
        br = self._breaker(target)
        if ok is None:
            br.release()
        else:
            br.record(ok, now)
        if target.backend == LOCAL:
            self.pool.release(target.replica.url)

    def _breaker(self, target: Target) -> CircuitBreaker:
        # looked up each time: the pool replaces a restarted engine's breaker (EnginePool._poll)
        return self.cloud_breaker if target.backend == CLOUD else self.pool.breaker(target.replica.url)

    # ---- answers ----------------------------------------------------------------------------------------
    def _committed(
        self,
        s: Settings,
        call: Call,
        target: Target,
        decision: Decision,
        result,
        stream_ended: Callable[[Outcome], None],
    ) -> Dispatched:
        backend = target.backend
        self._breaker(target).record(True, self.clock())
        if backend == LOCAL:
            call.replica = target.replica.replica
        headers = id_headers(call.request_id, backend, decision.revision)
        if not call.stream:
            if backend == LOCAL:
                self.pool.release(target.replica.url)
            return Dispatched(
                JSONResponse(result, headers=headers), self._conclude(call, 200, backend, decision)
            )

        def on_end() -> None:
            broken = call.ex.failed_after_commit
            if backend == LOCAL:
                self.pool.release(target.replica.url)
            if broken:
                self._breaker(target).record(False, self.clock())
            status = 200 if call.ex.stream_complete else 499
            stream_ended(self._conclude(call, status, backend, decision, broken))

        if backend == LOCAL and self._may_resume(s, call, decision):
            result.resume = lambda: self._continue_on_cloud(s, call, decision)
        relay = RelayResponse(
            result, call.ex, RelayEnd(result, on_end), {**headers, "cache-control": "no-cache"}
        )
        return Dispatched(relay, None)

    # ---- continue_on_failure: cloud ----------------------------------------------------------------------
    def _may_resume(self, s: Settings, call: Call, decision: Decision) -> bool:
        return (
            call.stream
            and s.spec.routing.continue_on_failure == CLOUD
            and decision.egress_denied is None
            and s.cloud.enabled
            and resumable(call.body, call.endpoint)
        )

    async def _continue_on_cloud(self, s: Settings, call: Call, decision: Decision) -> Continuation | None:
        """The cloud's stream for the rest of a local one that failed after its first token; None: not possible
        (nothing left to generate, cloud breaker open, the cloud failing too); the stream then ends in error."""
        ex = call.ex
        body = continuation_body(call.body, call.endpoint, "".join(ex.text), ex.content_events)
        attempt = self._attempt(s, call, CLOUD_TARGET, body) if body is not None else None
        if attempt is None:
            return None
        call.failovers.append((LOCAL, CLOUD))
        cx = Exchange(ex.alias, ex.client_wants_usage, s.bodies)
        try:
            stream = await s.cloud.with_retries(
                lambda: open_stream(attempt, cx), lambda f: call.retries.append(f.kind)
            )
        except UpstreamFailure as f:
            self._failed(call, CLOUD_TARGET, f)
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
                self.cloud_breaker.release()
            else:
                self.cloud_breaker.record(ok, self.clock())

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

    def _error(self, call: Call, err: OpenAIError, backend: ServedBy, decision: Decision) -> Dispatched:
        resp = err.response()
        revision = decision.revision if backend != "none" else None
        for k, v in id_headers(call.request_id, backend, revision).items():
            resp.headers[k] = v
        return Dispatched(resp, self._conclude(call, err.status, backend, decision, err.code or err.type))


def id_headers(request_id: str, backend: ServedBy, revision: int | None) -> dict[str, str]:
    """The ids every answer carries: which backend and revision served it."""
    rev = revision_label(backend, revision)
    return {"x-request-id": request_id, "x-llmdeploy-backend": backend, "x-llmdeploy-revision": rev}


def output_tokens(body: dict[str, Any], max_model_len: int = 0) -> int:
    """What a (validated) request may generate at most: its limit (else the context) times n."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(limit, int):
        limit = max_model_len or UNLIMITED_OUTPUT_GUESS
    n = body.get("n")
    return limit * (n if isinstance(n, int) and n > 0 else 1)
