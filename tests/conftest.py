from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch="llama", **config_overrides) -> Path of a random HF folder, built once per session."""
    from tests.helpers.tiny_models import make_tiny_model

    made: dict[tuple, Path] = {}

    def build(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return made[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def stop_at_end():
    """stop_at_end(stop): `stop()` runs when the session ends, side by side with every other one registered. The
    session's servers each take a second or more to drain and exit; one after another they made the last test's
    teardown 11-13 s. The first error any of them raised is raised once all have run."""
    stops: list = []
    yield stops.append
    with ThreadPoolExecutor(max_workers=max(1, len(stops))) as pool:
        futures = [pool.submit(stop) for stop in stops]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def shared_engine(tiny_llama, tmp_path_factory, stop_at_end):
    """shared_engine(*extra_args) -> (ServerProcess, url): one real engine server over the tiny llama per set of
    extra arguments (tests/engine/test_server.py's ENGINE_ARGS first), shared by the test modules that only send it
    requests, so the session starts it once (~5 s a start) instead of once a module."""
    from tests.engine.test_server import start_engine

    started: dict[tuple[str, ...], tuple] = {}

    def get(*extra: str):
        if extra not in started:
            log = tmp_path_factory.mktemp("shared-engine") / "engine.log"
            started[extra] = start_engine(tiny_llama, log, *extra)
            stop_at_end(started[extra][0].stop)
        return started[extra]

    return get


def _triton_interpreter_without_cuda() -> None:
    """TRITON_INTERPRET is read when a kernel is decorated: set it before any test module imports one."""
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_triton_interpreter_without_cuda()
