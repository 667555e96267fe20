"""The model's config.json as transformers parses it, kept once parsed.

AutoConfig.from_pretrained builds the architecture's config class (LlamaConfig, Qwen2Config, ...), whose module
imports transformers.activations -> integrations.hub_kernels -> torch.distributed.tensor: 1.2-2 s of every engine
start (AMD EPYC Zen 3, 2026-12-08), and AutoTokenizer.from_pretrained parses the config the same way unless it is
given one. The parsed config (defaults filled in, rope parameters standardized, a sliding window the model does not
use cleared) is kept as JSON under the cache, keyed by config.json's bytes and the transformers version; a later
start rebuilds it as a plain PretrainedConfig carrying the same attributes, which is all the engine reads. A kept
file that cannot be read is parsed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import transformers
from transformers import AutoConfig, PretrainedConfig

from llmdeploy.engine.kept_files import read_kept, write_kept
from llmdeploy.engine.weights_cache import cache_root

log = logging.getLogger("llmdeploy.engine")
FORMAT_VERSION = 1  # bump when what a file holds changes
# what every supported architecture's parsed config carries; a kept file without one of them is parsed again
REQUIRED = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


def configs_dir() -> Path:
    return cache_root() / "configs"


def kept_config_path(folder: Path) -> Path:
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    digest.update(f"{transformers.__version__}/{FORMAT_VERSION}".encode())
    return configs_dir() / f"{digest.hexdigest()[:32]}.json"


def read_model_config(folder: Path) -> PretrainedConfig:
    """`folder`'s config as AutoConfig parses it: kept from an earlier parse of the same config.json where there
    is one, else parsed and kept."""
    path = kept_config_path(folder)
    kept = read_kept(path)
    if kept is not None and all(kept.get(name) is not None for name in REQUIRED):
        return PretrainedConfig.from_dict(kept)
    if kept is not None:
        log.warning("kept config %s lacks what the engine reads: parsing config.json again", path)
    config = AutoConfig.from_pretrained(folder)
    write_kept(path, json.loads(config.to_json_string(use_diff=False)))
    return config
