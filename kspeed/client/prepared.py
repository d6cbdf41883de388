"""Batches of a KSpeed dataset finished in the training process: its client-side pipeline
stages, or a folder dataset's own loader and transforms, run in worker processes
(:class:`~kspeed.client.prep.workers.TransformWorkers`), then ``collate_fn``.

:meth:`kspeed.KSpeedClient.dataset` returns a :class:`PreparedDataset` for a dataset with a
pipeline; :meth:`kspeed.KSpeedClient.wrap` returns one for a torchvision-style folder dataset
(:mod:`kspeed.client.folders`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from kspeed.client.dataset import KSpeedDataset
from kspeed.client.delivery.device import parse_device
from kspeed.client.prep.gpu_stages import GpuStages
from kspeed.client.prep.interleave import interleave
from kspeed.client.prep.workers import (
    Delivered,
    Draw,
    InlineWorkers,
    SampleFailure,
    Stages,
    StartFailure,
    TransformWorkers,
    check_loader,
    run_samples,
)
from kspeed.client.sampler_view import SamplerView
from kspeed.config import usable_cores
from kspeed.control.progress import PreloadSummary
from kspeed.errors import ConfigError, DatasetError, KSpeedError, StateError

__all__ = ["PreparedDataset", "start_workers", "worker_count"]

log = logging.getLogger(__name__)

#: Worker processes when ``num_workers`` is not given: at most this many, one per usable CPU.
DEFAULT_WORKERS = 4
#: Batches in flight per worker (the ``DataLoader`` default ``prefetch_factor``).
PREFETCH_PER_WORKER = 2
NO_WORKERS = (
    "a dataset prepared on the client runs its own worker processes and cannot itself run in DataLoader "
    "workers; iterate it directly, or use DataLoader(dataset, batch_size=None, num_workers=0)"
)


def worker_count(num_workers: int | None) -> int:
    """The worker processes that ``num_workers`` asks for (``None``: :data:`DEFAULT_WORKERS`, at most
    one per CPU this process may use: :func:`kspeed.config.usable_cores`).

    Raises:
        ConfigError: not a non-negative integer.
    """
    workers = min(DEFAULT_WORKERS, usable_cores()) if num_workers is None else num_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(
            f"num_workers must be a non-negative integer, got {workers!r}", field="num_workers", value=workers
        )
    return workers


def start_workers(num_workers: int | None, preload: Sequence[str]) -> TransformWorkers | None:
    """Transform workers started now, to get ready in the background while the caller goes on
    (registers the dataset); ``None`` for ``num_workers=0``. Give them to a :class:`PreparedDataset`,
    which closes them, or close them.

    Raises:
        ConfigError: a bad ``num_workers``.
        StateError: called from an unguarded top-level line of the main script (named).
    """
    workers = worker_count(num_workers)
    return TransformWorkers(workers, preload=preload) if workers else None


# -- iteration -------------------------------------------------------------------------------------


@dataclass
class _Task:
    future: Future
    epoch: int
    index: int
    ids: list[int]
    remote: int = 0  # samples of it the servers preprocessed
    inline: bool = False  # prepared in the training process (inside next()), not in a worker
    #: a batch prepared in two parts (:meth:`PreparedDataset._split`): the positions the future's
    #: samples hold in the batch, and the servers' part, collated in the training process
    positions: list[int] | None = None
    here: _Part | None = None
    there: Delivered | None = None  # the workers' part of a split batch, once done


@dataclass
class _Part:
    """The servers' samples of a split batch, collated in the training process, or why that failed."""

    positions: list[int]
    outcome: Delivered | SampleFailure


