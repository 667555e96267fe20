"""From bench's command line (and --sla-from's YAML, and --compare's baseline) to one BenchConfig.

Precedence, value by value: the flags, then the deployment YAML (its listen address, served alias, first API
key's variable and its sla section), then the baseline run (its target and its load, so the same load runs
again), then the defaults. Every problem is a ConfigError: exit code 2, nothing has been sent.
"""

from __future__ import annotations

import json
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from llmdeploy.loadgen.chart import ChartError, chart_kind
from llmdeploy.loadgen.client import Target
from llmdeploy.loadgen.parse import (
    Mix,
    parse_burst,
    parse_duration,
    parse_float_list,
    parse_int_list,
    parse_mix,
    parse_percent,
)
from llmdeploy.loadgen.runner import Stop
from llmdeploy.loadgen.session import BenchConfig
from llmdeploy.loadgen.verdict import SLA
from llmdeploy.loadgen.workload import DatasetError, Workload, load_dataset

DEFAULT_CONCURRENCY = "1,4,16,32"
DEFAULT_DURATION = "30s"
DEFAULT_PROMPT_LEN = 128
DEFAULT_OUTPUT_LEN = 128


class ConfigError(ValueError):
    """Invalid input: exit code 2."""


@dataclass
class BenchOptions:
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    concurrency: str | None = None
    rate: str | None = None
    duration: str | None = None
    requests: int | None = None
    prompt_len: int | None = None
    output_len: int | None = None
    mix: str | None = None
    mix_ratio: str | None = None
    dataset: Path | None = None
    stream: bool | None = None
    sla_from: Path | None = None
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    min_success: str = "99%"
    burst: str | None = None
    compare: Path | None = None
    tolerance: str = "10%"
    metrics_url: list[str] = field(default_factory=list)
    timeout: str | None = None  # None here and below: not given, so the baseline's or the default
    warmup: int | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    max_inflight: int | None = None
    json_out: Path | None = None
    ca_file: Path | None = None
    chart: Path | None = None


@dataclass
class Resolved:
    config: BenchConfig
    api_key_env: str | None
    baseline: dict[str, Any] | None
    tolerance: float
    notes: list[str]


