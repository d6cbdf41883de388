"""KSpeedClient: the training-side library (epoch plans, receive ring, delivery).

Names are imported on first use, so ``from kspeed.client import DatasetSpec`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Batch", "DatasetSpec", "KSpeedClient", "KSpeedDataset"]

_HOMES = {"Batch": "batch", "DatasetSpec": "spec", "KSpeedClient": "client", "KSpeedDataset": "dataset"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
