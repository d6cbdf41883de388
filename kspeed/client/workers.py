"""A pool of spawned processes that turn delivered sample bytes into collated training batches.

Until preprocessing runs on the servers, a wrapped folder dataset's own loader and transforms run
on the client, in processes started with ``spawn`` (the client's gRPC channels and receive ring do
not survive ``fork``). A task is one batch: its bytes as one buffer with sample offsets, and its
targets; the worker returns the batch collated as a ``DataLoader`` worker would, so tensors come
back through torch's shared-memory reductions rather than the pipe. The checks of the stages
(picklable, loader works on a file object) run in the caller, before any worker starts.
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch.multiprocessing
from torch.utils.data import default_collate

from kspeed.errors import ConfigError, StateError

__all__ = [
    "SampleFailure",
    "Stages",
    "TransformPool",
    "check_loader",
    "check_picklable",
    "pil_file_loader",
    "resolve_loader",
]

log = logging.getLogger(__name__)

#: Seconds a worker gets to finish its batch at close before it is terminated.
JOIN_TIMEOUT = 10.0
_TORCHVISION_LOADERS = ("pil_loader", "default_loader")

# Set once per worker process by _init: (loader, transform, target_transform, collate_fn).
_STAGES: Stages | None = None


class SampleFailure(Exception):
    """Raised in a worker: the sample at ``position`` of the task (``None``: collation) failed.

    Carries the original error as text, since user exceptions need not be picklable.
    """

    def __init__(self, position: int | None, text: str) -> None:
        super().__init__(position, text)
        self.position = position
        self.text = text

    def __str__(self) -> str:
        return self.text


def pil_file_loader(file: io.BytesIO) -> Any:
    """torchvision's ``pil_loader`` for a file object: the image converted to RGB."""
    from PIL import Image

    image = Image.open(file)
    return image.convert("RGB")


def resolve_loader(loader: Any) -> Callable[..., Any]:
    """The loader to call on a file object: torchvision's path-only PIL loaders become :func:`pil_file_loader`.

    Raises:
        ConfigError: ``loader`` is not callable.
    """
    if not callable(loader):
        raise ConfigError(
            f"the wrapped dataset's loader must be callable, got {loader!r}", field="loader", value=loader
        )
    if (
        getattr(loader, "__module__", "") == "torchvision.datasets.folder"
        and getattr(loader, "__name__", "") in _TORCHVISION_LOADERS
    ):
        return pil_file_loader
    return loader


def check_loader(loader: Callable[..., Any], path: str) -> None:
    """Refuse a loader that reads ``path`` by name but fails on its bytes as ``io.BytesIO``.

    When the client cannot read ``path`` or the loader fails on the path too (a bad file), the
    check passes: iterating names that sample if it fails.

    Raises:
        ConfigError: the loader accepts a path only (named, with the error it raised).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        log.debug("loader check skipped: cannot read %s here: %s", path, exc)
        return
    try:
        loader(io.BytesIO(data))
        return
    except Exception as exc:
        on_file = exc
    try:
        loader(path)
    except Exception:
        return
    name = getattr(loader, "__qualname__", repr(loader))
    raise ConfigError(
        f"loader {name} reads {path} by path but fails on a file object "
        f"({type(on_file).__name__}: {on_file}); KSpeed hands the loader each sample's bytes as "
        "io.BytesIO: pass loader= a function of a binary file object (PIL.Image.open accepts one)",
        field="loader",
        value=name,
    ) from on_file


@dataclass(frozen=True)
class Stages:
    """What turns one sample's bytes into training input, as a ``DataLoader`` over the dataset would.

    Attributes:
        loader: binary file object -> sample (e.g. a decoded image).
        transform: applied to each loaded sample, or ``None``.
        target_transform: applied to each target, or ``None``.
        collate_fn: list of ``(sample, target)`` pairs -> batch.
    """

    loader: Callable[..., Any]
    transform: Callable[..., Any] | None = None
    target_transform: Callable[..., Any] | None = None
    collate_fn: Callable[..., Any] = default_collate

    def named(self) -> dict[str, Any]:
        """Each stage by its name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_picklable(stages: Stages | Mapping[str, Any]) -> None:
    """Refuse a stage that cannot reach a spawned worker, at wrap time rather than at the first batch.

    Raises:
        ConfigError: a stage (named) cannot be pickled.
    """
    for what, stage in (stages.named() if isinstance(stages, Stages) else stages).items():
        try:
            pickle.dumps(stage)
        except Exception as exc:
            raise ConfigError(
                f"the wrapped dataset's {what} {stage!r} cannot be pickled ({exc}); it runs in spawned "
                "worker processes: use a module-level function or a picklable object",
                field=what,
                value=repr(stage),
            ) from exc


