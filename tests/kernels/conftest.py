from __future__ import annotations

import pytest
import torch


@pytest.fixture
def two_threads():
    """Two threads: work is then split across them (decode's flash-decoding merge, the linears' channel tiles)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
