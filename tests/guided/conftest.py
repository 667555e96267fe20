from __future__ import annotations

import pytest

from tests.engine.test_server import start_engine
from tests.router.conftest import cloud, engine, fakes, start_router  # noqa: F401  (the router rig)


@pytest.fixture(scope="module")
def engine_url(tiny_llama, tmp_path_factory):
    """A real engine server over the tiny random llama (ChatML template, no tools in it: the generic format)."""
    log = tmp_path_factory.mktemp("guided-engine") / "engine.log"
    # the generic tools prompt is long in the tiny 512-token vocabulary
    proc, url = start_engine(tiny_llama, log, "--max-model-len", "1024")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def oai(engine_url):
    from openai import OpenAI

    with OpenAI(base_url=f"{engine_url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        yield client
