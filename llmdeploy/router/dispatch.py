"""Carrying out a routing plan: try each target in order until one commits; keep breakers, in-flight counts,
windows and metrics honest; answer the client once, with the backend and revision that served it."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from llmdeploy.openai_api.errors import OpenAIError, overloaded
from llmdeploy.policies.route import CLOUD, LOCAL, Decision, Target
from llmdeploy.router.access_log import AccessRecord
from llmdeploy.router.normalize import UpstreamFailure
from llmdeploy.router.relay import Attempt, Exchange, RelayEnd, RelayResponse, fetch_json, open_stream

log = logging.getLogger("llmdeploy.router")
CONFIG_KINDS = frozenset({"upstream_auth", "upstream_config"})


@dataclass
class Call:
    request_id: str
    endpoint: str  # "chat/completions" | "completions"
    body: dict[str, Any]
    stream: bool
    ex: Exchange
    rec: AccessRecord
    finished: bool = False


def upstream_payload(call: Call, model: str | None) -> bytes:
    """The body the backend gets: `model` is the cloud's model, or the name the chosen revision's engines answer
    (a gray release may rename the model); None leaves the client's."""
    body = call.body
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

    async def execute(self, s, call: Call, decision: Decision) -> Response:
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
    def _attempt(self, s, call: Call, target: Target) -> Attempt | None:
        now = time.monotonic()
        if target.backend == CLOUD:
            if not s.cloud.enabled or not self.r.cloud_breaker.acquire(now):
                return None
            return Attempt(
                CLOUD,
                s.cloud.client,
                s.cloud.url(call.endpoint),
                s.cloud.headers(call.request_id),
                upstream_payload(call, s.cloud.model),
                s.cloud.secrets,
            )
        url = target.replica.url
        if not self.r.pool.breaker(url).acquire(now):
            return None
        self.r.pool.acquire(url)
        return Attempt(
            LOCAL,
            self.r.pool.client,
            f"{url}/v1/{call.endpoint}",
            {"x-request-id": call.request_id},
            upstream_payload(call, self.r.table.alias_of(target.replica.revision, s.alias)),
        )

    async def _once(self, a: Attempt, call: Call):
        return await (open_stream(a, call.ex) if call.stream else fetch_json(a, call.ex))

    def _failed(self, target: Target, f: UpstreamFailure, revision: int | None) -> None:
        self.r.metrics.upstream_errors.labels(target.backend, f.kind).inc()
        is_fault = f.kind != "client_error"
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
            self.r.finish(call, 200 if call.ex.stream_complete else 499, backend, decision.revision)

        return RelayResponse(
            result, call.ex, RelayEnd(result, on_end), {**headers, "cache-control": "no-cache"}
        )

    def _final_error(self, last: UpstreamFailure | None) -> OpenAIError:
        if last is None:
            return overloaded(
                "No backend can take the request now (circuit breakers open); retry shortly.", 1.0
            )
        err = last.error
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
