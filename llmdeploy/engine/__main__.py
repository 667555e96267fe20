"""`python -m llmdeploy.engine --model PATH --served-alias NAME --host 127.0.0.1 --port N [engine options]`.

Engine options are the YAML's model.dtype, model.max_model_len and engine.* keys with dashes; their types,
choices, defaults and help come from llmdeploy/spec/models.py, so the CLI can never drift from the YAML.

With LLMDEPLOY_ENGINE_TOKEN in its environment (the daemon sets it) the engine serves its /v1 routes,
/tokenize and /detokenize only to requests carrying that token (the router's); without it, none is needed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from llmdeploy.engine.errors import CANNOT_LOAD_EXIT, CapacityError
from llmdeploy.engine.resources import kv_cache_over_memory
from llmdeploy.openai_api.guard import HTTPLimits, add_http_limit_args
from llmdeploy.openai_api.headers import ENGINE_TOKEN_ENV
from llmdeploy.spec.models import EngineSpec, ModelSpec, SLASpec
from llmdeploy.spec.parallel import ParallelSpec

log = logging.getLogger("llmdeploy.engine")
MODEL_KEYS = ("dtype", "max_model_len", "quantization")
MAX_BODY_BYTES = 32 * 1024 * 1024  # = asgi.MAX_BODY_BYTES, not imported so that --help stays light


def add_spec_option(parser: argparse.ArgumentParser, name: str, info: FieldInfo) -> None:
    flag = "--" + name.replace("_", "-")
    help_text = f"{info.description} (default: {info.default})"
    if info.annotation is bool:
        parser.add_argument(
            flag, dest=name, action=argparse.BooleanOptionalAction, default=info.default, help=help_text
        )
    elif typing.get_origin(info.annotation) is typing.Literal:
        parser.add_argument(
            flag, dest=name, choices=typing.get_args(info.annotation), default=info.default, help=help_text
        )
    else:
        parser.add_argument(
            flag, dest=name, type=info.annotation, default=info.default, help=help_text, metavar=name.upper()
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmdeploy.engine",
        description="llmdeploy engine: an OpenAI-compatible server over one model.",
    )
    p.add_argument("--model", required=True, help="HF folder (safetensors), a .gguf file, or builtin:<name>")
    p.add_argument(
        "--served-alias",
        default=ModelSpec.model_fields["served_alias"].default,
        help="the only `model` name clients may send",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default: 8000)")
    p.add_argument("--base-dir", default=None, help="folder that relative model paths resolve against")
    for key in MODEL_KEYS:
        add_spec_option(p, key, ModelSpec.model_fields[key])
    for key, info in EngineSpec.model_fields.items():
        add_spec_option(p, key, info)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: info)",
    )
    p.add_argument(
        "--log-bodies",
        action="store_true",
        help="log prompt and completion text (off: only sizes and timings)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM (default: 30)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"request bodies over this get 413 (default: {MAX_BODY_BYTES})",
    )
    add_http_limit_args(p)
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help=f"{ParallelSpec.model_fields['tensor_parallel'].description}; this process is rank 0 and starts the "
        "others (default: 1)",
    )
    sla_default = SLASpec.model_fields["ttft_p99_ms"].default
    p.add_argument(
        "--ttft-sla-ms",
        type=float,
        default=sla_default,
        help="the deployment's sla.ttft_p99_ms: first-token deadlines for scheduling count from it "
        f"(default: {sla_default:g})",
    )
    return p


def engine_config(args: argparse.Namespace) -> Any:
    from llmdeploy.engine.config import EngineConfig

    keys = (*MODEL_KEYS, *EngineSpec.model_fields)
    return EngineConfig(
        model=args.model,
        base_dir=args.base_dir,
        ttft_sla_ms=args.ttft_sla_ms,
        tensor_parallel=args.tensor_parallel,
        **{k: getattr(args, k) for k in keys},
    )


def log_startup(engine: Any, args: argparse.Namespace) -> None:
    cap, dtype = engine.capacity, str(getattr(engine, "dtype", args.dtype)).removeprefix("torch.")
    log.info(
        "serving %s (%s) as %r: dtype %s, device %s, kernels %s, KV cache %d tokens = %.1f sequences of max_model_len %d",
        args.model,
        engine.arch.model_type,
        args.served_alias,
        dtype,
        getattr(engine, "device", args.device),
        getattr(engine, "kernel_backend", args.kernel_backend),
        cap.tokens,
        cap.max_model_len_seqs,
        engine.config.max_model_len,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = engine_config(args)
    except (ValidationError, AssertionError, ValueError) as exc:
        print(f"error: invalid engine options: {exc}", file=sys.stderr)
        return 2

    from llmdeploy.spec.sources import ModelSourceError, resolve_model_source

    try:  # before the engine's imports (seconds): a bad path or a corrupt download fails at once
        resolve_model_source(args.model, Path(args.base_dir) if args.base_dir else None)
    except ModelSourceError as exc:
        log.error("cannot load model %s: %s", args.model, exc)
        return CANNOT_LOAD_EXIT

    too_big = kv_cache_over_memory(config.kv_cache_gb) if config.device == "cpu" else None
    if too_big:  # before the engine's imports and weights; the memory it found: another try may find more
        log.error("cannot start: %s", too_big)
        return 1

    from llmdeploy.engine.async_engine import AsyncLLMEngine

    try:
        engine = AsyncLLMEngine(config)
    except CapacityError as exc:  # the memory it found: another try may find more
        log.error("cannot start: %s", exc)
        return 1
    except (ModelSourceError, ValueError) as exc:  # a bad path, checkpoint or option: say so, no traceback
        log.error("cannot load model %s: %s", args.model, exc)
        return CANNOT_LOAD_EXIT
    log_startup(engine, args)
    return run_server(engine, args, os.environ.get(ENGINE_TOKEN_ENV) or None)


def run_server(engine: Any, args: argparse.Namespace, internal_token: str | None) -> int:
    """Serve until SIGTERM/SIGINT, drain, stop the engine; the exit status (0 after a clean drain)."""
    import uvicorn

    from llmdeploy.engine.asgi import DrainingServer
    from llmdeploy.engine.server import create_app
    from llmdeploy.openai_api.guard import uvicorn_settings

    app = create_app(
        engine,
        args.served_alias,
        log_bodies=args.log_bodies,
        internal_token=internal_token,
        max_body_bytes=args.max_body_bytes,
    )
    limits = HTTPLimits(args.http_read_timeout, args.max_connections)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=max(1, round(args.drain_timeout)),
        lifespan="on",
        **uvicorn_settings(limits),
    )
    server = DrainingServer(config)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
