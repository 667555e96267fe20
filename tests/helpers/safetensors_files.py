"""Safetensors files written byte by byte, for tests that need real headers without a model."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A valid safetensors file of zeros (float32): 8-byte header length, JSON header, data."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
