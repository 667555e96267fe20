"""`python -m llmdeploy.engine --model PATH --served-alias NAME --host 127.0.0.1 --port N [engine options]`.

Engine options are the YAML's model.dtype, model.max_model_len and engine.* keys with dashes; their types,
choices, defaults and help come from llmdeploy/spec/models.py, so the CLI can never drift from the YAML.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from llmdeploy.spec.models import EngineSpec, ModelSpec

log = logging.getLogger("llmdeploy.engine")
MODEL_KEYS = ("dtype", "max_model_len")


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
    return p


def engine_config(args: argparse.Namespace) -> Any:
    from llmdeploy.engine.config import EngineConfig

    keys = (*MODEL_KEYS, *EngineSpec.model_fields)
    return EngineConfig(model=args.model, base_dir=args.base_dir, **{k: getattr(args, k) for k in keys})


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

    from llmdeploy.engine.async_engine import AsyncLLMEngine
    from llmdeploy.engine.server import run_server
    from llmdeploy.spec.sources import ModelSourceError

    try:
        engine = AsyncLLMEngine(config)
    except (ModelSourceError, ValueError) as exc:  # a bad path or unsupported model: say so, no traceback
        log.error("cannot load model %s: %s", args.model, exc)
        return 1
    log_startup(engine, args)
    return run_server(
        engine,
        args.served_alias,
        args.host,
        args.port,
        log_bodies=args.log_bodies,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    sys.exit(main())
