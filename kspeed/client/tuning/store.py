"""The client's side of the manager's metric store (:mod:`kspeed.manager.tunings`): the model
signature a decision is kept under, and the record of a decision."""

from __future__ import annotations

import hashlib
import math
import os
import sys
from typing import Any

from kspeed.client.tuning.decision import Decision
from kspeed.errors import ConfigError
from kspeed.proto import kspeed_pb2

__all__ = ["model_signature", "record_of"]

MAX_SIGNATURE = 256


def model_signature(model: Any, job: str, batch_size: int) -> str:
    """What a job's decisions are kept under: ``model`` as given (a name), a digest of a
    ``torch.nn.Module``'s structure (each submodule's class and each parameter's and buffer's
    name, shape and dtype: FastFlow matches a model's graph, not its weights), or, for ``None``,
    the job, the script and the batch size. The batch size is part of every signature: it changes
    the step's throughput.

    Raises:
        ConfigError: ``model`` is none of those, or a name longer than 200 characters.
    """
    if model is None:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
        return f"job:{job}/{script}/batch{batch_size}"[:MAX_SIGNATURE]
    if isinstance(model, str):
        if not model or len(model) > 200:
            raise ConfigError(
                f"model must be a name of 1..200 characters or a torch.nn.Module, got {len(model)} characters",
                field="model",
                value=model[:80],
            )
        return f"name:{model}/batch{batch_size}"
    named = getattr(model, "named_modules", None)
    if not callable(named):
        raise ConfigError(
            f"model must be a name or a torch.nn.Module, got {type(model).__name__}", field="model", value=repr(model)
        )
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__qualname__}\n".encode())
    for kind in ("named_parameters", "named_buffers"):
        for name, tensor in getattr(model, kind)():
            digest.update(f"{kind}:{name}:{tuple(tensor.shape)}:{tensor.dtype}\n".encode())
    return f"torch:{type(model).__qualname__}:{digest.hexdigest()[:24]}/batch{batch_size}"


def record_of(
    dataset: str, model: str, ratio: float, stages: int, decision: Decision | None
) -> kspeed_pb2.TuningRecord:
    """The record that keeps the split ``ratio`` (at ``stages``), with the rates of ``decision``."""
    rates = {}
    if decision is not None:
        rates = {k: float(v) for k, v in decision.inputs.items() if math.isfinite(v)}
    return kspeed_pb2.TuningRecord(
        dataset=dataset,
        model=model,
        ratio=ratio,
        server_stages=stages,
        rates=rates,
        reason=(decision.reason if decision is not None else "")[:1000],
    )
