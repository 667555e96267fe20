"""The router: an OpenAI-compatible proxy in front of the local engines and the cloud.

create_router(spec, table) -> Router; Router.app is the FastAPI app (docs/CONTRACTS.md section 5). A request
goes: auth -> body size/JSON -> alias -> schema -> rate limit -> policies.route.decide -> Dispatcher, and ends
as one Outcome that the Bookkeeper records (router/outcome.py, router/bookkeeping.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmdeploy.openai_api.asgi import DirectRoutes, RequestIdMiddleware
from llmdeploy.openai_api.errors import (
    OpenAIError,
    install_error_handlers,
    overloaded,
    rate_limited,
    server_error,
)
from llmdeploy.policies import capability
from llmdeploy.policies.breaker import BreakerConfig, CircuitBreaker
from llmdeploy.policies.egress import ALLOW_CLOUD_HEADER, CloudState, header_allows_cloud
from llmdeploy.policies.ratelimit import KeyRateLimiter, burst_bucket
from llmdeploy.policies.route import CLOUD, LOCAL, WAIT, Decision, decide
from llmdeploy.policies.snapshot import RequestFacts, WindowStats
from llmdeploy.policies.split import parse_pinned
from llmdeploy.router import requests as rq
from llmdeploy.router.auth import KeyInfo
from llmdeploy.router.backends import EnginePool
from llmdeploy.router.bookkeeping import Bookkeeper
from llmdeploy.router.cloud import CloudClient
from llmdeploy.router.dashboard import install_dashboard
from llmdeploy.router.dashboard_data import ControlFeed, Observer
from llmdeploy.router.dispatch import Dispatcher
from llmdeploy.router.metrics import RouterMetrics
from llmdeploy.router.outcome import Call, Outcome, ServedBy, conclude
from llmdeploy.router.refusals import PIN_HEADER, unserved_error
from llmdeploy.router.relay import Exchange
from llmdeploy.router.settings import Settings, build_settings
from llmdeploy.router.status import build_snapshot
from llmdeploy.router.table import RoutingTable
from llmdeploy.router.windows import RevisionWindows

log = logging.getLogger("llmdeploy.router")
# what every answer carries even when no backend served it (dispatch sets the real ones)
DEFAULT_ID_HEADERS = ((b"x-llmdeploy-backend", b"none"), (b"x-llmdeploy-revision", b"none"))
MAX_REQUEST_ID_LENGTH = 64
WAIT_POLL_S = 0.05
OLD_CLOUD_GRACE_S = 600.0  # a replaced cloud client stays open this long for requests still using it


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
        self.limiter = KeyRateLimiter()
        self.settings = self._settings(spec)
        self.limiter.configure(self.settings.keys.rpm_limits())
        self.burst = burst_bucket(spec.routing.burst.local_rps)
        self.cloud_breaker = CircuitBreaker(BreakerConfig.from_spec(spec.routing.breaker))
        self.pool = EnginePool(table, BreakerConfig.from_spec(spec.routing.breaker), poll_interval_s)
        self.windows = RevisionWindows(spec.rollout.auto_rollback.window_s)
        self.books = Bookkeeper(self.metrics, self.windows, self.observer)
        self.dispatcher = Dispatcher(self.pool, table, self.cloud_breaker)
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
        return build_settings(
            spec, self.generated_key_hashes, self.environ, self.cloud_backoff_s, reuse_cloud
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
    def _build_app(self) -> RequestIdMiddleware:
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
        app.router.add_route("/health", self.health, methods=["GET"])
        app.router.add_route("/ready", self.ready, methods=["GET"])
        app.router.add_route("/metrics", self.metrics_endpoint, methods=["GET"])
        app.router.add_route("/v1/models", self.models, methods=["GET"])
        # also here so other methods get the framework's 405; DirectRoutes answers every POST before it
        app.router.add_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.router.add_route("/v1/completions", self.completions, methods=["POST"])
        install_dashboard(app, self)
        hot = {
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
        }
        return RequestIdMiddleware(
            DirectRoutes(app, hot),
            server="router",
            max_id_length=MAX_REQUEST_ID_LENGTH,
            default_headers=DEFAULT_ID_HEADERS,
            on_first_request=self.start,  # embedders may run the app with lifespan off: start the poller then
        )

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
        self.observer.refresh_gauges(self, time.monotonic())
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

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
        call = Call(request.scope["state"]["request_id"], endpoint, Exchange(s.alias, False, s.bodies))
        self.books.arrived()
        try:
            key = s.keys.authenticate(request.headers)
            call.key = key.name
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
            call.logged_body = data if s.bodies else None
            facts = self._facts(request, req, key)
            decision = await self._decide(s, facts)
        except OpenAIError as e:
            return self._refused(call, e, e.code or e.type, None)
        except Exception as exc:  # a bug: booked and answered like any error, logged once
            return self._unexpected(call, exc, None)
        call.capability = decision.capability
        if decision.action == CLOUD and decision.overflow_reason:
            call.overflow = decision.overflow_reason
        if decision.action not in (CLOUD, LOCAL):
            err = unserved_error(decision, s.local_wait_s, self.cloud_breaker.config.cooldown_s)
            return self._refused(call, err, err.code, decision.revision)
        try:  # a client that leaves before its answer is ready aborts the backend request (499)
            done = await self.dispatcher.execute(
                s, call, decision, lambda o: self.record(call, o), request.receive
            )
        except Exception as exc:
            return self._unexpected(call, exc, decision.revision)
        except BaseException:
            self._conclude(call, 499, "none", decision.revision)  # cancelled (shutdown): still booked
            raise
        if done.outcome is not None:  # a stream's outcome is recorded when it ends
            self.record(call, done.outcome)
        return done.response

    def _refused(self, call: Call, err: OpenAIError, error: str | None, revision: int | None) -> Response:
        self._conclude(call, err.status, "none", revision, error)
        return err.response()

    def _unexpected(self, call: Call, exc: Exception, revision: int | None) -> Response:
        log.error("request %s failed unexpectedly (%s)", call.request_id, type(exc).__name__, exc_info=exc)
        self._conclude(call, 500, "none", revision, "internal_error")
        return server_error().response()

    def _conclude(
        self, call: Call, status: int, served_by: ServedBy, revision: int | None, error: str | None = None
    ) -> None:
        self.record(call, conclude(call, time.monotonic(), status, served_by, revision, error))

    def record(self, call: Call, outcome: Outcome) -> None:
        """Book one answered request, once (router/bookkeeping.py), with the settings current now."""
        self.books.record(call, outcome, self.settings)

    def _facts(self, request: Request, req, key: KeyInfo) -> RequestFacts:
        try:
            pinned = parse_pinned(request.headers.get(PIN_HEADER))
        except ValueError as exc:
            raise rq.rejected(400, "invalid_revision", str(exc), param=PIN_HEADER) from None
        prompt_tokens = rq.estimate_prompt_tokens(req)
        return RequestFacts(
            prompt_tokens=prompt_tokens,
            prompt=rq.prompt_shape(req),
            prefix_key=rq.prefix_key(req),
            max_tokens=rq.planned_output_tokens(req),
            key_name=key.name,
            key_allows_cloud=key.allow_cloud,
            header_allows_cloud=header_allows_cloud(request.headers.get(ALLOW_CLOUD_HEADER)),
            sticky_value=request.headers.get(self.settings.sticky_header),
            pinned_revision=pinned,
            needs=capability.needs_of(req, prompt_tokens),
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


def create_router(
    spec, table: RoutingTable, *, generated_key_hashes: dict[str, str] | None = None, **kwargs
) -> Router:
    return Router(spec, table, generated_key_hashes=generated_key_hashes, **kwargs)
