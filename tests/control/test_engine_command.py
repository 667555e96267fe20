"""The daemon's engine command line carries every engine-relevant YAML setting, and the engine parses it back."""

from __future__ import annotations

from llmdeploy.control.engine_args import engine_command
from llmdeploy.engine.__main__ import build_parser, engine_config
from llmdeploy.spec.models import DeploymentSpec


def config_of(spec: DeploymentSpec):
    argv = engine_command(spec, port=1234)
    return engine_config(build_parser().parse_args(argv[argv.index("llmdeploy.engine") + 1 :]))


def test_yaml_settings_reach_the_engine():
    spec = DeploymentSpec.model_validate(
        {
            "model": {"path": "/m", "quantization": "int8", "dtype": "float32", "max_model_len": 512},
            "engine": {"compile": True, "max_num_seqs": 7, "prefix_caching": False},
            "sla": {"ttft_p99_ms": 1500},
        }
    )
    cfg = config_of(spec)
    assert (cfg.quantization, cfg.compile, cfg.dtype, cfg.max_model_len) == ("int8", True, "float32", 512)
    assert (cfg.max_num_seqs, cfg.prefix_caching, cfg.ttft_sla_ms) == (7, False, 1500.0)


def test_defaults_round_trip():
    cfg = config_of(DeploymentSpec.model_validate({"model": {"path": "/m"}}))
    assert (cfg.quantization, cfg.compile, cfg.prefix_caching) == ("none", False, True)
