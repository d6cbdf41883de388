"""The training step the analyzer measures: the user's (an import path) or a synthetic one.

A step is named by a string, so that rank processes can rebuild it: ``"pkg.mod:step"`` (a callable
taking one batch, imported from the analyzing process's path), ``"sleep:<ms>"`` (a step that waits,
as a GPU-bound step leaves the CPU free) or ``"cpu:<ms>"`` (a step that keeps one core busy, as a
CPU-bound one does).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

from kspeed.errors import ConfigError

__all__ = ["resolve", "samples_of"]

MAX_STEP_MS = 60_000.0


def _duration(text: str, name: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        raise ConfigError(
            f"step {name!r}: the duration {text!r} is not a number of milliseconds", field="step"
        ) from None
    if not 0 <= ms <= MAX_STEP_MS:
        raise ConfigError(f"step {name!r}: the duration must be 0..{MAX_STEP_MS:g} ms, got {ms:g}", field="step")
    return ms / 1e3


def _sleeping(seconds: float) -> Callable[[Any], None]:
    def step(batch: Any) -> None:
        time.sleep(seconds)

    return step


def _spinning(seconds: float) -> Callable[[Any], None]:
    def step(batch: Any) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    return step


def resolve(name: str) -> Callable[[Any], Any]:
    """The step named ``name`` (see the module docstring).

    Raises:
        ConfigError: the name is malformed, its module or attribute is missing, or it is not callable.
    """
    kind, sep, rest = name.partition(":")
    if not sep or not kind or not rest:
        raise ConfigError(f"step {name!r} must be 'pkg.mod:function', 'sleep:<ms>' or 'cpu:<ms>'", field="step")
    if kind == "sleep":
        return _sleeping(_duration(rest, name))
    if kind == "cpu":
        return _spinning(_duration(rest, name))
    try:
        module = importlib.import_module(kind)
    except ImportError as exc:
        raise ConfigError(f"step {name!r}: module {kind!r} cannot be imported: {exc}", field="step") from exc
    target: Any = module
    for part in rest.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"step {name!r}: {kind} has no attribute {rest!r}", field="step")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"step {name!r}: {rest!r} is not callable", field="step")
    return target


def samples_of(batch: Any) -> int:
    """The samples in a delivered batch: a KSpeed batch, a tensor or array (its first dimension),
    or a tuple/list/dict of them (the first element's)."""
    if isinstance(batch, dict):
        return samples_of(next(iter(batch.values()))) if batch else 0
    if isinstance(batch, (tuple, list)):
        if batch and not isinstance(batch[0], (bytes, bytearray, memoryview)) and hasattr(batch[0], "shape"):
            return samples_of(batch[0])
        if len(batch) == 2 and isinstance(batch[0], (tuple, list)):
            return len(batch[0])
        return len(batch)
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape):
        return int(shape[0])
    return len(batch)
