"""Triton kernels run compiled on a GPU and under the interpreter on CPU, so these tests run everywhere.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before llmdeploy.kernels.triton_ops is
first imported; conftest modules load before the test modules that import it. Without CUDA it is forced on.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
