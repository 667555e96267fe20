"""The YAML contract: every setting's name, type and default lives here and nowhere else (the `parallel:`
section in parallel.py, the shared base in base.py)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from llmdeploy.policies.capability import Feature
from llmdeploy.spec.addresses import is_loopback, split_listen
from llmdeploy.spec.base import RuleError, Section
from llmdeploy.spec.parallel import ParallelSpec

URL_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._~:-]*$")
NAME_SAFE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
SHA256_KEY = re.compile(r"^sha256:[0-9a-f]{64}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ModelSpec(Section):
    path: str = Field(
        "builtin:smollm2-135m-instruct",
        description="HF folder (safetensors), a .gguf file, or builtin:<name>",
    )
    served_alias: str = Field(
        "chat-model-v1", description="what clients send as `model`; anything else gets 404"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: bfloat16 on CUDA; on CPU bfloat16 where the CPU has AVX-512 BF16 or AMX and bf16 is "
        "measured faster at start, else float32 (bfloat16 changes greedy output); float32 with "
        "`model.quantization` int8 or gguf",
    )
    max_model_len: int = Field(2048, ge=16, description="longest prompt + completion in tokens")
    quantization: Literal["none", "int8", "gguf"] = Field(
        "none",
        description="CPU (greedy output may differ from float32). int8: weight-only, the weights quantized to "
        "int8 blocks at load (GGUF's Q8_0 layout; a quarter of float32's bytes for bandwidth-bound decode), inputs "
        "kept in float; gguf: a .gguf model's own Q8_0/Q4_0/Q4_1 weights served as stored, without a float copy "
        "(other types dequantized), each layer's input rounded to int8 per block as llama.cpp does where the CPU "
        "has AVX-512 VNNI, and on AVX2 CPUs below 20 rows (decode; prefill keeps float inputs there); "
        "LLMDEPLOY_QUANT_VNNI=0 keeps float inputs everywhere. With `model.dtype: auto` the activations are "
        "float32, which the quantized kernels take (bfloat16 ones decode slower: SmolLM2 int8 batch 1 at 2.3x "
        "float32's time)",
    )

    @field_validator("path")
    @classmethod
    def _path_non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("quantization")
    @classmethod
    def _gguf_needs_gguf_file(cls, v: str, info: ValidationInfo) -> str:
        path = str(info.data.get("path", ""))
        if v == "gguf" and not (path.lower().endswith(".gguf") or path.startswith("builtin:")):
            raise ValueError(
                "'gguf' serves a .gguf file's own quantized weights: model.path must be a .gguf file"
            )
        return v

    @field_validator("served_alias")
    @classmethod
    def _alias_url_safe(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        if not URL_SAFE.match(v):
            raise ValueError(
                "must be URL-safe: letters, digits and . _ ~ : - (starting with a letter or digit)"
            )
        return v


class TLSSpec(Section):
    cert_file: str | None = Field(None, description="PEM certificate; with key_file the router serves HTTPS")
    key_file: str | None = Field(None, description="PEM private key")

    @model_validator(mode="after")
    def _both_or_neither(self) -> TLSSpec:
        if (self.cert_file is None) != (self.key_file is None):
            given = "cert_file" if self.cert_file is not None else "key_file"
            raise RuleError("cert_file and key_file must be given together", given, ("cert_file", "key_file"))
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class LoggingSpec(Section):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="log level of daemon, router and engines"
    )
    bodies: bool = Field(False, description="log prompt and completion text (off: only sizes and timings)")


class APIKeySpec(Section):
    name: str = Field(..., description="shown in logs and metrics instead of the key")
    key_env: str | None = Field(None, description="environment variable holding the key")
    key: str | None = Field(None, description="only as a hash: sha256:<64 hex digits>")
    allow_cloud: bool = Field(True, description="false: this key's requests never leave the machine")
    rpm: int | None = Field(None, ge=1, description="requests per minute for this key (null: unlimited)")

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not URL_SAFE.match(v):
            raise ValueError("must be non-empty and URL-safe")
        return v

    @field_validator("key_env")
    @classmethod
    def _env_ok(cls, v: str | None) -> str | None:
        if v is not None and not ENV_NAME.match(v):
            raise ValueError("must be an environment variable name")
        return v

    @field_validator("key")
    @classmethod
    def _hashed_only(cls, v: str | None) -> str | None:
        if v is not None and not SHA256_KEY.match(v):
            raise ValueError(
                "inline keys must be hashed as sha256:<64 lowercase hex digits>; "
                "put the key itself in an environment variable and use key_env"
            )
        return v

    @model_validator(mode="after")
    def _exactly_one_source(self) -> APIKeySpec:
        if (self.key_env is None) == (self.key is None):
            field = "key" if self.key is not None else None
            raise RuleError("give exactly one of key_env or key (sha256:...)", field, ("key_env", "key"))
        return self


class AuthSpec(Section):
    api_key_required: bool = Field(
        True, description="clients must send a key (Authorization: Bearer or api-key)"
    )
    keys: list[APIKeySpec] = Field(
        default_factory=list, description="accepted keys, each from an env var or a sha256 hash"
    )
    metrics_public: bool = Field(False, description="serve /metrics without a key")

    @model_validator(mode="after")
    def _unique_names(self) -> AuthSpec:
        names = [k.name for k in self.keys]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise RuleError(f"key names must be unique: {', '.join(dupes)}", "keys")
        return self


class EngineSpec(Section):
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV cache block")
    max_num_seqs: int = Field(64, ge=1, description="sequences in one batch at most")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="tokens in one step at most (prefill chunks + decodes)"
    )
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU, in GiB")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="share of GPU memory for weights + activations + KV on CUDA"
    )
    prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    kernel_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="auto: triton on CUDA, torch on CPU"
    )
    seed: int = Field(0, description="default sampling seed of the engine")
    compile: bool = Field(
        False,
        description="torch.compile the decoder layers on CPU (compiled code cached on disk under the llmdeploy "
        "cache; the first start pays the compile)",
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two")
        return v

    @model_validator(mode="after")
    def _batch_holds_a_block(self) -> EngineSpec:
        if self.max_num_batched_tokens < self.block_size:
            raise RuleError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= block_size ({self.block_size}): "
                "a step must hold at least one KV block",
                "max_num_batched_tokens",
                ("block_size",),
            )
        return self


class SLASpec(Section):
    ttft_p99_ms: float = Field(
        1000, gt=0, description="time to first token, p99 target; predicted misses overflow to the cloud"
    )
    tpot_p99_ms: float = Field(200, gt=0, description="time per output token, p99 target")


class CloudSpec(Section):
    enabled: bool = Field(False, description="send overflow, bursts and failures to this endpoint")
    provider: Literal["qianfan", "openai-compatible"] = Field(
        "qianfan", description="qianfan (Baidu Qianfan v2) or any OpenAI-compatible API"
    )
    base_url: str | None = Field(None, description="e.g. https://qianfan.baidubce.com/v2")
    api_key_env: str | None = Field(
        None, description="environment variable holding the cloud key (never the key itself)"
    )
    model: str | None = Field(None, description="model name at the provider; the alias is rewritten to it")
    timeout_s: float = Field(60, gt=0, description="read timeout per request")
    connect_timeout_s: float = Field(5, gt=0, description="connect timeout")
    max_retries: int = Field(
        2, ge=0, le=10, description="retries before the first token (connect errors, 429, 5xx)"
    )
    ca_file: str | None = Field(None, description="extra CA bundle for the cloud's certificate")
    capabilities: list[Feature] | None = Field(
        None,
        description="what the cloud model supports (null: the provider's defaults); routing sends it only those",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="the cloud model's context length (null: not judged)"
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^\s/]+", v):
            raise ValueError("must be an http:// or https:// URL")
        return v.rstrip("/") if v else v

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not ENV_NAME.match(v):
            raise ValueError("must be an environment variable name (the key itself never goes in the YAML)")
        return v

    @model_validator(mode="after")
    def _enabled_needs_endpoint(self) -> CloudSpec:
        if self.enabled:
            missing = [f for f in ("base_url", "api_key_env") if getattr(self, f) is None]
            if missing:
                raise RuleError(
                    f"enabled: true requires {' and '.join(missing)} (the key itself stays in that environment variable)",
                    "enabled",
                    ("base_url", "api_key_env"),
                )
        return self


class OverflowSpec(Section):
    max_queue_depth: int = Field(64, ge=0, description="waiting requests beyond this overflow to the cloud")
    use_predicted_ttft: bool = Field(
        True, description="overflow when the predicted TTFT would break sla.ttft_p99_ms"
    )


class BurstSpec(Section):
    local_rps: float = Field(
        20, gt=0, description="local arrival rate (token bucket); excess goes to the cloud"
    )


class BreakerSpec(Section):
    consecutive_failures: int = Field(5, ge=1, description="failures in a row that open a backend's breaker")
    error_rate: float = Field(0.5, gt=0, le=1, description="error rate over the window that opens it")
    window_s: float = Field(30, gt=0, description="window for the error rate")
    cooldown_s: float = Field(10, gt=0, description="open time before a half-open probe")


class RoutingSpec(Section):
    overflow: OverflowSpec = Field(default_factory=OverflowSpec)
    burst: BurstSpec = Field(default_factory=BurstSpec)
    breaker: BreakerSpec = Field(default_factory=BreakerSpec)
    local_wait_s: float = Field(
        30,
        ge=0,
        description="the most a request that may not leave the machine waits for local room; a predicted longer"
        " wait gets 503 with Retry-After at once",
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="request bodies over this get 413")
    replica_choice: Literal["prefix", "least_loaded"] = Field(
        "prefix",
        description="prefix: a request goes to the replica its prompt's prefix (a chat's system prompt and first "
        "user message, a completion prompt's first 512 bytes) hashes to, whose prefix cache likely holds it, "
        "unless that replica is over the load bound; least_loaded: the least loaded replica",
    )
    prefix_load_slack: float = Field(
        0.25,
        ge=0,
        le=10,
        description="with replica_choice prefix, a replica holding ceil((1 + this) x the mean load) requests is "
        "passed over for the next one in the prefix's order, so one hot prefix cannot overload one replica; at N "
        "replicas a slack of N - 1 or more never binds",
    )
    local_timeout_s: float = Field(
        120,
        gt=0,
        description="least time a local request may take before it is cut and answered 504 (timeout); a "
        "non-stream request gets more: its queue wait and max_tokens at the engine's measured decode rate, x4",
    )
    continue_on_failure: Literal["off", "cloud"] = Field(
        "off",
        description="cloud: a local stream that fails after its first token is finished by the cloud (the text so "
        'far as an assistant prefix); the chunks from the cloud carry "llmdeploy": {"continued_on": "cloud"}',
    )

    @field_validator("continue_on_failure", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        return "off" if v is False else v  # YAML 1.1 reads an unquoted `off` as false


class AutoRollbackSpec(Section):
    enabled: bool = Field(True, description="roll the candidate back by itself when it breaks these limits")
    max_error_rate: float = Field(
        0.05, ge=0, le=1, description="candidate error rate that triggers a rollback"
    )
    max_ttft_p99_ms: float = Field(3000, gt=0, description="candidate TTFT p99 that triggers a rollback")
    min_requests: int = Field(20, ge=1, description="requests in the window before judging")
    window_s: float = Field(60, gt=0, description="sliding window in seconds")


class RolloutSpec(Section):
    canary_percent: float = Field(
        0, ge=0, le=100, description="share of traffic for a new revision once it is ready"
    )
    sticky_header: str = Field(
        "x-session-id", description="requests with the same value stay on one revision"
    )
    auto_rollback: AutoRollbackSpec = Field(default_factory=AutoRollbackSpec)

    @field_validator("sticky_header")
    @classmethod
    def _header_name(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9-]+$", v):
            raise ValueError("must be an HTTP header name")
        return v.lower()


class CostSpec(Section):
    """Prices that turn token counts into money: what the spill to the cloud costs and what local serving costs."""

    cloud_input_per_1m: float | None = Field(
        None, ge=0, description="what the cloud charges per 1M input (prompt) tokens (null: not shown)"
    )
    cloud_output_per_1m: float | None = Field(
        None, ge=0, description="what the cloud charges per 1M output (completion) tokens"
    )
    local_per_hour: float | None = Field(
        None, ge=0, description="what this machine costs per hour (rent, or its price over its life + power)"
    )
    currency: str = Field(
        "USD", min_length=1, max_length=8, description="label printed next to the figures (no conversion)"
    )


class DeploymentSpec(Section):
    name: str = Field("chat", description="deployment name; key of the state directory")
    model: ModelSpec = Field(default_factory=ModelSpec)
    listen: str = Field("127.0.0.1:8000", description="host:port of the proxy; non-loopback needs auth")
    tls: TLSSpec = Field(default_factory=TLSSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    sla: SLASpec = Field(default_factory=SLASpec)
    cloud: CloudSpec = Field(default_factory=CloudSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    cost: CostSpec = Field(default_factory=CostSpec)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not NAME_SAFE.match(v):
            raise ValueError(
                "must be 1-63 characters of a-z, 0-9, '-' or '_', starting with a letter or digit"
            )
        return v

    @field_validator("listen")
    @classmethod
    def _listen_ok(cls, v: str) -> str:
        split_listen(v)
        return v

    @model_validator(mode="after")
    def _exposed_needs_auth(self) -> DeploymentSpec:
        if not is_loopback(self.listen_host) and not self.auth.api_key_required:
            raise RuleError(
                f"listen address {self.listen} is reachable from other machines: anyone there could use the "
                "model (and spend cloud quota); set auth.api_key_required: true or listen on 127.0.0.1",
                "listen",
                ("auth.api_key_required",),
            )
        return self

    @property
    def listen_host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return split_listen(self.listen)[1]


def not_yet_supported(spec: DeploymentSpec) -> tuple[tuple[str, ...], str] | None:
    """Legal keys whose values this release cannot run yet: (path, message). validate warns, apply refuses."""
    from llmdeploy.spec.parallel import RAY_INSTALL_HINT, ray_installed

    if spec.parallel.backend == "ray" and not ray_installed():
        return ("parallel", "backend"), f"backend ray needs Ray on this machine: {RAY_INSTALL_HINT}"
    return None
