"""A user-function module whose import a test can see and hold up.

Imported with ``KSPEED_TEST_PROBE_DIR`` set, it leaves ``imported.<pid>`` there, then waits while a
file ``hold`` is there (a minute at most), as a module that takes long to import does.
"""

from __future__ import annotations

import os
import time

import numpy as np

_DIR = os.environ.get("KSPEED_TEST_PROBE_DIR", "")
if _DIR:
    with open(os.path.join(_DIR, f"imported.{os.getpid()}"), "w"):
        pass
    _deadline = time.monotonic() + 60
    while os.path.exists(os.path.join(_DIR, "hold")) and time.monotonic() < _deadline:
        time.sleep(0.01)


def same(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` unchanged."""
    return x