def api_base(url: str) -> str:
    """'http://h:8000' or 'http://h:8000/' -> 'http://h:8000/v1'; a URL already ending in /vN is kept."""
    u = url.strip().rstrip("/")
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--url {url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    return u if re.search(r"/v\d+$", parts.path) else u + "/v1"


def metrics_url(url: str) -> str:
    p = urlsplit(url.strip())
    return urlunsplit((p.scheme, p.netloc, "/metrics", "", ""))


def shown_url(url: str) -> str:
    """The URL without user:password@, for reports."""
    p = urlsplit(url.strip())
    return urlunsplit((p.scheme, p.netloc.rsplit("@", 1)[-1], p.path, "", ""))


def _parse(fn, value: str, flag: str):
    try:
        return fn(value)
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None


@dataclass
class _SpecDefaults:
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None


def spec_defaults(path: Path, environ: Mapping[str, str], notes: list[str]) -> _SpecDefaults:
    """The SLA (always through llmdeploy.spec's loader) and, from a valid spec, how to reach the deployment."""
    from llmdeploy.spec.addresses import split_listen
    from llmdeploy.spec.loader import SpecFileError, load_spec_file
    from llmdeploy.spec.models import SLASpec

    try:
        result = load_spec_file(path, env=environ)
    except SpecFileError as e:
        raise ConfigError(f"--sla-from: {e}") from None
    sla_errors = [i for i in result.errors if i.path == "sla" or i.path.startswith("sla.")]
    if sla_errors or (result.spec is None and not result.errors):
        raise ConfigError("--sla-from: " + "; ".join(i.format() for i in sla_errors or result.errors))
    if result.spec is not None and not result.errors:
        spec = result.spec
        host, port = split_listen(spec.listen)
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else (f"[{host}]" if ":" in host else host)
        key_env = next((k.key_env for k in spec.auth.keys if k.key_env and environ.get(k.key_env)), None)
        return _SpecDefaults(
            f"{'https' if spec.tls.enabled else 'http'}://{host}:{port}",
            spec.model.served_alias,
            key_env if spec.auth.api_key_required else None,
            spec.sla.ttft_p99_ms,
            spec.sla.tpot_p99_ms,
        )
    # errors elsewhere (e.g. the model path exists only on the serving machine): its sla section still counts
    notes.append(
        f"{path} has {len(result.errors)} problem(s) outside sla (first: {result.errors[0].format()}); "
        "only its sla section is used"
    )
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    sla = SLASpec.model_validate((raw.get("sla") if isinstance(raw, dict) else None) or {})
    return _SpecDefaults(ttft_p99_ms=sla.ttft_p99_ms, tpot_p99_ms=sla.tpot_p99_ms)


def read_baseline(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--compare: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--compare: {path} is not JSON ({e.msg} at line {e.lineno})") from None
    if not (
        isinstance(data, dict)
        and data.get("tool") == "llmdeploy bench"
        and isinstance(data.get("levels"), list)
    ):
        raise ConfigError(f"--compare: {path} is not a `llmdeploy bench --json` report")
    return data


def resolve(o: BenchOptions, environ: Mapping[str, str] | None = None) -> Resolved:
    environ = os.environ if environ is None else environ
    notes: list[str] = []
    _exclusive(o)
    spec = spec_defaults(o.sla_from, environ, notes) if o.sla_from else _SpecDefaults()
    baseline = read_baseline(o.compare) if o.compare else None
    base_target = (baseline or {}).get("target") or {}
    base_load = (baseline or {}).get("load") or {}
    use_base_load = baseline is not None and not (o.concurrency or o.rate)

    url = o.url or spec.url or base_target.get("url")
    model = o.model or spec.model or base_target.get("model")
    if not url or not model:
        raise ConfigError("give --url and --model (or --sla-from llmdeploy.yaml, or --compare BASELINE.json)")
    key_env = o.api_key_env or spec.api_key_env or base_target.get("api_key_env")
    headers = {}
    if key_env:
        if not environ.get(key_env):
            raise ConfigError(f"--api-key-env: environment variable {key_env} is not set")
        headers["Authorization"] = f"Bearer {environ[key_env]}"

    _run_settings(o, base_load if baseline is not None else {})
    mode, levels = _levels(o, base_load if use_base_load else {})
    stop = _stop(o, base_load if use_base_load and not (o.duration or o.requests) else {})
    stream = (
        o.stream if o.stream is not None else bool(base_load.get("stream", True)) if use_base_load else True
    )
    workload = _workload(o, base_load.get("prompts") if use_base_load else None)
    sla = _sla(o, spec, (baseline or {}).get("sla"), notes)
    burst = _parse(parse_burst, o.burst, "--burst") if o.burst else None
    if burst and sla.ttft_p99_ms is None:
        raise ConfigError(
            "--burst judges TTFT against the SLA: give --ttft-p99-ms or --sla-from llmdeploy.yaml"
        )
    if burst and not stream:
        raise ConfigError("--burst measures TTFT, which only a stream shows: drop --no-stream")
    if not stream and sla.has_latency_target:
        notes.append("--no-stream: a client sees no first token, so TTFT and TPOT are not measured or judged")
    for path, flag in ((o.json_out, "--json"), (o.chart, "--chart")):
        if path is not None and not path.parent.is_dir():
            raise ConfigError(f"{flag} {path}: folder {path.parent} does not exist")
    if o.chart is not None:
        _chart_ok(o.chart)
    for n, flag in ((o.warmup, "--warmup"), (o.seed, "--seed")):
        if n < 0:
            raise ConfigError(f"{flag} must be >= 0")
    if o.max_inflight < 1:
        raise ConfigError("--max-inflight must be >= 1")

    timeout_s = _parse(parse_duration, o.timeout, "--timeout")
    target = Target(api_base(url), model, headers, stream, timeout_s, o.ignore_eos)
    metrics = [m.strip() for m in o.metrics_url] or [metrics_url(url)]
    for m in metrics:
        if urlsplit(m).scheme not in ("http", "https"):
            raise ConfigError(f"--metrics-url {m!r} must be an http:// or https:// URL")
    cfg = BenchConfig(
        shown_url(url),
        target,
        metrics,
        mode,
        levels,
        stop,
        workload,
        sla,
        burst,
        o.warmup,
        o.seed,
        o.max_inflight,
        _ca_file(o.ca_file),
    )
    return Resolved(cfg, key_env, baseline, _parse(parse_percent, o.tolerance, "--tolerance"), notes)


def _run_settings(o: BenchOptions, base_load: dict[str, Any]) -> None:
    """Fill the settings not given from the baseline (the same run again), else the defaults."""
    defaults = {"timeout": "120s", "warmup": 2, "seed": 0, "ignore_eos": False, "max_inflight": 1024}
    recorded = {
        "timeout": f"{base_load['timeout_s']}s" if base_load.get("timeout_s") else None,
        "warmup": base_load.get("warmup"),
        "seed": base_load.get("seed"),
        "ignore_eos": base_load.get("ignore_eos"),
        "max_inflight": base_load.get("max_inflight"),
    }
    for name, default in defaults.items():
        if getattr(o, name) is None:
            setattr(o, name, recorded[name] if recorded[name] is not None else default)


def _ca_file(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        ssl.create_default_context(cafile=str(path))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"--ca-file {path}: not a readable PEM CA bundle ({getattr(e, 'strerror', None) or e})"
        ) from None
    return str(path)


def _chart_ok(path: Path) -> None:
    try:
        chart_kind(path)
    except ChartError as e:
        raise ConfigError(str(e)) from None


def _exclusive(o: BenchOptions) -> None:
    pairs = (
        (o.concurrency, "--concurrency", o.rate, "--rate"),
        (o.duration, "--duration", o.requests, "--requests"),
        (o.mix, "--mix", o.dataset, "--dataset"),
        (o.prompt_len, "--prompt-len", o.mix, "--mix"),
        (o.prompt_len, "--prompt-len", o.dataset, "--dataset"),
    )
    for a, fa, b, fb in pairs:
        if a is not None and b is not None:
            raise ConfigError(f"give {fa} or {fb}, not both")
    if o.mix_ratio is not None and o.mix is None:
        raise ConfigError("--mix-ratio needs --mix LONG:SHORT")
    if o.requests is not None and o.requests < 1:
        raise ConfigError("--requests must be >= 1")
    for n, flag in ((o.prompt_len, "--prompt-len"), (o.output_len, "--output-len")):
        if n is not None and n < 1:
            raise ConfigError(f"{flag} must be >= 1")


def _levels(o: BenchOptions, base_load: dict[str, Any]) -> tuple[Any, list[float]]:
    if o.rate:
        return "rate", _parse(parse_float_list, o.rate, "--rate")
    if o.concurrency:
        return "concurrency", [float(v) for v in _parse(parse_int_list, o.concurrency, "--concurrency")]
    if base_load.get("mode") in ("concurrency", "rate") and base_load.get("levels"):
        return base_load["mode"], [float(v) for v in base_load["levels"]]
    return "concurrency", [float(v) for v in parse_int_list(DEFAULT_CONCURRENCY)]


def _stop(o: BenchOptions, base_load: dict[str, Any]) -> Stop:
    if o.requests is not None:
        return Stop(requests=o.requests)
    if o.duration:
        return Stop(duration_s=_parse(parse_duration, o.duration, "--duration"))
    if base_load.get("requests"):
        return Stop(requests=int(base_load["requests"]))
    if base_load.get("duration_s"):
        return Stop(duration_s=float(base_load["duration_s"]))
    return Stop(duration_s=parse_duration(DEFAULT_DURATION))


def _workload(o: BenchOptions, base: dict[str, Any] | None) -> Workload:
    given = o.prompt_len is not None or o.mix is not None or o.dataset is not None
    base = {} if given or not base else base
    output_len = o.output_len or base.get("output_len") or DEFAULT_OUTPUT_LEN
    dataset_path = o.dataset or (
        Path(base["dataset"]) if base.get("kind") == "dataset" and base.get("dataset") else None
    )
    if dataset_path is not None:
        try:
            items = load_dataset(dataset_path)
        except DatasetError as e:
            raise ConfigError(f"--dataset: {e}") from None
        return Workload(output_len, dataset=items, seed=o.seed, dataset_path=str(dataset_path))
    if o.mix is not None:
        mix = _parse(lambda v: parse_mix(v, o.mix_ratio or "1:1"), o.mix, "--mix")
        return Workload(output_len, mix=mix, seed=o.seed)
    if base.get("kind") == "mix":
        return Workload(
            output_len, mix=Mix(base["long_len"], base["short_len"], base["long_share"]), seed=o.seed
        )
    return Workload(
        output_len, prompt_len=o.prompt_len or base.get("prompt_len") or DEFAULT_PROMPT_LEN, seed=o.seed
    )


def _sla(o: BenchOptions, spec: _SpecDefaults, base_sla: dict[str, Any] | None, notes: list[str]) -> SLA:
    min_success = _parse(parse_percent, o.min_success, "--min-success")
    for v, flag in ((o.ttft_p99_ms, "--ttft-p99-ms"), (o.tpot_p99_ms, "--tpot-p99-ms")):
        if v is not None and not v > 0:
            raise ConfigError(f"{flag} must be > 0")
    ttft = o.ttft_p99_ms if o.ttft_p99_ms is not None else spec.ttft_p99_ms
    tpot = o.tpot_p99_ms if o.tpot_p99_ms is not None else spec.tpot_p99_ms
    if o.sla_from:
        source = str(o.sla_from) + (" + flags" if o.ttft_p99_ms or o.tpot_p99_ms else "")
    elif ttft is not None or tpot is not None:
        source = "flags"
    elif base_sla and (base_sla.get("ttft_p99_ms") or base_sla.get("tpot_p99_ms")):
        notes.append("SLA taken from the baseline report")
        return SLA(base_sla.get("ttft_p99_ms"), base_sla.get("tpot_p99_ms"), min_success, "baseline")
    else:
        source = None
    return SLA(ttft, tpot, min_success, source)
