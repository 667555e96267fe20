"""The router: an OpenAI-compatible proxy in front of the local engines and the cloud.

create_router(spec, table) -> Router; Router.app is the FastAPI app (docs/CONTRACTS.md section 5). A request
goes: auth -> body size/JSON -> alias -> schema -> rate limit -> policies.route.decide -> Dispatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace

from fastapi import FastAPI
from prometheus_client import Counter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmdeploy.openai_api.errors import (
    OpenAIError,
    install_error_handlers,
    overloaded,
    rate_limited,
    server_error,
)
from llmdeploy.policies import capability
from llmdeploy.policies.affinity import ReplicaChoice
from llmdeploy.policies.breaker import BreakerConfig, CircuitBreaker
from llmdeploy.policies.cost import Prices, Tokens
from llmdeploy.policies.egress import ALLOW_CLOUD_HEADER, CloudState, header_allows_cloud
from llmdeploy.policies.overflow import OverflowLimits
from llmdeploy.policies.ratelimit import KeyRateLimiter, burst_bucket
from llmdeploy.policies.route import CLOUD, LOCAL, REJECT, SHED, WAIT, Decision, decide
from llmdeploy.policies.snapshot import RequestFacts, WindowStats
from llmdeploy.policies.split import parse_pinned
from llmdeploy.router import requests as rq
from llmdeploy.router.access_log import AccessRecord, log_access
from llmdeploy.router.auth import KeyInfo, KeyStore
from llmdeploy.router.backends import EnginePool
from llmdeploy.router.cloud import CloudClient
from llmdeploy.router.dashboard import install_dashboard
from llmdeploy.router.dashboard_data import ControlFeed, Observer
from llmdeploy.router.dispatch import Call, Dispatcher, revision_label
from llmdeploy.router.metrics import RouterMetrics
from llmdeploy.router.relay import Exchange
from llmdeploy.router.status import build_snapshot
from llmdeploy.router.table import RoutingTable
from llmdeploy.router.windows import RevisionWindows

log = logging.getLogger("llmdeploy.router")
PIN_HEADER = "x-llmdeploy-revision"
WAIT_POLL_S = 0.05
OLD_CLOUD_GRACE_S = 600.0  # a replaced cloud client stays open this long for requests still using it


@dataclass(frozen=True)
class Settings:
    """Everything a request reads from the spec, swapped as one object on reload."""

    spec: object
    alias: str
    keys: KeyStore
    limits: OverflowLimits
    cloud: CloudClient
    max_body: int
    local_wait_s: float
    sticky_header: str
    bodies: bool
    replica_choice: ReplicaChoice


class Router:
    def __init__(
        self,
        spec,
        table: RoutingTable,
        *,
        generated_key_hashes: dict[str, str] | None = None,
        environ=None,
        poll_interval_s: float = 0.2,
        cloud_backoff_s: float = 0.25,
    ) -> None:
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per /load poll otherwise
        self.table = table
        self.generated_key_hashes = dict(generated_key_hashes or {})
        self.environ, self.cloud_backoff_s = environ, cloud_backoff_s
        self.metrics = RouterMetrics()
        # time series, tokens, cost, control events: /dashboard and status read it
        self.observer = Observer(self.metrics)
        self.capability_decisions = Counter(
            "llmdeploy_router_capability_decisions",
            "Requests by which backends could serve them (none: no special needs; any; local_only; "
            "cloud_only; rejected)",
            ["decision"],
            registry=self.metrics.registry,
        )
        self.limiter = KeyRateLimiter()
        self.settings = self._settings(spec)
        self.limiter.configure(self.settings.keys.rpm_limits())
        self.burst = burst_bucket(spec.routing.burst.local_rps)
        self.cloud_breaker = CircuitBreaker(BreakerConfig.from_spec(spec.routing.breaker))
        self.pool = EnginePool(table, BreakerConfig.from_spec(spec.routing.breaker), poll_interval_s)
        self.windows = RevisionWindows(spec.rollout.auto_rollback.window_s)
        self.dispatcher = Dispatcher(self)
        self.started_at = time.time()
        self._retired: list[tuple[asyncio.Task, CloudClient]] = []
        self._start_task: asyncio.Future | None = None
        self._closed = False
        self._lifespans = 0
        self.app = self._build_app()
        # created inside a running loop (the daemon embeds it): poll from now on, without waiting for traffic
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            self._start_task = asyncio.ensure_future(self.pool.start())

    def _settings(self, spec, reuse_cloud: CloudClient | None = None) -> Settings:
        cloud = reuse_cloud or CloudClient(
            spec.cloud, environ=self.environ, backoff_initial_s=self.cloud_backoff_s
        )
        return Settings(
            spec=spec,
            alias=spec.model.served_alias,
            keys=KeyStore(spec.auth, self.generated_key_hashes, self.environ),
            limits=OverflowLimits.from_spec(spec),
            cloud=cloud,
            max_body=spec.routing.max_body_bytes,
            local_wait_s=spec.routing.local_wait_s,
            sticky_header=spec.rollout.sticky_header,
            bodies=spec.logging.bodies,
            replica_choice=ReplicaChoice.from_spec(spec),
        )

    # ---- lifecycle and the control-plane seam -----------------------------------------------------------
    async def start(self) -> None:
        """Start the /load poller (idempotent); the app's lifespan, or the first request, calls it."""
        if self._start_task is None:
            self._start_task = asyncio.ensure_future(self.pool.start())
        if not self._start_task.done():
            await asyncio.shield(self._start_task)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.pool.aclose()
        await self.settings.cloud.aclose()
        for task, cloud in self._retired:
            task.cancel()
            await cloud.aclose()
        self._retired.clear()

    def update_spec(self, spec, generated_key_hashes: dict[str, str] | None = None) -> None:
        """Hot reload of auth, routing, sla, cloud and rollout settings; in-flight requests keep theirs."""
        if generated_key_hashes is not None:
            self.generated_key_hashes = dict(generated_key_hashes)
        old = self.settings
        same_cloud = old.spec.cloud == spec.cloud and old.cloud.key_matches(spec.cloud, self.environ)
        new = self._settings(spec, reuse_cloud=old.cloud if same_cloud else None)
        self.settings = new
        self.limiter.configure(new.keys.rpm_limits())
        self.burst.reconfigure(spec.routing.burst.local_rps, max(1.0, spec.routing.burst.local_rps))
        breaker = BreakerConfig.from_spec(spec.routing.breaker)
        self.cloud_breaker.reconfigure(breaker)
        self.pool.reconfigure(breaker)
        self.windows.window_s = spec.rollout.auto_rollback.window_s
        if not same_cloud:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing can be using the old client
                task = asyncio.get_running_loop().create_task(self._close_later(old.cloud))
                self._retired.append((task, old.cloud))
        log.info("router settings reloaded")

    async def _close_later(self, cloud: CloudClient) -> None:
        await asyncio.sleep(OLD_CLOUD_GRACE_S)
        await cloud.aclose()

    def revision_window(self, revision: int) -> WindowStats:
        return self.windows.stats(revision, time.monotonic())

    def control_event(self, kind: str, revision: int | None = None) -> None:
        """The daemon reports each control-plane event (apply, canary, rollback, engine-crash...): counters."""
        self.observer.control_event(kind, revision)

    def set_control_feed(self, feed: ControlFeed | None) -> None:
        """The daemon's status document for /dashboard (events, revision states, replicas, the bench curve)."""
        self.observer.control_feed = feed

    def snapshot(self) -> dict:
        """For `llmdeploy status`: revisions, replicas, windows, cloud share, breakers, overflow counts."""
        return build_snapshot(self, time.monotonic())

    # ---- HTTP --------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            # one router may serve several servers at once (a re-listen overlaps the old one): close with the last
            self._lifespans += 1
            await self.start()
            try:
                yield
            finally:
                self._lifespans -= 1
                if self._lifespans == 0:
                    await self.aclose()

        app = FastAPI(
            title="llmdeploy router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
        )
        install_error_handlers(app)
        app.add_middleware(rq.RequestIdMiddleware, on_first_request=self.start)
        app.router.add_route("/health", self.health, methods=["GET"])
        app.router.add_route("/ready", self.ready, methods=["GET"])
        app.router.add_route("/metrics", self.metrics_endpoint, methods=["GET"])
        app.router.add_route("/v1/models", self.models, methods=["GET"])
        app.router.add_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.router.add_route("/v1/completions", self.completions, methods=["POST"])
        install_dashboard(app, self)
        return app

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def can_serve(self) -> bool:
        now = time.monotonic()
        local = any(r.ready for r in self.pool.revision_states(now))
        return local or (self.settings.cloud.enabled and self.cloud_breaker.allows(now))

    async def ready(self, request: Request) -> Response:
        if self.can_serve():
            return JSONResponse({"status": "ready"})
        return overloaded("No backend can serve requests right now.", 1.0).response()

    async def metrics_endpoint(self, request: Request) -> Response:
        s = self.settings
        try:
            if not s.keys.metrics_public:
                s.keys.authenticate(request.headers)
        except OpenAIError as e:
            return e.response()
        for url, br in list(self.pool.breakers.items()):
            self.metrics.breaker_open.labels(url).set(0 if br.state == "closed" else 1)
        self.metrics.breaker_open.labels("cloud").set(0 if self.cloud_breaker.state == "closed" else 1)
        self._engine_gauges()
        self.observer.refresh_gauges(self, time.monotonic())
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _engine_gauges(self) -> None:
        m = self.metrics
        for rev in self.pool.revision_states(time.monotonic()):
            for r in rev.replicas:
                labels = (str(rev.revision), r.replica)
                m.engine_up.labels(*labels).set(1 if r.usable else 0)
                if r.load is not None:
                    m.engine_kv.labels(*labels).set(r.load.kv_usage)
                    m.engine_waiting.labels(*labels).set(r.load.waiting)
                    m.engine_running.labels(*labels).set(r.load.running)

    async def models(self, request: Request) -> Response:
        s = self.settings
        try:
            s.keys.authenticate(request.headers)
        except OpenAIError as e:
            return e.response()
        created = int(self.started_at)
        models = [
            {"id": a, "object": "model", "created": created, "owned_by": "llmdeploy"}
            for a in self.table.aliases(s.alias)
        ]
        return JSONResponse({"object": "list", "data": models})

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    async def _serve(self, request: Request, endpoint: str) -> Response:
        s = self.settings
        rid = request.scope["state"]["rid"]
        self.metrics.inflight.inc()
        call = Call(
            rid,
            endpoint,
            {},
            False,
            Exchange(s.alias, False, s.bodies),
            AccessRecord(rid, "POST", f"/v1/{endpoint}"),
        )
        try:
            key = s.keys.authenticate(request.headers)
            call.rec.key = key.name
            data = rq.parse_json(await rq.read_body(request, s.max_body))
            call.ex.alias = rq.check_alias(data, self.table.aliases(s.alias))
            req = rq.validate(data, endpoint)
            wait = self.limiter.check(key.name, time.monotonic())
            if wait is not None:
                raise rate_limited(
                    f"Rate limit of {key.rpm} requests per minute reached for key '{key.name}'.", wait
                )
            call.body, call.stream = data, req.stream
            call.ex.client_wants_usage = req.include_usage
            call.rec.stream, call.rec.body = req.stream, data if s.bodies else None
            facts = self._facts(request, req, key)
            decision = await self._decide(s, facts)
        except OpenAIError as e:
            call.rec.error = e.code or e.type
            self.finish(call, e.status, "none", None)
            return e.response()
        except Exception as exc:  # a bug: booked and answered like any error, logged once
            return self._unexpected(call, exc, None)
        self.capability_decisions.labels(decision.capability).inc()
        call.rec.capability = decision.capability
        if decision.action == CLOUD and decision.overflow_reason:
            self.metrics.overflow.labels(decision.overflow_reason).inc()
            call.rec.overflow = decision.overflow_reason
        if decision.action not in (CLOUD, LOCAL):
            err = self._unserved(decision)
            call.rec.error = err.code
            self.finish(call, err.status, "none", decision.revision)
            return err.response()
        try:  # a client that leaves before its answer is ready aborts the backend request (499)
            return await self.dispatcher.execute(s, call, decision, request.receive)
        except Exception as exc:
            return self._unexpected(call, exc, decision.revision)
        except BaseException:
            self.finish(call, 499, "none", decision.revision)  # cancelled (shutdown): still booked
            raise

    def _unexpected(self, call: Call, exc: Exception, revision: int | None) -> Response:
        log.error("request %s failed unexpectedly (%s)", call.request_id, type(exc).__name__, exc_info=exc)
        call.rec.error = "internal_error"
        self.finish(call, 500, "none", revision)
        return server_error().response()

    def _facts(self, request: Request, req, key: KeyInfo) -> RequestFacts:
        try:
            pinned = parse_pinned(request.headers.get(PIN_HEADER))
        except ValueError as exc:
            raise rq.rejected(400, "invalid_revision", str(exc), param=PIN_HEADER) from None
        return RequestFacts(
            prompt_tokens=rq.estimate_prompt_tokens(req),
            prompt=rq.prompt_shape(req),
            prefix_key=rq.prefix_key(req),
            max_tokens=rq.planned_output_tokens(req),
            key_name=key.name,
            key_allows_cloud=key.allow_cloud,
            header_allows_cloud=header_allows_cloud(request.headers.get(ALLOW_CLOUD_HEADER)),
            sticky_value=request.headers.get(self.settings.sticky_header),
            pinned_revision=pinned,
            needs=capability.needs_of(req, rq.estimate_prompt_tokens(req)),
        )

    async def _decide(self, s: Settings, facts: RequestFacts) -> Decision:
        """Decide; when the answer is 'wait' (no cloud, local full or down), poll until local_wait_s."""
        deadline = time.monotonic() + s.local_wait_s
        while True:
            now = time.monotonic()
            cloud = CloudState(s.cloud.enabled, self.cloud_breaker.allows(now))
            revisions = self.pool.revision_states(now)
            gate = capability.gate(revisions, facts, cloud, s.cloud.capabilities)
            d = decide(
                revisions,
                facts,
                s.limits,
                cloud,
                lambda t=now: self.burst.try_take(t),
                gate=gate,
                replica_choice=s.replica_choice,
            )
            if d.action != WAIT or now >= deadline:
                return replace(d, capability=gate.label)
            await asyncio.sleep(min(WAIT_POLL_S, max(0.0, deadline - now)))

    def _unserved(self, d: Decision) -> OpenAIError:
        if d.action == REJECT:
            return rq.rejected(d.status, d.code, d.message, param=d.param or PIN_HEADER)
        why = {
            "local_down": "no local engine is up",
            "queue_depth": "the local engines' queues are full",
        }.get(d.overflow_reason or "", "the local engines cannot take it")
        if d.action == SHED:
            bound = self.settings.local_wait_s
            why = f"the local engines' predicted wait is over routing.local_wait_s ({bound:g} s)"
        cloud = {
            "key_no_egress": "this API key may not use the cloud",
            "request_no_egress": "the request asked to stay local",
            "cloud_disabled": "the cloud is not enabled",
            "cloud_breaker_open": "the cloud is failing",
            "pinned_revision": "a pinned revision is served locally only",
        }.get(d.egress_denied or "", "")
        message = f"The request cannot be served now: {why}" + (f" and {cloud}." if cloud else ".")
        retry = self.cloud_breaker.config.cooldown_s if d.egress_denied == "cloud_breaker_open" else 1.0
        return overloaded(message, d.retry_after_s if d.action == SHED else retry)

    def finish(self, call: Call, status: int, backend: str, revision: int | None) -> None:
        """Book one answered request, once: metrics, the revision window (local answers), the access log."""
        if call.finished:
            return
        call.finished = True
        self.metrics.inflight.dec()
        now = time.monotonic()
        ex, rec = call.ex, call.rec
        rev = revision_label(backend, revision) if backend != "none" else "none"
        rec.status, rec.backend, rec.revision = status, backend, rev
        rec.e2e_ms = (now - ex.started) * 1000
        rec.ttft_ms = None if ex.ttft_s is None else ex.ttft_s * 1000
        rec.prompt_tokens, rec.completion_tokens = ex.prompt_tokens, ex.completion_tokens
        if rec.completion_tokens is None and ex.content_events:
            rec.completion_tokens = ex.content_events
        if self.settings.bodies and ex.text:
            rec.completion = "".join(ex.text)
        m = self.metrics
        m.requests.labels(backend, rev, str(status)).inc()
        m.key_requests.labels(rec.key, str(status)).inc()
        if status >= 400 and status != 499:
            m.errors.labels(rec.error or str(status)).inc()
        if backend != "none":
            m.e2e.labels(backend, rev).observe(now - ex.started)
            if ex.ttft_s is not None:
                m.ttft.labels(backend, rev).observe(ex.ttft_s)
        if backend == CLOUD:
            m.cloud_tokens.labels("in").inc(ex.prompt_tokens or 0)
            m.cloud_tokens.labels("out").inc(rec.completion_tokens or 0)
        self.observer.record(
            backend,
            revision,
            status,
            ex.failed_after_commit is not None,
            ex.ttft_s,
            now - ex.started,
            Tokens(ex.prompt_tokens or 0, rec.completion_tokens or 0),
            rec.key,
            Prices.from_spec(getattr(self.settings.spec, "cost", None)),
        )
        if backend == LOCAL and revision is not None and status in (200, 499):
            ttft_ms = None if ex.ttft_s is None else ex.ttft_s * 1000
            self.windows.record(revision, ex.failed_after_commit is not None, ttft_ms, now)
        log_access(rec, self.settings.bodies)


def create_router(
    spec, table: RoutingTable, *, generated_key_hashes: dict[str, str] | None = None, **kwargs
) -> Router:
    return Router(spec, table, generated_key_hashes=generated_key_hashes, **kwargs)