class PreparedDataset(IterableDataset):
    """Collated batches of a folder dataset whose bytes the KSpeed servers deliver.

    Yields what ``DataLoader(folder, batch_size, sampler)`` would: ``collate_fn`` of
    ``(transform(loader(file)), target_transform(target))`` pairs, in the sampler's order.

    With a pipeline (``inner.pipeline``, e.g. the loader and transforms that :meth:`kspeed.KSpeedClient.wrap` offloaded)
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
        num_workers: worker processes (default: up to 4, one per CPU this process may use; 0: in the
            training process).
        prefetch: batches in flight (default: 2 per worker).
        transform_workers: workers already started (:func:`start_workers`, e.g. while the dataset
            registered), used instead of ``num_workers`` new ones; they get this dataset's stages
            and it closes them. Otherwise the workers start with the first batch that needs them.
        device: where the collated samples go and the ``gpu`` stages run (default: ``inner``'s
            device). The stages before read the bytes in host memory, so ``inner`` should deliver
            there (:meth:`kspeed.KSpeedClient.dataset` and ``wrap`` open it so).
        source: the dataset of the caller's this one serves (``wrap``'s), returned by :attr:`dataset`.

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
        transform_workers: TransformWorkers | None = None,
        device: str | torch.device | None = None,
        source: Any = None,
    ) -> None:
        super().__init__()
        self._closed = True
        self._source = source
        workers = transform_workers.workers if transform_workers is not None else worker_count(num_workers)
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
        inner.hand_positions_over()  # (the batches handed to the caller are counted here)
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
        self._gpu = GpuStages(pipeline, inner.seed, parse_device(device) if device is not None else inner.device)
        self._seconds: dict[str, float] = {}
        self.num_workers = workers
        self.prefetch = prefetch if prefetch is not None else max(PREFETCH_PER_WORKER * workers, 1)
        if transform_workers is not None:
            transform_workers.install(self._stages)
        self._workers: TransformWorkers | InlineWorkers | None = transform_workers
        self._delivered = 0
        #: where the rank's wait goes; its loop meter is the tuner's too
        self._attribution = inner._parts.attribution
        #: the self-tuned split (offload="auto"), fed by the batches and the calls of next()
        self._auto = inner.offload_tuner()
        inner.report_also(self._offload)
        self._closed = False

    @property
    def name(self) -> str:
        """The KSpeed dataset's name."""
        return self._inner.name

    @property
    def dataset(self) -> Any:
        """The dataset of yours this one serves (what :meth:`kspeed.KSpeedClient.wrap` was given), as
        ``DataLoader.dataset`` is: ``len(ds.dataset)`` counts its samples.

        Raises:
            StateError: it was opened from a spec (:meth:`kspeed.KSpeedClient.dataset`): there is no
                dataset object of yours; the message says what to read instead.
        """
        if self._source is None:
            raise StateError(
                f"dataset {self._inner.name!r} was opened from a spec, not from a dataset object of yours: "
                f"there is no .dataset; its samples: .num_samples ({self._inner.num_samples}); this rank's per "
                "epoch: len(.sampler); KSpeed's dataset delivering the bytes: .kspeed_dataset"
            )
        return self._source

    @property
    def kspeed_dataset(self) -> KSpeedDataset:
        """The KSpeed dataset delivering the raw bytes."""
        return self._inner

    @property
    def num_samples(self) -> int:
        """Samples in the dataset (this rank's per epoch: ``len(ds.sampler)``)."""
        return self._inner.num_samples

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._inner.epoch

    @property
    def sampler(self) -> SamplerView:
        """What a trainer takes for this loader's sampler: ``set_epoch`` is :meth:`set_epoch` (see
        :attr:`KSpeedDataset.sampler <kspeed.client.dataset.KSpeedDataset.sampler>`)."""
        return SamplerView(self, lambda: self._inner.samples_per_epoch, self._inner.sampler.sampler)

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
        self._inner.keep_position(self._delivered)
        return self._deliver(batches)

    def _deliver(self, batches: Iterator[Any]) -> Iterator[Any]:
        pending: deque[_Task] = deque()
        attribution = self._attribution
        attribution.forget_step()  # the time since the last epoch's batch was no training step
        attribution.enter()  # the first next(): the wait until a batch is handed over (see _hand)
        try:
            for batch in batches:
                pending.append(self._submit(batch))
                if len(pending) >= self.prefetch:
                    yield from self._hand(pending.popleft())
            while pending:
                yield from self._hand(pending.popleft())
        except GeneratorExit:  # the loop stopped early: drop the batches in flight, keep the workers
            for task in pending:
                task.future.cancel()
            attribution.enter()  # (left when the batch was handed over: the wait was counted)
            raise
        except BaseException:
            for task in pending:
                task.future.cancel()
            self._stop_workers()
            raise
        finally:
            attribution.leave(0)
            attribution.forget_step()

    def _hand(self, task: _Task) -> Iterator[Any]:
        """Yield ``task``'s batch; the time from the loop asking for it to its hand-over is the
        rank's wait (the loop meter, shared with the tuner, sees both ends)."""
        value = self._collect(task)
        self._attribution.leave(len(task.ids))
        yield value
        self._attribution.enter()
        if self._auto is not None:
            self._auto.tick()

    def _ready_workers(self) -> TransformWorkers | InlineWorkers:
        """The workers, started by the first batch that needs them unless they were given started,
        once each has run its initializer.

        Raises:
            DatasetError: a worker could not start (why).
            StateError: they would start from an unguarded top-level line of the main script.
        """
        if self._workers is None:
            self._workers = (
                TransformWorkers(self.num_workers, self._stages) if self.num_workers else InlineWorkers(self._stages)
            )
        if isinstance(self._workers, TransformWorkers):
            try:
                self._workers.wait_ready()
            except StartFailure as exc:
                raise DatasetError(f"dataset {self.name!r}: {exc.text}", dataset=self.name) from exc
        return self._workers

    def _submit(self, batch: Any) -> _Task:
        """Copy the batch's bytes into one buffer, give its ring range back and queue it.

        A batch the servers preprocessed whole, with no client stage left but the default
        collation, is collated here straight from the ring (one copy, no worker round trip).
        """
        if self._collates_here(batch):
            return self._collate_here(batch)
        if self._splits(batch):
            return self._split(batch)
        ids = batch.ids.tolist()
        epoch, index = batch.epoch, batch.index
        draw = Draw(epoch, tuple(ids), tuple(bool(r) for r in batch.remote.tolist()))
        targets = self._targets_of(batch, ids)
        packed = self._pack(batch, range(len(ids)))
        batch.release()
        future = self._queue(packed, targets, draw)
        return _Task(future, epoch, index, ids, sum(draw.remote), isinstance(self._workers, InlineWorkers))

    @staticmethod
    def _pack(batch: Any, positions: Sequence[int]) -> tuple[bytearray, list[int]]:
        """The bytes of the samples at ``positions`` of ``batch``, copied out of the ring into one
        buffer, and each one's offset in it (one more than samples)."""
        lengths = np.asarray([batch.lengths[i] for i in positions], dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        buffer = bytearray(int(offsets[-1]))
        dst = np.frombuffer(buffer, dtype=np.uint8)
        for k, i in enumerate(positions):
            dst[offsets[k] : offsets[k + 1]] = batch.samples[i].numpy()
        del dst
        return buffer, offsets.tolist()

    def _queue(self, packed: tuple[bytearray, list[int]], targets: list[Any], draw: Draw) -> Future:
        """Queue packed samples to the workers (started now if they were not)."""
        paths = self._paths
        names = [os.path.basename(paths[i]) for i in draw.ids] if paths and self._stages.loader_takes == "path" else []
        return self._ready_workers().submit(packed[0], packed[1], targets, names, draw)

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

    def _splits(self, batch: Any) -> bool:
        """Whether ``batch`` mixes samples that arrived ready (only decoding and collating left) with
        samples to run here: it is then prepared in two parts (:meth:`_split`)."""
        stages = self._stages
        return (
            stages.pipeline is not None
            and stages.transform is None
            and stages.collate_fn is default_collate
            and stages.client_stop == stages.server_stages
            and bool(batch.remote.any())
            and not bool(batch.remote.all())
        )

    def _split(self, batch: Any) -> _Task:
        """Collate the samples the servers preprocessed here, straight from the ring, and send the
        workers only the others' bytes (raw files, a fraction of the decoded size); :meth:`_collect`
        interleaves the two parts."""
        ids = batch.ids.tolist()
        epoch, index = batch.epoch, batch.index
        flags = [bool(r) for r in batch.remote.tolist()]
        targets = self._targets_of(batch, ids)
        ready = [i for i, remote in enumerate(flags) if remote]
        rest = [i for i, remote in enumerate(flags) if not remote]
        draw = Draw(epoch, tuple(ids[i] for i in ready), (True,) * len(ready))
        try:
            here = _Part(ready, self._collate_part(batch, ready, [targets[i] for i in ready], draw))
        except SampleFailure as exc:
            here = _Part(ready, exc)
        packed = self._pack(batch, rest)
        batch.release()  # default_collate copied the servers' samples out of the ring
        future = self._queue(
            packed, [targets[i] for i in rest], Draw(epoch, tuple(ids[i] for i in rest), (False,) * len(rest))
        )
        return _Task(future, epoch, index, ids, len(ready), isinstance(self._workers, InlineWorkers), rest, here)

    def _collate_part(self, batch: Any, positions: list[int], targets: list[Any], draw: Draw) -> Delivered:
        views = [memoryview(batch.samples[i].numpy()) for i in positions]
        return run_samples(self._stages, None, views, targets, [], draw)

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
        return _Task(future, batch.epoch, batch.index, ids, sum(draw.remote), inline=True)

    def _collect(self, task: _Task) -> Any:
        where = f"batch {task.index} of epoch {task.epoch} of dataset {self.name!r}"
        waited = time.monotonic()
        try:
            result = self._result(task)
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
        except StartFailure as exc:
            raise DatasetError(f"{where}: {exc.text}", dataset=self.name) from exc
        except BrokenProcessPool as exc:
            raise DatasetError(
                f"a transform worker process died during {where} (killed, crashed or out of memory)", dataset=self.name
            ) from exc
        except Exception as exc:
            raise DatasetError(
                f"{where} failed in a transform worker: {type(exc).__name__}: {exc}", dataset=self.name
            ) from exc
        finally:
            self._attribution.client_prep(time.monotonic() - waited)
        if len(result.skipped) == len(task.ids):
            raise DatasetError(
                f"every sample of {where} failed and was left out (on_error='skip'): {result.skipped[0][1]}",
                dataset=self.name,
            )
        self._delivered += 1
        self._inner.keep_position(self._delivered)
        for position, why in result.skipped:
            sample = task.ids[position]
            named = f"sample {sample} ({self._paths[sample]})" if self._paths else f"sample {sample}"
            log.warning("dataset %s: %s left out of %s (on_error='skip'): %s", self.name, named, where, why)
        self._skipped += len(result.skipped)
        for name, seconds in result.seconds.items():
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        if self._auto is not None:
            local = len(task.ids) - task.remote
            mine = task.here.outcome if task.here is not None else None
            if isinstance(mine, Delivered) and task.there is not None:  # each part where it ran
                self._auto.batch_done(mine.seconds, mine.cpu_s, mine.wall_s, 0, task.remote, True)
                there = task.there
                self._auto.batch_done(there.seconds, there.cpu_s, there.wall_s, local, 0, task.inline)
            else:
                self._auto.batch_done(result.seconds, result.cpu_s, result.wall_s, local, task.remote, task.inline)
        return self._gpu.apply(result.value, task.epoch, task.ids)

    @staticmethod
    def _result(task: _Task) -> Delivered:
        """The task's batch, its two parts interleaved for a split batch (positions in failures and
        in ``skipped`` are the batch's).

        Raises:
            SampleFailure: a sample (by its position in the batch) or the collation failed.
        """
        try:
            there = task.future.result()
        except SampleFailure as exc:
            if task.positions is None or exc.position is None:
                raise
            raise SampleFailure(task.positions[exc.position], exc.text) from None
        here = task.here
        if here is None or task.positions is None:
            return there
        task.there = there
        mine = here.outcome
        if isinstance(mine, SampleFailure):
            if mine.position is None:
                raise mine
            raise SampleFailure(here.positions[mine.position], mine.text) from None
        skipped = sorted(
            [(here.positions[k], why) for k, why in mine.skipped]
            + [(task.positions[k], why) for k, why in there.skipped]
        )
        gone = {position for position, _ in skipped}
        kept_here = [p for p in here.positions if p not in gone]
        kept_there = [p for p in task.positions if p not in gone]
        rank = {position: r for r, position in enumerate(sorted(kept_here + kept_there))}
        begun = time.perf_counter()
        if not kept_there:
            value = mine.value
        elif not kept_here:
            value = there.value
        else:
            try:
                value = interleave(mine.value, there.value, [rank[p] for p in kept_here], [rank[p] for p in kept_there])
            except TypeError as exc:
                raise SampleFailure(None, f"joining the batch's two parts: {exc}") from None
        seconds = dict(there.seconds)
        for name, value_s in mine.seconds.items():
            seconds[name] = seconds.get(name, 0.0) + value_s
        seconds["collate"] = seconds.get("collate", 0.0) + time.perf_counter() - begun
        return Delivered(value, seconds, tuple(skipped), there.cpu_s, there.wall_s)

    def worker_pids(self) -> list[int]:
        """Process IDs of the running transform workers (none before they start or after close)."""
        return self._workers.pids() if self._workers is not None else []

    # -- epochs, resume, operations --------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration delivers (see :meth:`KSpeedDataset.set_epoch`)."""
        self._inner.set_epoch(epoch)
        self._delivered = self._inner.state_dict()["batches"]

    def state_dict(self) -> dict[str, Any]:
        """The position in batches handed to the caller (batches still in the workers do not count)."""
        return self._inner.state_at(self._delivered)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken (see :meth:`KSpeedDataset.load_state_dict`)."""
        self._inner.load_state_dict(state)
        self._delivered = self._inner.state_dict()["batches"]

    def resume_live(self, job: str) -> bool:
        """Keep the position on the servers and continue from the job's (see :meth:`KSpeedDataset.resume_live`)."""
        found = self._inner.resume_live(job)
        self._delivered = self._inner.state_dict()["batches"]
        return found

    def preload(self, *, quiet: bool | None = None, timeout: float | None = None) -> PreloadSummary:
        """Start (or join) the servers' preload of the files and wait for it (see :meth:`KSpeedDataset.preload`)."""
        return self._inner.preload(quiet=quiet, timeout=timeout)

    def group_figures(self) -> dict[str, Any] | None:
        """What this job's group shared on the servers (:meth:`KSpeedDataset.group_figures`)."""
        return self._inner.group_figures()

    def stats(self) -> dict[str, Any]:
        """The KSpeed dataset's delivery figures, the transform workers in use, the seconds each
        client-side stage took (summed over workers; ``receive``: decoding the servers' output) and
        each server stage (:meth:`KSpeedDataset.server_stage_seconds`, from the manager)."""
        seconds = dict(self._seconds)
        seconds.update(self._gpu.seconds)
        return {
            **self._inner.stats(),
            "workers": len(self.worker_pids()),
            "client_stage_seconds": seconds,
            "server_stage_seconds": self._inner.server_stage_seconds() if self._inner.pipeline is not None else {},
            "skipped": self._skipped,
        }

    def _offload(self) -> dict[str, Any]:
        """The split of preprocessing in force (reported with the rank's figures)."""
        prep = self._inner.prep
        if self._auto is not None:
            return {"offload": self._auto.stats()}
        return {"offload": {"mode": "fixed", "ratio": prep.fraction if prep is not None else 0.0, "reason": ""}}

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"dataset {self.name!r} is closed; open it again with client.dataset() or client.wrap()")

    def _stop_workers(self) -> None:
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def close(self) -> None:
        """Join the worker processes and close the KSpeed dataset."""
        if self._closed:
            return
        self._closed = True
        self._stop_workers()
        if self._auto is not None:
            self._auto.close()
        try:
            self._inner.close()
        except KSpeedError as exc:
            log.warning("dataset %s: error while closing its client workers: %s", self.name, exc)

    def __enter__(self) -> PreparedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
