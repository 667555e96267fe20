"""`python -m llmdeploy.router --config llmdeploy.yaml --engine URL [--engine URL ...] [--revision N]
[--host H] [--port P]`: the router alone, in front of engines started elsewhere (the daemon embeds it instead).

Serves the spec's listen address (HTTPS when tls.cert_file/key_file are set). SIGHUP re-reads the file and
hot-reloads auth, routing, sla, cloud and rollout settings without dropping requests in flight. Engines that
were started with LLMDEPLOY_ENGINE_TOKEN need the same variable here: the router sends it to them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import uvicorn

from llmdeploy.openai_api import event_loop
from llmdeploy.openai_api.guard import HTTPLimits, add_http_limit_args, uvicorn_settings
from llmdeploy.openai_api.headers import ENGINE_TOKEN_ENV
from llmdeploy.router.app import create_router
from llmdeploy.router.table import EngineEndpoint, RevisionRoute, RoutingTable
from llmdeploy.spec.addresses import is_loopback

log = logging.getLogger("llmdeploy.router")


class Server(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        # an idle TLS keep-alive connection would hold the drain for up to 30 s waiting for the client's
        # close_notify (asyncio's ssl_shutdown_timeout): drop those at once; busy ones still finish
        for conn in list(self.server_state.connections):
            cycle = getattr(conn, "cycle", None)
            transport = getattr(conn, "transport", None)
            idle = cycle is None or getattr(cycle, "response_complete", False)
            if idle and transport is not None and transport.get_extra_info("sslcontext") is not None:
                transport.abort()
        await super().shutdown(sockets)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmdeploy.router", description="llmdeploy router (standalone)"
    )
    p.add_argument("--config", required=True, help="the deployment YAML (llmdeploy.yaml)")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="engine base URL, e.g. http://127.0.0.1:8001 (repeatable)",
    )
    p.add_argument("--revision", type=int, default=1, help="revision number the engines serve (default: 1)")
    p.add_argument("--host", default=None, help="override the host of `listen`")
    p.add_argument("--port", type=int, default=None, help="override the port of `listen`")
    add_http_limit_args(p)
    return p


def load_spec(path: str):
    """The validated spec, or exit 2 with every problem listed as file:line:col."""
    from llmdeploy.spec.loader import SpecFileError, load_spec_file

    try:
        result = load_spec_file(path)
    except SpecFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    for w in result.warnings:
        print(w.format("warning"), file=sys.stderr)
    if not result.ok:
        for e in result.errors:
            print(e.format("error"), file=sys.stderr)
        raise SystemExit(2)
    return result.spec


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spec = load_spec(args.config)
    logging.basicConfig(
        level=spec.logging.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    host = args.host or spec.listen_host
    port = spec.listen_port if args.port is None else args.port
    if not spec.cloud.enabled and not args.engine:
        print("error: give at least one --engine URL, or enable the cloud in the YAML", file=sys.stderr)
        return 2
    if not is_loopback(host) and not spec.tls.enabled:
        log.warning(
            "listening on %s without TLS: keys and prompts cross the network in clear text (set tls.*)", host
        )
    token = os.environ.get(ENGINE_TOKEN_ENV) or None
    engines = [EngineEndpoint(url, f"r{i + 1}", True, token) for i, url in enumerate(args.engine)]
    table = RoutingTable([RevisionRoute(args.revision, "stable", 100.0, engines)])
    router = create_router(spec, table)
    tls = {"ssl_certfile": spec.tls.cert_file, "ssl_keyfile": spec.tls.key_file} if spec.tls.enabled else {}
    config = uvicorn.Config(
        router.app,
        host=host,
        port=port,
        access_log=False,
        log_level=spec.logging.level,
        timeout_graceful_shutdown=30,
        **uvicorn_settings(HTTPLimits(args.http_read_timeout, args.max_connections)),
        **tls,
    )
    server = Server(config)

    async def serve() -> None:
        loop = asyncio.get_running_loop()

        def reload() -> None:
            try:
                router.update_spec(load_spec(args.config))
            except SystemExit:
                log.error("reload refused: %s does not validate; keeping the running settings", args.config)

        if hasattr(signal, "SIGHUP"):
            loop.add_signal_handler(signal.SIGHUP, reload)
        scheme = "https" if tls else "http"
        log.info(
            "router for %r on %s://%s:%d -> %s",
            spec.model.served_alias,
            scheme,
            host,
            port,
            ", ".join(args.engine) or "cloud only",
        )
        await server.serve()

    event_loop.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
