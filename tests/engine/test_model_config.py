"""The parsed model config kept under the cache (engine/model_config.py): a later start reads the same attributes
AutoConfig gave the first one, without importing the architecture's config class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import PretrainedConfig

from bench import engine_start
from llmdeploy.engine.loader import max_positions_of
from llmdeploy.engine.model_config import kept_config_path, read_model_config
from llmdeploy.engine.models.llama import head_dim_of
from llmdeploy.engine.rope import rope_inv_freq
from tests.engine.test_models import LLAMA3

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": LLAMA3, "tie_word_embeddings": True}),
    "llama-yarn": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
    ),
    "mistral-window": ("MistralConfig", {"sliding_window": 512}),
    "qwen2-unused-window": ("Qwen2Config", {"sliding_window": 256, "use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Kept configs apart from other tests'; the native kernels' build shared (a fresh one takes ~25 s)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LLMDEPLOY_CACHE_DIR", str(engine_start.linked_cache(cache)))


def write_config(folder: Path, cls: str, **kwargs) -> Path:
    getattr(transformers, cls)(**SMALL, **kwargs).save_pretrained(folder)
    return folder


def attributes(config: PretrainedConfig) -> dict:
    """The config's attributes, but those a plain PretrainedConfig holds elsewhere or not at all: model_type (the
    class's attribute there, the instance's here), use_cache (a generation option it drops) and the version stamp."""
    skipped = ("model_type", "use_cache", "transformers_version")
    return {name: value for name, value in vars(config).items() if name not in skipped}


def engine_reads(config: PretrainedConfig) -> tuple:
    inv_freq, scaling = rope_inv_freq(config, head_dim_of(config))
    return head_dim_of(config), max_positions_of(config), inv_freq, scaling


@pytest.mark.parametrize("name", CONFIGS)
def test_the_kept_config_carries_what_autoconfig_parsed(tmp_path, name):
    cls, extra = CONFIGS[name]
    folder = write_config(tmp_path / name, cls, **extra)
    parsed = read_model_config(folder)
    assert type(parsed).__name__ == cls and kept_config_path(folder).is_file()
    kept = read_model_config(folder)
    assert type(kept) is PretrainedConfig  # the architecture's class (and its imports) not needed
    assert attributes(kept) == attributes(parsed)
    (dim, positions, inv_freq, scaling), (dim2, positions2, inv_freq2, scaling2) = map(
        engine_reads, (parsed, kept)
    )
    assert (dim, positions, scaling) == (dim2, positions2, scaling2)
    assert torch.equal(inv_freq, inv_freq2)
    for attr in ("num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "model_type", "eos_token_id"):
        assert getattr(kept, attr) == getattr(parsed, attr), attr


def test_a_changed_config_json_is_parsed_again(tmp_path):
    folder = write_config(tmp_path / "m", "LlamaConfig")
    first = kept_config_path(folder)
    read_model_config(folder)
    write_config(folder, "LlamaConfig", rms_norm_eps=1e-5)
    assert kept_config_path(folder) != first
    config = read_model_config(folder)
    assert type(config).__name__ == "LlamaConfig" and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    "broken", ["{not json", "[1, 2]", '{"model_type": "llama"}', json.dumps({**SMALL, "model_type": None})]
)
def test_a_broken_kept_file_is_parsed_again_and_replaced(tmp_path, broken):
    folder = write_config(tmp_path / "m", "LlamaConfig")
    path = kept_config_path(folder)
    path.parent.mkdir(parents=True)
    path.write_text(broken)
    config = read_model_config(folder)
    assert type(config).__name__ == "LlamaConfig" and config.hidden_size == 64
    assert json.loads(path.read_text())["hidden_size"] == 64
    assert type(read_model_config(folder)) is PretrainedConfig


def test_a_load_with_the_kept_config_imports_neither_config_classes_nor_sympy(tiny_llama):
    """What the kept config is for: a fresh process loading the model with it (the tokenizer given it too) never
    imports the architecture's config module, whose imports cost 1.2-2 s of every engine start; nor does building
    the model import sympy (torch's empty_like on meta tensors did: 0.6 s)."""
    read_model_config(tiny_llama)
    code = (
        "import json, sys\n"
        "from llmdeploy.engine.loader import load_model\n"
        f"loaded = load_model({str(tiny_llama)!r})\n"
        "names = ('transformers.models.llama', 'transformers.activ', 'sympy')\n"
        "imported = sorted(m for m in sys.modules if m.startswith(names))\n"
        "ids = loaded.tokenizer('Hello world').input_ids\n"
        "print(json.dumps({'imported': imported, 'ids': ids, 'kind': type(loaded.model.config).__name__}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    expected = transformers.AutoTokenizer.from_pretrained(tiny_llama)("Hello world").input_ids
    assert seen == {"imported": [], "ids": expected, "kind": "PreTrainedConfig"}
