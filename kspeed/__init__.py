"""KSpeed: disaggregated data provisioning for deep-learning training.

Servers on spare nodes pool their memory, preload a dataset from backend storage and push ready
samples straight into the training process's buffers; a manager allocates and watches them.

The client names (:class:`KSpeedClient`, :class:`KSpeedDataset`, :class:`DatasetSpec`,
:class:`Batch`) are imported on first use, so ``import kspeed`` does not import torch (servers
have none).
"""

from __future__ import annotations

import importlib
from typing import Any

from kspeed._version import PROTOCOL_VERSIONS, __version__
from kspeed.errors import KSpeedError

__all__ = ["PROTOCOL_VERSIONS", "Batch", "DatasetSpec", "KSpeedClient", "KSpeedDataset", "KSpeedError", "__version__"]

_CLIENT = {
    "Batch": "kspeed.client.batch",
    "DatasetSpec": "kspeed.client.spec",
    "KSpeedClient": "kspeed.client.client",
    "KSpeedDataset": "kspeed.client.dataset",
}


def __getattr__(name: str) -> Any:
    module = _CLIENT.get(name)
    if module is None:
        raise AttributeError(f"module 'kspeed' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