def _init(stages: Stages) -> None:
    global _STAGES
    torch.set_num_threads(1)  # as DataLoader workers: one thread each, the pool gives the parallelism
    _STAGES = stages


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _run(buffer: bytes | bytearray, offsets: Sequence[int], targets: Sequence[Any]) -> Any:
    """Load, transform and collate one batch in a worker (``offsets`` has one more entry than samples)."""
    stages = _STAGES
    if stages is None:
        raise StateError("transform worker used before its initializer ran")
    loader, transform, target_transform = stages.loader, stages.transform, stages.target_transform
    collate_fn = stages.collate_fn
    view = memoryview(buffer)
    items = []
    for i, target in enumerate(targets):
        try:
            item = loader(io.BytesIO(view[offsets[i] : offsets[i + 1]]))
            if transform is not None:
                item = transform(item)
            if target_transform is not None:
                target = target_transform(target)
        except Exception as exc:
            raise SampleFailure(i, _describe(exc)) from None
        items.append((item, target))
    try:
        return collate_fn(items)
    except Exception as exc:
        raise SampleFailure(None, _describe(exc)) from None


class TransformPool:
    """``workers`` spawned processes running ``loader``, the transforms and ``collate_fn`` per batch.

    The processes start on the first task and are joined by :meth:`close`.

    Args:
        workers: number of processes.
        stages: the loader, transforms and collation each worker runs.
    """

    def __init__(self, workers: int, stages: Stages) -> None:
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = ProcessPoolExecutor(
            workers, mp_context=torch.multiprocessing.get_context("spawn"), initializer=_init, initargs=(stages,)
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._executor is None

    def submit(self, buffer: bytes | bytearray, offsets: Sequence[int], targets: Sequence[Any]) -> Future:
        """Queue one batch; the future yields the collated batch or raises :class:`SampleFailure`."""
        if self._executor is None:
            raise StateError("the transform pool is closed; iterate the wrapped dataset again to start a new one")
        return self._executor.submit(_run, buffer, offsets, targets)

    def pids(self) -> list[int]:
        """Process IDs of the running workers."""
        executor = self._executor
        processes = getattr(executor, "_processes", None) or {}
        return sorted(processes)

    def close(self) -> None:
        """Cancel queued tasks and join every worker process."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list((getattr(executor, "_processes", None) or {}).values())
        # The executor's own thread joins the workers; a worker stuck in a user transform must not
        # hang close(), so it is terminated after JOIN_TIMEOUT.
        stopper = threading.Thread(
            target=executor.shutdown,
            kwargs={"wait": True, "cancel_futures": True},
            name="kspeed-pool-stop",
            daemon=True,
        )
        stopper.start()
        stopper.join(JOIN_TIMEOUT)
        if stopper.is_alive():
            for process in processes:
                if process.exitcode is None:
                    log.warning(
                        "transform worker %d did not stop within %.0f s; terminating it", process.pid, JOIN_TIMEOUT
                    )
                    process.terminate()
            stopper.join()
        log.debug("transform pool of %d workers closed", self.workers)
