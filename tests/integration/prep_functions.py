"""User functions that the preprocessing integration tests name as pipeline stages (``"<this module>:<name>"``).

Servers import this module only when their ``--preprocess-allow`` admits it. A function cannot
know its sample's ID, so the misbehaving ones pick their victim by its height in pixels, which
the tests make unique.
"""

from __future__ import annotations

import os
import time

import numpy as np

# How often :func:`hold` looks for its gate file.
GATE_POLL_S = 0.01


def fail_on_height(x: np.ndarray, rng: np.random.Generator, *, height: int) -> np.ndarray:
    """Pass an HWC image through unchanged; raise ``ValueError`` on the one ``height`` pixels tall."""
    if x.shape[0] == height:
        raise ValueError(f"no image may be {height} pixels tall")
    return x


def square_crop(x: np.ndarray, rng: np.random.Generator, *, side: int, short_height: int) -> np.ndarray:
    """The central ``side`` x ``side`` crop of an HWC image, one column short for the image ``short_height`` tall."""
    top, left = (x.shape[0] - side) // 2, (x.shape[1] - side) // 2
    width = side - 1 if x.shape[0] == short_height else side
    return np.ascontiguousarray(x[top : top + side, left : left + width])


def hold(x: np.ndarray, rng: np.random.Generator, *, gate: str) -> np.ndarray:
    """Pass ``x`` through once the file ``gate`` exists; until then wait, announced by a file
    ``<gate>.<pid>`` so a test can find this worker process mid-task."""
    if not os.path.exists(gate):
        with open(f"{gate}.{os.getpid()}", "w"):
            pass
        while not os.path.exists(gate):
            time.sleep(GATE_POLL_S)
    return x
