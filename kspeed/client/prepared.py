"""Serve a torchvision-style folder dataset from KSpeed: its files cached on the servers, its
loader and transforms run on the servers when they can be sent as data, else on the client.

Usage (normally through :meth:`kspeed.KSpeedClient.wrap`)::

    folder = ImageFolder("/data/imgs", transform=my_transform)    # any object with .samples, .loader
    loader = client.wrap(folder, batch_size=64)                    # registers and preloads the files
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, targets in loader:                             # as DataLoader(folder, ...) yields
            train(images, targets)

The wrapped dataset is duck-typed: ``.samples`` is a list of ``(path, target)`` pairs, ``.loader``
maps a file to a sample, ``.transform`` and ``.target_transform`` are optional. Its files become a
KSpeed dataset whose sample ``i`` is ``samples[i]``: a ``dir`` dataset over the files' common root
when the samples are exactly that tree in sorted order (no file is written), otherwise a ``list``
file of absolute paths in a hidden ``.kspeed`` directory under that root (``list_dir=`` moves it).
The dataset's name is a hash of the paths, so wrapping the same files again attaches to the data
already cached. Targets never travel: the client looks them up by the delivered sample IDs.

When the loader is torchvision's PIL loader and every transform is one of torchvision's common
ones (:func:`kspeed.client.prep.offload.folder_pipeline`), the dataset gets a pipeline: the servers
decode and run the transforms up to the last uint8 one, re-created from their parameters and
seeded per sample, and the client runs the float rest (``ToTensor``, ``Normalize``) and
``collate_fn``; the dataset's name then also hashes the pipeline. Otherwise (or with
``offload=0``, or when the servers refuse the pipeline) the loader, transforms and ``collate_fn``
run in spawned worker processes (:mod:`kspeed.client.prep.workers`), and why is logged once; the
loader gets each sample's bytes as an ``io.BytesIO`` (torchvision's path-based
``pil_loader``/``default_loader`` are swapped for the same PIL code on a file object). They must
therefore be picklable (module-level functions or objects), and the batches keep the sampler's
order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from kspeed.client.dataset import KSpeedDataset
from kspeed.client.options import FeedOptions
from kspeed.client.prep.gpu_stages import GpuStages
from kspeed.client.prep.offload import folder_pipeline
from kspeed.client.prep.workers import (
    Draw,
    InlinePool,
    SampleFailure,
    Stages,
    TransformPool,
    check_loader,
    check_picklable,
    resolve_loader,
    run_samples,
)
from kspeed.client.spec import DatasetSpec
from kspeed.control.progress import PreloadSummary
from kspeed.errors import AccessDeniedError, ConfigError, DatasetError, KSpeedError, StateError
from kspeed.preprocess.pipeline import CACHES, Pipeline

if TYPE_CHECKING:
    from kspeed.client.client import KSpeedClient

__all__ = ["WrapOptions", "WrappedDataset", "folder_spec", "wrap"]

log = logging.getLogger(__name__)

#: Worker processes when ``num_workers`` is not given.
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
#: Batches in flight per worker (the ``DataLoader`` default ``prefetch_factor``).
PREFETCH_PER_WORKER = 2
LIST_DIR = ".kspeed"
NO_WORKERS = (
    "a wrapped dataset runs its own worker processes and cannot itself run in DataLoader workers; "
    "iterate it directly, or use DataLoader(wrapped, batch_size=None, num_workers=0)"
)


# -- registration ----------------------------------------------------------------------------------


def _tree_keys(root: str) -> list[str] | None:
    """The non-hidden files under ``root`` as the servers' ``dir`` listing keys them, sorted.

    ``None`` when a symbolic link is met: the servers check links against their allow-list, so
    such a tree is registered as a list instead.
    """
    keys = []
    for top, dirs, files in os.walk(root):
        if any(os.path.islink(os.path.join(top, d)) for d in dirs):
            return None
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for f in files:
            path = os.path.join(top, f)
            if os.path.islink(path):
                return None
            if not f.startswith("."):
                keys.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(keys)


def _write_list(path: str, paths: Sequence[str]) -> None:
    text = "".join(f"{p}\n" for p in paths).encode()
    try:
        with open(path, "rb") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(text)
    os.replace(tmp, path)


def folder_spec(
    paths: Sequence[str],
    *,
    list_dir: str | None = None,
    name: str | None = None,
    pipeline: Pipeline | None = None,
    cache: str = "",
) -> DatasetSpec:
    """The dataset spec whose sample ``i`` is the file ``paths[i]`` (absolute paths), with ``pipeline``
    and ``cache``.

    A ``dir`` spec over the common root when the paths are exactly its non-hidden files in sorted
    order, else a ``list`` file written to ``list_dir`` (default ``<root>/.kspeed``).

    Raises:
        ConfigError: a path cannot be named in a list file, or the list file cannot be written.
    """
    root = os.path.commonpath(paths)
    if root in paths:
        root = os.path.dirname(root)
    keys = [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]
    kind = "dir" if keys == sorted(keys) and _tree_keys(root) == keys else "list"
    digest = hashlib.sha256("\n".join([kind, *paths]).encode()).hexdigest()
    list_name = name or f"wrap-{digest[:24]}"  # the list file is the same with or without a pipeline
    if name is None:
        name = f"{list_name}-{pipeline.digest()[:12]}" if pipeline is not None else list_name
        name += f"-{cache}" if cache else ""
    if kind == "dir":
        return DatasetSpec(name=name, uri=root, kind="dir", pipeline=pipeline, cache=cache)
    for p in paths:
        if "\n" in p or p != p.strip():
            raise ConfigError(
                f"sample path {p!r} has a line break or surrounding spaces and cannot be named in a list file",
                field="samples",
                value=p,
            )
    directory = list_dir if list_dir is not None else os.path.join(root, LIST_DIR)
    uri = os.path.join(os.path.abspath(directory), f"{list_name}.list")
    try:
        os.makedirs(directory, exist_ok=True)
        _write_list(uri, paths)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the list file of the wrapped dataset to {uri}: {exc}; pass list_dir= a "
            "writable directory the servers are allowed to read",
            field="list_dir",
            value=directory,
        ) from exc
    log.debug("wrapped %d files as dataset %s (list %s)", len(paths), name, uri)
    return DatasetSpec(name=name, uri=uri, kind="list", pipeline=pipeline, cache=cache)


# -- iteration -------------------------------------------------------------------------------------


@dataclass
class _Task:
    future: Future
    epoch: int
    index: int
    ids: list[int]


class WrappedDataset(IterableDataset):
    """Collated batches of a folder dataset whose bytes the KSpeed servers deliver.

    Yields what ``DataLoader(folder, batch_size, sampler)`` would: ``collate_fn`` of
    ``(transform(loader(file)), target_transform(target))`` pairs, in the sampler's order.

    With a pipeline (``inner.pipeline``, e.g. the loader and transforms offloaded by :func:`wrap`)
    the samples the servers preprocessed arrive as their server stages' output and only the
    client-side stages run here (the rest run all stages), each seeded by ``(seed, epoch, sample,
    stage)``; ``gpu`` stages then run on the collated batch on ``inner.device``.

    Args:
        inner: the KSpeed dataset over the folder's files (sample ``i`` = ``paths[i]``).
        paths: each sample's file, for error messages (``None``: samples are named by ID).
        targets: each sample's target (``None``: the dataset's labels, if it has any).
        loader: binary file object (or, if it only takes paths, a path) -> sample; ``None`` with a
            pipeline.
        transform: applied to each loaded (or pipeline-prepared) sample, or ``None``.
        target_transform: applied to each target, or ``None``.
        collate_fn: list of ``(sample, target)`` pairs -> batch.
        num_workers: worker processes (default: up to 4, one per CPU; 0: in the training process).
        prefetch: batches in flight (default: 2 per worker).

    Raises:
        ConfigError: a bad worker or prefetch count, or ``paths``/``targets`` not one per sample.
    """

    def __init__(
        self,
        inner: KSpeedDataset,
        *,
        paths: Sequence[str] | None = None,
        targets: Sequence[Any] | None = None,
        loader: Callable[..., Any] | None = None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        collate_fn: Callable[..., Any] = default_collate,
        num_workers: int | None = None,
        prefetch: int | None = None,
    ) -> None:
        super().__init__()
        self._closed = True
        workers = DEFAULT_WORKERS if num_workers is None else num_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(
                f"num_workers must be a non-negative integer, got {workers!r}", field="num_workers", value=workers
            )
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch <= 0):
            raise ConfigError(
                f"prefetch must be a positive integer, got {prefetch!r}", field="prefetch", value=prefetch
            )
        for given in (paths, targets):
            if given is not None and len(given) != inner.num_samples:
                raise ConfigError(
                    f"dataset {inner.name!r} has {inner.num_samples} samples but {len(given)} paths or targets "
                    "were given",
                    field="samples",
                )
        self._inner = inner
        self._paths = list(paths) if paths is not None else None
        self._targets = list(targets) if targets is not None else None
        pipeline = inner.pipeline
        self._stages = Stages(
            None if pipeline is not None else loader,
            transform,
            target_transform,
            collate_fn,
            check_loader(loader, self._paths[0]) if loader is not None and pipeline is None and self._paths else "file",
            pipeline=pipeline,
            seed=inner.seed,
            server_stages=pipeline.server_stages if pipeline is not None else 0,
            cached=inner.cached_stages,
            client_stop=pipeline.gpu_from if pipeline is not None else None,
            skip=inner.on_error == "skip",
            dataset=inner.name,
        )
        self._skipped = 0
        if pipeline is None and loader is None:
            raise ConfigError(f"dataset {inner.name!r}: a loader or a pipeline is needed", field="loader")
        self._gpu = GpuStages(pipeline, inner.seed, inner.device) if pipeline is not None else None
        self._seconds: dict[str, float] = {}
        self.num_workers = workers
        self.prefetch = prefetch if prefetch is not None else max(PREFETCH_PER_WORKER * workers, 1)
        self._pool: TransformPool | InlinePool | None = None
        self._delivered = 0
        self._closed = False

    @property
    def name(self) -> str:
        """The KSpeed dataset's name."""
        return self._inner.name

    @property
    def dataset(self) -> KSpeedDataset:
        """The KSpeed dataset delivering the raw bytes."""
        return self._inner

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._inner.epoch

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return len(self._inner)

    def __reduce__(self) -> Any:
        raise StateError(NO_WORKERS)

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None:
            raise StateError(NO_WORKERS)
        self._check_open()
        batches = iter(self._inner)
        self._delivered = self._inner.state_dict()["batches"]
        if self._pool is None:
            self._pool = TransformPool(self.num_workers, self._stages) if self.num_workers else InlinePool(self._stages)
        return self._deliver(batches, self._pool)

    def _deliver(self, batches: Iterator[Any], pool: TransformPool | InlinePool) -> Iterator[Any]:
        pending: deque[_Task] = deque()
        try:
            for batch in batches:
                pending.append(self._submit(pool, batch))
                if len(pending) >= self.prefetch:
                    yield self._collect(pending.popleft())
            while pending:
                yield self._collect(pending.popleft())
        except GeneratorExit:  # the loop stopped early: drop the batches in flight, keep the workers
            for task in pending:
                task.future.cancel()
            raise
        except BaseException:
            for task in pending:
                task.future.cancel()
            self._stop_pool()
            raise

    def _submit(self, pool: TransformPool | InlinePool, batch: Any) -> _Task:
        """Copy the batch's bytes into one buffer, give its ring range back and queue it.

        A batch the servers preprocessed whole, with no client stage left but the default
        collation, is collated here straight from the ring (one copy, no worker round trip).
        """
        if self._collates_here(batch):
            return self._collate_here(batch)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        buffer = bytearray(int(offsets[-1]))
        dst = np.frombuffer(buffer, dtype=np.uint8)
        for i, sample in enumerate(batch.samples):
            dst[offsets[i] : offsets[i + 1]] = sample.numpy()
        del dst
        ids = batch.ids.tolist()
        epoch, index = batch.epoch, batch.index
        targets = self._targets_of(batch, ids)
        draw = Draw(epoch, tuple(ids), tuple(bool(r) for r in batch.remote.tolist()))
        batch.release()
        paths = self._paths
        names = [os.path.basename(paths[i]) for i in ids] if paths and self._stages.loader_takes == "path" else []
        future = pool.submit(buffer, offsets.tolist(), targets, names, draw)
        return _Task(future, epoch, index, ids)

    def _targets_of(self, batch: Any, ids: list[int]) -> list[Any]:
        if self._targets is not None:
            return [self._targets[i] for i in ids]
        if self._inner.labelled:
            return batch.labels.tolist()
        return [None] * len(ids)

    def _collates_here(self, batch: Any) -> bool:
        """Whether every sample of ``batch`` arrived ready (only decoding and collating left)."""
        stages = self._stages
        if stages.pipeline is None or stages.transform is not None or stages.collate_fn is not default_collate:
            return False
        remote = bool(batch.remote.all())
        local = not batch.remote.any()
        return len(batch) > 0 and (
            (remote and stages.client_stop == stages.server_stages)
            or (local and stages.cached > 0 and stages.client_stop == stages.cached)
        )

    def _collate_here(self, batch: Any) -> _Task:
        ids = batch.ids.tolist()
        draw = Draw(batch.epoch, tuple(ids), tuple(bool(r) for r in batch.remote.tolist()))
        future: Future = Future()
        try:
            views = [memoryview(sample.numpy()) for sample in batch.samples]
            future.set_result(run_samples(self._stages, None, views, self._targets_of(batch, ids), [], draw))
        except SampleFailure as exc:
            future.set_exception(exc)
        finally:
            batch.release()  # default_collate copied the samples out of the ring
        return _Task(future, batch.epoch, batch.index, ids)

    def _collect(self, task: _Task) -> Any:
        where = f"batch {task.index} of epoch {task.epoch} of dataset {self.name!r}"
        try:
            result = task.future.result()
        except SampleFailure as exc:
            if exc.position is None:
                raise DatasetError(
                    f"collating {where} ({len(task.ids)} samples) failed: {exc.text}", dataset=self.name
                ) from exc
            sample = task.ids[exc.position]
            named = f"sample {sample} ({self._paths[sample]})" if self._paths else f"sample {sample}"
            raise DatasetError(
                f"{named} in {where}: the loader, pipeline stages or transforms failed on the client: {exc.text}",
                dataset=self.name,
                sample=sample,
            ) from exc
        except BrokenProcessPool as exc:
            raise DatasetError(
                f"a transform worker process died during {where} (killed, crashed or out of memory)", dataset=self.name
            ) from exc
        except Exception as exc:
            raise DatasetError(
                f"{where} failed in a transform worker: {type(exc).__name__}: {exc}", dataset=self.name
            ) from exc
        self._delivered += 1
        for position, why in result.skipped:
            sample = task.ids[position]
            named = f"sample {sample} ({self._paths[sample]})" if self._paths else f"sample {sample}"
            log.warning("dataset %s: %s left out of %s (on_error='skip'): %s", self.name, named, where, why)
        self._skipped += len(result.skipped)
        for name, seconds in result.seconds.items():
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        if self._gpu is not None:
            return self._gpu.apply(result.value, task.epoch, task.ids)
        return result.value

    def worker_pids(self) -> list[int]:
        """Process IDs of the running transform workers (none before the first iteration or after close)."""
        return self._pool.pids() if self._pool is not None else []

    # -- epochs, resume, operations --------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration delivers (see :meth:`KSpeedDataset.set_epoch`)."""
        self._inner.set_epoch(epoch)
        self._delivered = self._inner.state_dict()["batches"]

    def state_dict(self) -> dict[str, Any]:
        """The position in batches handed to the caller (batches still in the workers do not count)."""
        return {**self._inner.state_dict(), "batches": self._delivered}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken (see :meth:`KSpeedDataset.load_state_dict`)."""
        self._inner.load_state_dict(state)
        self._delivered = self._inner.state_dict()["batches"]

    def preload(self, *, quiet: bool | None = None, timeout: float | None = None) -> PreloadSummary:
        """Start (or join) the servers' preload of the files and wait for it (see :meth:`KSpeedDataset.preload`)."""
        return self._inner.preload(quiet=quiet, timeout=timeout)

    def stats(self) -> dict[str, Any]:
        """The KSpeed dataset's delivery figures, the transform workers in use, the seconds each
        client-side stage took (summed over workers; ``receive``: decoding the servers' output) and
        each server stage (:meth:`KSpeedDataset.server_stage_seconds`, from the manager)."""
        seconds = dict(self._seconds)
        if self._gpu is not None:
            seconds.update(self._gpu.seconds)
        return {
            **self._inner.stats(),
            "workers": len(self.worker_pids()),
            "client_stage_seconds": seconds,
            "server_stage_seconds": self._inner.server_stage_seconds() if self._inner.pipeline is not None else {},
            "skipped": self._skipped,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"wrapped dataset {self.name!r} is closed; wrap the folder dataset again")

    def _stop_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Join the worker processes and close the KSpeed dataset."""
        if self._closed:
            return
        self._closed = True
        self._stop_pool()
        try:
            self._inner.close()
        except KSpeedError as exc:
            log.warning("wrapped dataset %s: error while closing: %s", self.name, exc)

    def __enter__(self) -> WrappedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _folder_samples(dataset: Any) -> tuple[list[str], list[Any]]:
    samples = getattr(dataset, "samples", None)
    if not isinstance(samples, Sequence) or not samples:
        kind = type(dataset).__name__
        raise ConfigError(
            f"{kind} has no non-empty .samples list of (path, target) pairs (as torchvision's "
            "ImageFolder/DatasetFolder have)",
            field="dataset",
            value=kind,
        )
    paths, targets = [], []
    for i, entry in enumerate(samples):
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 2:
            raise ConfigError(
                f"{type(dataset).__name__}.samples[{i}] is {entry!r}, not a (path, target) pair",
                field="samples",
                value=entry,
            )
        paths.append(os.path.abspath(os.fspath(entry[0])))
        targets.append(entry[1])
    return paths, targets


@dataclass(frozen=True)
class WrapOptions:
    """How :meth:`KSpeedClient.wrap` serves a folder dataset, beyond the feed's own options.

    Attributes:
        collate_fn: list of ``(sample, target)`` pairs -> batch (default ``default_collate``).
        loader: replaces the dataset's ``loader``; called on a binary file object, or on a path to a
            scratch file of the sample's bytes if it only takes paths.
        num_workers: transform worker processes (default: up to 4, one per CPU).
        prefetch: batches in flight in the workers (default: 2 per worker).
        list_dir: where to write the list file when one is needed (default ``<root>/.kspeed``).
        name: the dataset's name in the cluster (default: from a hash of the paths).
        preload: wait for the servers to cache the files before returning.
        cache: ``"preprocessed"``: the servers keep each image after the leading transforms that
            are not random and give a fixed size (e.g. ``Resize`` and ``CenterCrop``), applied once
            at preload; ``""`` (default): they keep the files' bytes.
    """

    collate_fn: Callable[..., Any] | None = None
    loader: Callable[..., Any] | None = None
    num_workers: int | None = None
    prefetch: int | None = None
    list_dir: str | None = None
    name: str | None = None
    preload: bool = True
    cache: str = ""


def wrap(client: KSpeedClient, dataset: Any, options: FeedOptions, wrapping: WrapOptions) -> WrappedDataset:
    """Register ``dataset``'s files with ``client``, preload them and wrap them (see the module docstring).

    Raises:
        ConfigError: the dataset lacks ``.samples``/``.loader``, a stage cannot be pickled, the
            loader needs a path, or the list file cannot be written (named).
        DatasetError: the servers list another number of files than the dataset has.
    """
    paths, targets = _folder_samples(dataset)
    stages = Stages(
        loader=resolve_loader(wrapping.loader if wrapping.loader is not None else getattr(dataset, "loader", None)),
        transform=getattr(dataset, "transform", None),
        target_transform=getattr(dataset, "target_transform", None),
        collate_fn=wrapping.collate_fn if wrapping.collate_fn is not None else default_collate,
    )
    if wrapping.num_workers != 0:  # the stages travel to spawned workers
        check_picklable(stages)
    if wrapping.cache not in CACHES:
        raise ConfigError(
            f"cache {wrapping.cache!r} is not one of '', 'preprocessed'", field="cache", value=wrapping.cache
        )
    pipeline, why = (
        (None, "offload=0")
        if options.offload == 0 and not wrapping.cache
        else folder_pipeline(stages.loader, stages.transform, cache=bool(wrapping.cache))
    )
    if wrapping.cache and pipeline is None:
        raise ConfigError(
            f"cache={wrapping.cache!r} needs the loader and transforms to run on the servers, and {why}",
            field="cache",
            value=wrapping.cache,
        )
    inner = None
    level = logging.DEBUG
    if pipeline is not None:
        spec = folder_spec(
            paths, list_dir=wrapping.list_dir, name=wrapping.name, pipeline=pipeline, cache=wrapping.cache
        )
        try:
            inner = client.open(spec, options)
            stages = dataclasses.replace(stages, loader=None, transform=None)
            log.debug("dataset %s: loader and transforms offloaded to the servers (%s)", spec.name, pipeline)
        except (AccessDeniedError, ConfigError) as exc:
            if wrapping.cache:
                raise
            why = f"the servers refused its pipeline: {exc}"
            level = logging.WARNING  # the servers' preprocess_allow or workers, not the dataset: worth a word
    if inner is None:
        log.log(level, "wrapped dataset: its loader and transforms run in client workers (%s)", why)
        spec = folder_spec(paths, list_dir=wrapping.list_dir, name=wrapping.name)
        inner = client.open(spec, options)
    try:
        if inner.num_samples != len(paths):
            raise DatasetError(
                f"dataset {spec.name!r} ({spec.uri}) lists {inner.num_samples} files on the servers, "
                f"the wrapped dataset has {len(paths)} samples (did the files change?)",
                dataset=spec.name,
            )
        if wrapping.preload:
            inner.preload()
        return WrappedDataset(
            inner,
            paths=paths,
            targets=targets,
            num_workers=wrapping.num_workers,
            prefetch=wrapping.prefetch,
            **stages.named(),
        )
    except BaseException:
        inner.close()
        raise
