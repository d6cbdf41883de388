"""Helpers that write small datasets for the server storage tests."""

from __future__ import annotations

import numpy as np

REGION = 1 << 20


def write_tree(root, sizes, *, classes=("cat", "dog"), seed=0):
    """Write len(sizes) random files split over class folders; returns {relative key: bytes}."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, n in enumerate(sizes):
        key = f"{classes[i % len(classes)]}/{i:05d}.bin"
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.bytes(int(n))
        path.write_bytes(data)
        out[key] = data
    return out
