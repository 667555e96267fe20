"""Weight files checked where a model source is resolved: a corrupt or truncated download is refused in milliseconds
with the file named, by `validate` (at model.path's line) and by the engine process before its imports (exit 1, no
traceback)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmdeploy.cli.main import app
from llmdeploy.engine.errors import CANNOT_LOAD_EXIT
from llmdeploy.spec.sources import ModelSourceError, check_weight_files, resolve_model_source, weight_files
from tests.helpers.safetensors_files import write_safetensors


@pytest.fixture
def model(tiny_llama, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    return folder


def test_whole_files_pass(model):
    check_weight_files(model)
    assert weight_files(model) == [model / "model.safetensors"]


@pytest.mark.parametrize(
    "content",
    [
        b"\x00" * 64,  # a header length of 0
        struct.pack("<Q", 10**9) + b"{}",  # a header past the file's end
        struct.pack("<Q", 4) + b"{oops",  # not JSON
        struct.pack("<Q", 2) + b"[]",  # JSON, not a table of tensors
        struct.pack("<Q", 40) + b'{"w": {"data_offsets": ["0", "4"]}}    ',  # offsets that are not numbers
        b"<html>rate limited</html>",  # what a download can save instead of the file
    ],
)
def test_a_file_that_is_not_safetensors_is_named(model, content):
    (model / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelSourceError, match=r"model\.safetensors is not a safetensors file"):
        check_weight_files(model)


def test_metadata_is_not_a_tensor(tmp_path):
    raw = json.dumps(
        {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    )
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw.encode() + bytes(8))
    check_weight_files(tmp_path)


def test_a_truncated_file_is_refused_with_the_sizes(model):
    path = model / "model.safetensors"
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(
        ModelSourceError, match=rf"truncated: its tensors need {len(whole)} bytes, the file has"
    ):
        check_weight_files(model)


def test_shards_are_read_from_the_index_and_a_missing_one_is_named(tmp_path):
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [2, 3]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": [4]})
    write_safetensors(tmp_path / "consolidated.safetensors", {"c": [1]})  # another naming scheme: not loaded
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in weight_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    check_weight_files(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelSourceError, match=r"model-00002-of-00002\.safetensors is missing"):
        check_weight_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')  # cut short
    with pytest.raises(ModelSourceError, match=r"index\.json is not a weight index"):
        check_weight_files(tmp_path)


def test_without_an_index_model_files_come_before_others(tmp_path):
    write_safetensors(tmp_path / "consolidated.safetensors", {"c": [1]})
    assert [p.name for p in weight_files(tmp_path)] == ["consolidated.safetensors"]
    write_safetensors(tmp_path / "model-a.safetensors", {"a": [1]})
    assert [p.name for p in weight_files(tmp_path)] == ["model-a.safetensors"]


def test_the_engine_refuses_a_corrupt_download_before_its_imports(model):
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "llmdeploy.engine", "--model", str(model), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == CANNOT_LOAD_EXIT, proc.stderr[-3000:]  # no retry would help
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert any(
        "cannot load model" in e and "model.safetensors is not a safetensors file" in e for e in errors
    )
    assert not any("Traceback" in e for e in errors)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert (
        "llmdeploy.spec.sources" in imported and "torch" not in imported
    )  # refused before the heavy imports


def test_a_gguf_path_must_hold_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>not found</html>")
    with pytest.raises(
        ModelSourceError, match=r"not a GGUF file \(it does not start with GGUF's magic bytes\)"
    ):
        resolve_model_source(str(bad))
    bad.write_bytes(
        b"GGUF" + bytes(20)
    )  # the magic: the rest is read by the loader, which says what is wrong
    assert resolve_model_source(str(bad)).kind == "gguf"


def test_validate_names_the_line_of_a_path_that_is_not_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"\x00" * 16)
    spec = tmp_path / "llmdeploy.yaml"
    spec.write_text("name: t\nmodel:\n  path: m.gguf\n  served_alias: x\nlisten: 127.0.0.1:18080\n")
    r = CliRunner().invoke(app, ["validate", str(spec)])
    assert r.exit_code == 2, r.output
    assert f"{spec}:3:3: model.path: model file" in r.output and "is not a GGUF file" in r.output


def test_validate_names_the_line_of_a_corrupt_weight_file(model, tmp_path):
    (model / "model.safetensors").write_bytes(b"<html>rate limited</html>")
    spec = tmp_path / "llmdeploy.yaml"
    spec.write_text(f"name: t\nmodel:\n  path: {model}\n  served_alias: x\nlisten: 127.0.0.1:18080\n")
    r = CliRunner().invoke(app, ["validate", str(spec)])
    assert r.exit_code == 2, r.output
    assert f"{spec}:3:3: model.path: {model}/model.safetensors is not a safetensors file" in r.output
