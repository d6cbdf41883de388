"""A user-function module whose import a test can see and hold up.

Imported with ``PREP_PROBE_DIR`` set (a server passes it to its sandboxed workers with
``preprocess_env`` and lets them write there with ``preprocess_write_paths``), it leaves
``imported.<pid>`` there, then waits while a file ``hold`` is there (a minute at most), as a module
that takes long to import does; while a file ``spin`` is there it keeps the interpreter to itself,
in calls of about two seconds each that release nothing, as the initialisation of a large
extension module (torch's) does.
"""

from __future__ import annotations

import os
import time

import numpy as np

_DIR = os.environ.get("PREP_PROBE_DIR", "")
if _DIR:
    with open(os.path.join(_DIR, f"imported.{os.getpid()}"), "w"):
        pass
    _deadline = time.monotonic() + 60
    while os.path.exists(os.path.join(_DIR, "hold")) and time.monotonic() < _deadline:
        time.sleep(0.01)
    _begun = time.perf_counter()
    sum(range(1 << 20))
    _per_spin = int((1 << 20) * 2.0 / max(time.perf_counter() - _begun, 1e-6))  # numbers summed in about 2 s
    while os.path.exists(os.path.join(_DIR, "spin")) and time.monotonic() < _deadline:
        sum(range(_per_spin))  # one C call: no other thread of this process runs meanwhile


def same(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` unchanged."""
    return x
