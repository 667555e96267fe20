from __future__ import annotations

import pytest

from tests.router.conftest import cloud, engine, fakes, start_router  # noqa: F401  (the router rig)


@pytest.fixture(scope="module")
def engine_url(shared_engine):
    """A real engine server over the tiny random llama (ChatML template, no tools in it: the generic format)."""
    # the generic tools prompt is long in the tiny 512-token vocabulary
    return shared_engine("--max-model-len", "1024")[1]


@pytest.fixture(scope="module")
def oai(engine_url):
    from openai import OpenAI

    with OpenAI(base_url=f"{engine_url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        yield client
