"""This rank's ordered sample IDs per epoch, from any torch sampler.

Two kinds of samplers are told apart because only one may have its next epoch computed exactly
before it starts:

* **deterministic in (seed, epoch)**: ``DistributedSampler`` (also what KSpeed builds when no
  sampler is given) and ``SequentialSampler``. The order of any epoch is computed from a *copy* of
  the sampler set to that epoch, so planning epoch ``e + 1`` while ``e`` is consumed never touches
  the user's object.
  :class:`ShardOrder` (tar shards in WebDataset's order, ``shuffle_buffer``) is one too.
* **everything else** (``RandomSampler``, weighted samplers, user classes): the order is drawn
  by iterating the user's sampler once when the epoch starts, exactly as a ``DataLoader`` would,
  so its random state is consumed at the same moments and never early. Its next order can only be
  predicted (:mod:`kspeed.client.planning.prediction`); an order drawn or predicted already is
  planned through :meth:`EpochOrders.given`.

torch's own samplers are drawn with array operations (:func:`sampler_order`): the same IDs and the
same draws from their generators (or torch's global one) as iterating them, without a Python int
per sample.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from kspeed.client.planning.compact import id_dtype
from kspeed.client.planning.resize import part_of
from kspeed.config import launcher_environment
from kspeed.errors import ConfigError, DatasetError

__all__ = ["EpochOrders", "ShardOrder", "distributed_order", "job_rank", "sampler_order"]


class ShardOrder:
    """WebDataset's order over tar shards, for one rank, deterministic in (seed, epoch).

    Each epoch the shards are shuffled, their samples laid end to end, and the ranks take
    consecutive stretches of ``ceil(N / world)`` samples (the last padded from the start, as
    ``DistributedSampler`` pads): every sample once per epoch, each rank within a few shards at a
    time. Each rank then shuffles its stretch through a buffer of ``buffer`` samples (a sample
    waits in the buffer until a random draw takes it, as WebDataset's ``shuffle(buffer)`` does), so
    consecutive samples come from neighbouring positions of its shards, never from all of them.

    Args:
        starts: each shard's first sample ID, then the sample count (samples follow the shards).
        buffer: the shuffle buffer, in samples (1: the shards' own order).
        seed: the shuffle's seed.
        rank: this rank.
        world: ranks sharing each epoch.
    """

    def __init__(self, starts: np.ndarray, buffer: int, seed: int, rank: int, world: int) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)
        self.buffer, self.seed, self.rank, self.world = max(int(buffer), 1), int(seed), int(rank), int(world)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return -(-int(self.starts[-1]) // self.world)

    def order(self) -> np.ndarray:
        """This rank's sample IDs of the epoch, in order."""
        dtype = id_dtype(int(self.starts[-1]))
        rng = np.random.default_rng([self.seed, self.epoch])
        shards = rng.permutation(len(self.starts) - 1)
        lo, hi = self.starts[shards], self.starts[shards + 1]
        lengths = hi - lo
        # every sample of the shuffled shards, end to end, without a Python loop per shard
        first = (lo - np.concatenate(([0], np.cumsum(lengths)[:-1]))).astype(dtype)
        seq = np.repeat(first, lengths) + np.arange(int(lengths.sum()), dtype=dtype)
        per_rank = len(self)
        total = per_rank * self.world
        if total > len(seq) and len(seq):
            seq = np.concatenate([seq, np.resize(seq, total - len(seq))])
        mine = seq[self.rank * per_rank : (self.rank + 1) * per_rank]
        if self.buffer <= 1:
            return mine.copy()
        draws = np.random.default_rng([self.seed, self.epoch, self.rank]).integers(0, self.buffer, len(mine))
        out = np.empty(len(mine), dtype=dtype)
        done = 0
        buf: list[int] = []
        # a sample waits in the buffer until a draw takes it: one Python step per sample, over
        # slices of the arrays, so no Python int per sample of the epoch is held at once
        for start in range(0, len(mine), _BUFFER_STEP):
            taken: list[int] = []
            part = slice(start, start + _BUFFER_STEP)
            for sample, j in zip(mine[part].tolist(), draws[part].tolist(), strict=True):
                if len(buf) < self.buffer:
                    buf.append(sample)
                    continue
                taken.append(buf[j])
                buf[j] = sample
            out[done : done + len(taken)] = taken
            done += len(taken)
        rest = np.asarray(buf, dtype=np.int64)
        np.random.default_rng([self.seed, self.epoch, self.rank, 1]).shuffle(rest)
        out[done:] = rest
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())


_DETERMINISTIC = (DistributedSampler, SequentialSampler, ShardOrder)
_BUFFER_STEP = 1 << 16  # samples of a shuffle buffer's pass turned into Python ints at a time


def distributed_order(sampler: DistributedSampler) -> np.ndarray:
    """What ``iter(sampler)`` yields, as one array: ``DistributedSampler.__iter__`` done with
    array operations. Iterating the sampler turns a permutation of the *whole* dataset into Python
    ints on every rank every epoch (~50 bytes and ~0.1 us per sample: 5 GB per rank at 10^8
    samples); this keeps 4 bytes per sample (``int32`` IDs below ``2**31`` samples; torch draws
    the same permutation in either dtype) and the same order."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    dtype = id_dtype(n)
    if sampler.shuffle:
        generator = torch.Generator()
        generator.manual_seed(sampler.seed + sampler.epoch)
        torch_dtype = torch.int32 if dtype == np.int32 else torch.int64
        indices = torch.randperm(n, generator=generator, dtype=torch_dtype).numpy()
    else:
        indices = np.arange(n, dtype=dtype)
    total = sampler.total_size
    if sampler.drop_last:
        indices = indices[:total]
    elif total > n and n:
        indices = np.concatenate([indices, np.resize(indices, total - n)])  # repeated from the start
    return np.ascontiguousarray(indices[sampler.rank : total : sampler.num_replicas])


def _random_order(sampler: RandomSampler) -> np.ndarray:
    """``RandomSampler.__iter__`` with array operations: the same draws, in the same calls (a seed
    from torch's global generator when it has none of its own; one permutation per pass over the
    data, the last one cut, drawn even when nothing of it is kept)."""
    n = len(sampler.data_source)
    generator = sampler.generator
    if generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    count = sampler.num_samples
    if sampler.replacement:
        parts = [torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator) for _ in range(count // 32)]
        parts.append(torch.randint(high=n, size=(count % 32,), dtype=torch.int64, generator=generator))
    else:
        parts = [torch.randperm(n, generator=generator) for _ in range(count // n)]
        parts.append(torch.randperm(n, generator=generator)[: count % n])
    return torch.cat(parts).numpy()


def _subset_indices(sampler: SubsetRandomSampler) -> np.ndarray | None:
    """A ``SubsetRandomSampler``'s indices as an integer array (``None``: they are not integers)."""
    indices = sampler.indices
    array = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
    return array if array.ndim == 1 and array.dtype.kind in "iu" else None


#: torch's samplers whose ``__iter__`` :func:`sampler_order` draws with array operations
ARRAY_DRAWN = (DistributedSampler, SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _own_iter(sampler: object, cls: type) -> bool:
    """Whether ``sampler`` is a ``cls`` whose ``__iter__`` is ``cls``'s own."""
    return isinstance(sampler, cls) and type(sampler).__iter__ is cls.__iter__  # type: ignore[attr-defined]


def sampler_order(sampler: Iterable[int]) -> np.ndarray:
    """What ``iter(sampler)`` yields, as one integer array, drawing from its generators (or torch's
    global one) exactly as iterating it would: with array operations for torch's own samplers
    (:data:`ARRAY_DRAWN`, unless a subclass iterates otherwise) and :class:`ShardOrder`, else by
    iterating it.

    Raises:
        TypeError, ValueError: it yields something that is not one integer.
    """
    if _own_iter(sampler, DistributedSampler):
        return distributed_order(sampler)  # type: ignore[arg-type]
    if _own_iter(sampler, SequentialSampler):
        n = len(sampler.data_source)  # type: ignore[attr-defined]
        return np.arange(n, dtype=id_dtype(n))
    if isinstance(sampler, ShardOrder):
        return sampler.order()
    if _own_iter(sampler, RandomSampler):
        return _random_order(sampler)  # type: ignore[arg-type]
    if _own_iter(sampler, WeightedRandomSampler):
        drawn = torch.multinomial(
            sampler.weights,  # type: ignore[attr-defined]
            sampler.num_samples,  # type: ignore[attr-defined]
            sampler.replacement,  # type: ignore[attr-defined]
            generator=sampler.generator,  # type: ignore[attr-defined]
        )
        return drawn.numpy()
    if _own_iter(sampler, SubsetRandomSampler):
        indices = _subset_indices(sampler)  # type: ignore[arg-type]
        if indices is not None:
            return indices[torch.randperm(len(indices), generator=sampler.generator).numpy()]  # type: ignore[attr-defined]
    return np.fromiter((int(i) for i in sampler), dtype=np.int64)


class _IdRange(Dataset[int]):
    """Sample IDs ``0..n-1`` as a map-style dataset: what the built-in ``DistributedSampler`` splits."""

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> int:
        return index


#: where :func:`job_rank` says a rank came from when nothing said there were several
SINGLE = "no process group or launcher (a single process)"


def job_rank(
    rank: int | None, world_size: int | None, environ: Mapping[str, int] | None = None
) -> tuple[int, int, str]:
    """This process's rank and the job's world size, and where they came from.

    Given values win; what is missing comes from the initialised ``torch.distributed`` process
    group, else from the launcher's variables (:func:`launcher_rank`), else rank 0 of 1: the
    same sources ``DistributedSampler`` uses, so every rank reads its own part of each epoch.

    Args:
        rank: the rank the caller gave, if any.
        world_size: the world size the caller gave, if any.
        environ: the launcher's variables (default :func:`kspeed.config.launcher_environment`).

    Raises:
        ConfigError: the launcher's variables say this process is one of several but not which
            (PyTorch Lightning's ranks before its process group exists): never read as rank 0 of
            1, which would give every rank the whole epoch.
    """
    if rank is not None and world_size is not None:
        return rank, world_size, "given"
    if dist.is_available() and dist.is_initialized():
        found, source = (dist.get_rank(), dist.get_world_size()), "the torch.distributed process group"
    else:
        env = launcher_environment() if environ is None else environ
        launched = launcher_rank(env)
        if launched is not None:
            found, source = launched
        elif rank is None and _several(env):
            named = ", ".join(f"{k}={v}" for k, v in sorted(env.items()))
            raise ConfigError(
                f"the launcher's variables ({named}) say this process is one of several, but neither they nor "
                "an initialised torch.distributed process group say which rank it is; iterate the dataset after "
                "torch.distributed.init_process_group() (PyTorch Lightning initialises it before its first epoch, "
                "whether the dataset is opened in __init__ or in train_dataloader()), or pass rank= and world_size=",
                field="rank",
            )
        else:
            found, source = (0, 1), SINGLE
    return (found[0] if rank is None else rank), (found[1] if world_size is None else world_size), source


def launcher_rank(env: Mapping[str, int]) -> tuple[tuple[int, int], str] | None:
    """``((rank, world size), source)`` from a launcher's variables (:func:`kspeed.config.launcher_environment`),
    or None when they do not say: ``RANK`` and ``WORLD_SIZE`` (torchrun and the launchers built
    on it); else ``WORLD_SIZE`` with ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    and the node's rank (``GROUP_RANK``, or ``NODE_RANK``), every node running ``LOCAL_WORLD_SIZE``
    ranks; else ``LOCAL_RANK`` where ``LOCAL_WORLD_SIZE`` is the whole ``WORLD_SIZE`` (one node).

    Slurm's ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS`` count, where none of the others is set:
    each task of an ``srun`` step is then a rank. Not ``SLURM_NTASKS``: a batch script has it
    without ``srun``, one process; and not with the others set: processes that a launcher started
    inside one task (Lightning's, say) share its ``SLURM_PROCID``."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return (env["RANK"], env["WORLD_SIZE"]), "the launcher's RANK and WORLD_SIZE"
    if not env.keys() & _TORCH_LOCAL and {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS"} <= env.keys():
        return (env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]), "Slurm's SLURM_PROCID and SLURM_STEP_NUM_TASKS"
    if not {"WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= env.keys():
        return None
    world, local, per_node = env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]
    node_name = next((k for k in ("GROUP_RANK", "NODE_RANK") if k in env), None)
    if node_name is not None:
        me = env[node_name] * per_node + local
        return (me, world), f"the launcher's {node_name}, LOCAL_RANK and LOCAL_WORLD_SIZE"
    if per_node == world:
        return (local, world), "the launcher's LOCAL_RANK on its one node"
    return None


#: A torch launcher's variables other than ``RANK``: present, they say more than Slurm's.
_TORCH_LOCAL = frozenset({"WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"})


def _several(env: Mapping[str, int]) -> bool:
    """Whether a launcher's variables say this process is one of several ranks."""
    return any(env.get(k, 0) > 1 for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")) or any(
        env.get(k, 0) > 0 for k in ("LOCAL_RANK", "GROUP_RANK", "NODE_RANK")
    )


def declares_global_order(sampler: object) -> bool:
    """Whether a sampler of the caller's declares its global order: it has integer ``rank`` and
    ``num_replicas`` and a ``global_order(epoch)`` method giving every sample of an epoch in order,
    and yields (for its ``set_epoch``) rank ``rank``'s part of it as ``DistributedSampler`` splits.
    KSpeed then plans from the declared order and can resume it at another world size
    (docs/resume.md); whether it yields that part is checked when the dataset opens."""
    return (
        callable(getattr(sampler, "global_order", None))
        and isinstance(getattr(sampler, "rank", None), int)
        and isinstance(getattr(sampler, "num_replicas", None), int)
        and not isinstance(sampler, DistributedSampler)
    )


def _describe(sampler: object) -> str:
    cls = type(sampler)
    text = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(sampler, DistributedSampler):
        text += (
            f"(replicas={sampler.num_replicas},rank={sampler.rank},shuffle={sampler.shuffle},"
            f"seed={sampler.seed},drop_last={sampler.drop_last},total={sampler.total_size})"
        )
    return text


class EpochOrders:
    """The sampler of one dataset and the ID orders it yields.

    Args:
        sampler: a torch sampler, or ``None`` for every sample (shuffled per epoch when ``shuffle``).
        num_samples: samples in the dataset (IDs ``0..num_samples-1``).
        batch_size: samples per batch.
        drop_last: drop the last incomplete batch of each epoch (as ``DataLoader``).
        seed: seed of the built-in shuffle (ignored for a user sampler).
        shuffle: whether the built-in sampler shuffles.
        rank: this rank when the built-in sampler splits the data (``DistributedSampler``).
        world_size: number of ranks sharing each epoch.
        dataset: the dataset's name, for messages.
        shard_starts: a tar dataset's shards (each one's first sample ID, then the count).
        shuffle_buffer: with tar shards, 0 for the exact order of the built-in sampler; N > 0 for
            :class:`ShardOrder` with a buffer of N samples.

    Raises:
        ConfigError: ``rank``/``world_size`` given together with a sampler, or out of range; a
            ``shuffle_buffer`` with a sampler of the caller's or without tar shards.
    """

    def __init__(
        self,
        sampler: Iterable[int] | None,
        *,
        num_samples: int,
        batch_size: int,
        drop_last: bool,
        seed: int,
        shuffle: bool,
        rank: int | None,
        world_size: int | None,
        dataset: str,
        shard_starts: np.ndarray | None = None,
        shuffle_buffer: int = 0,
    ) -> None:
        self.dataset = dataset
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seed = seed
        #: the built-in sampler's split of each epoch (None with a sampler of the caller's)
        self.rank: int | None = None
        self.world_size: int | None = None
        if isinstance(sampler, BatchSampler):
            raise ConfigError(
                "a BatchSampler yields lists of sample IDs; pass its sampler and batch size instead: "
                "client.dataset(spec, batch_size=batch_sampler.batch_size, sampler=batch_sampler.sampler, "
                "drop_last=batch_sampler.drop_last)",
                field="sampler",
                value=type(sampler).__name__,
            )
        if sampler is not None and shuffle_buffer:
            raise ConfigError(
                "shuffle_buffer builds the shard-aware order; give it or a sampler, not both",
                field="shuffle_buffer",
                value=shuffle_buffer,
            )
        if sampler is not None and (rank is not None or world_size is not None):
            raise ConfigError(
                "give either a sampler or rank/world_size (which build a DistributedSampler), not both",
                field="sampler",
                value=type(sampler).__name__,
            )
        self._shards, self._shuffle_buffer, self._shuffle = shard_starts, shuffle_buffer, shuffle
        if sampler is None:
            world = 1 if world_size is None else world_size
            me = 0 if rank is None else rank
            if isinstance(world, bool) or not isinstance(world, int) or world < 1:
                raise ConfigError(
                    f"world_size must be a positive integer, got {world_size!r}", field="world_size", value=world_size
                )
            if isinstance(me, bool) or not isinstance(me, int) or not 0 <= me < world:
                raise ConfigError(f"rank must be in 0..{world - 1}, got {rank!r}", field="rank", value=rank)
            if shuffle_buffer and shard_starts is None:
                raise ConfigError(
                    f"dataset {dataset!r}: shuffle_buffer orders tar shards; this dataset has none",
                    field="shuffle_buffer",
                    value=shuffle_buffer,
                )
            sampler = self._builtin(me, world)
            self.rank, self.world_size = me, world
        self.sampler = sampler
        #: where the built-in split's rank came from, while it is a guess to check when the epoch
        #: starts (:meth:`KSpeedDataset._settle_rank <kspeed.client.dataset.KSpeedDataset>`); None once known
        self.provisional: str | None = None
        #: a sampler of the caller's that declares its global order (:func:`declares_global_order`)
        self.declared = sampler is not None and declares_global_order(sampler)
        self.deterministic = type(sampler) in _DETERMINISTIC or self.declared
        self.identity = _describe(sampler)
        self._given = threading.local()  # per thread: the order given to :meth:`order` (see :meth:`given`)
        self._epoch = 0
        #: this rank's part of an epoch resumed at another world size (:meth:`resume`)
        self._resumed: tuple[int, np.ndarray] | None = None
        #: the state of the sampler's own generator when the order of an epoch was drawn from it,
        #: and samples to leave out of the next draw of an epoch (:meth:`skip_drawn`)
        self.drawn_from: tuple[int, bytes] | None = None
        self._skip: tuple[int, int] | None = None
        self.skipped: tuple[int, int] = (0, 0)

    def _builtin(self, rank: int, world: int) -> Iterable[int]:
        """The built-in sampler of ``rank`` of ``world``."""
        if self._shuffle_buffer:
            assert self._shards is not None
            return ShardOrder(self._shards, self._shuffle_buffer, self.seed, rank, world)
        return DistributedSampler(
            _IdRange(self.num_samples), num_replicas=world, rank=rank, shuffle=self._shuffle, seed=self.seed
        )

    def resplit(self, rank: int, world: int) -> None:
        """Split the built-in sampler's epochs for ``rank`` of ``world`` from now on (a rank known
        only once the process group exists); the epoch set is kept.

        Raises:
            ConfigError: the sampler is the caller's, or ``rank`` is outside ``0..world - 1``.
        """
        if self.rank is None:
            raise ConfigError(f"dataset {self.dataset!r}: a sampler of yours splits the epochs itself", field="rank")
        if not 0 <= rank < world:
            raise ConfigError(f"rank must be in 0..{world - 1}, got {rank!r}", field="rank", value=rank)
        self.sampler = self._builtin(rank, world)
        self.set_epoch(self._epoch)
        self.rank, self.world_size = rank, world
        self.identity = _describe(self.sampler)
        self._resumed = None

    # -- resuming at another world size (:mod:`kspeed.client.planning.resize`) ---------------------

    def split(self) -> tuple[int, int] | None:
        """``(rank, world size)`` of an order split as ``DistributedSampler`` splits one global
        order (the built-in sampler's, or a ``DistributedSampler`` of the caller's without
        ``drop_last``): such an epoch can be resumed at another world size. None otherwise."""
        s = self.sampler
        if (_own_iter(s, DistributedSampler) and not s.drop_last) or self.declared:  # type: ignore[attr-defined]
            return int(s.rank), int(s.num_replicas)  # type: ignore[attr-defined]
        return None

    @property
    def order_identity(self) -> str | None:
        """What decides the global order of every epoch, whatever the world size (None: the
        order is not split from one; see :meth:`split`)."""
        if self.split() is None:
            return None
        s = self.sampler
        if self.declared:
            cls = type(s)
            return f"{cls.__module__}.{cls.__qualname__}(samples={self.num_samples},seed={getattr(s, 'seed', None)})"
        n = len(s.dataset)  # type: ignore[attr-defined]
        return f"DistributedSampler(samples={n},shuffle={s.shuffle},seed={s.seed})"  # type: ignore[attr-defined]

    def global_order(self, epoch: int) -> np.ndarray:
        """Every sample of ``epoch`` in the order the ranks' parts are split from (see :meth:`split`).

        Raises:
            ConfigError: the sampler's order is not split from one global order (named).
        """
        if self.split() is None:
            raise ConfigError(
                f"dataset {self.dataset!r}: sampler {self.identity} does not split one global order over the "
                "ranks as DistributedSampler does (without drop_last), so what is left of an epoch cannot be "
                "split again over another number of ranks; resume with the world size and batch size it was "
                "saved with, or from an epoch's start",
                field="sampler",
                value=self.identity,
            )
        s = self.sampler
        if self.declared:
            return self._declared_order(epoch)
        whole: DistributedSampler = DistributedSampler(
            s.dataset,  # type: ignore[attr-defined]
            num_replicas=1,
            rank=0,
            shuffle=s.shuffle,  # type: ignore[attr-defined]
            seed=s.seed,  # type: ignore[attr-defined]
        )
        whole.set_epoch(epoch)
        return distributed_order(whole)

    def resume(self, epoch: int, ids: np.ndarray | None) -> None:
        """From now on ``epoch``'s order for this rank is ``ids`` (its part of what was left of the
        epoch when the job was resized); None: the sampler's again."""
        self._resumed = None if ids is None else (epoch, ids.astype(id_dtype(self.num_samples), copy=False))

    @property
    def resumed_epoch(self) -> int | None:
        """The epoch :meth:`resume` gave an order of, if any."""
        return None if self._resumed is None else self._resumed[0]

    def samples_per_epoch(self) -> int:
        """IDs the sampler yields per epoch (of the current one, when it was resumed at another world size).

        Raises:
            ConfigError: the sampler has no length.
        """
        if self._resumed is not None and self._resumed[0] == self._epoch:
            return len(self._resumed[1])
        if self._skip is not None and self._skip[0] == self._epoch:
            cut = self._skip[1]  # (the next draw's)
        else:
            cut = self.skipped[1] if self.skipped[0] == self._epoch else 0
        try:
            return max(len(self.sampler) - cut, 0)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(
                f"sampler {self.identity} has no len(); KSpeed needs the epoch's length",
                field="sampler",
                value=self.identity,
            ) from exc

    def largest_batch(self) -> int:
        """Samples in an epoch's largest batch: ``batch_size``, or the whole epoch when it is shorter
        (``batch_size`` for a sampler without ``len()``). A ring sized for more would be wasted.

        Raises:
            ConfigError: ``drop_last`` with an epoch shorter than one batch: every epoch would be empty.
        """
        try:
            n = len(self.sampler)  # type: ignore[arg-type]
        except TypeError:
            return self.batch_size
        if self.drop_last and n < self.batch_size:
            split = f" ({self.num_samples} samples over {self.world_size} ranks)" if (self.world_size or 1) > 1 else ""
            raise ConfigError(
                f"dataset {self.dataset!r}: drop_last=True with batch_size={self.batch_size} would drop every sample: "
                f"this rank gets {n} per epoch{split}; use a batch_size of at most {n}, or drop_last=False",
                field="batch_size",
                value=self.batch_size,
            )
        return max(1, min(self.batch_size, n))

    def num_batches(self) -> int:
        """Batches per epoch."""
        n = self.samples_per_epoch()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Keep the user's sampler in step (``set_epoch`` as a DataLoader user would call it)."""
        self._epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """The IDs of ``epoch`` in delivery order (the last partial batch cut with ``drop_last``).

        Deterministic samplers are copied and set to ``epoch``; others are iterated in place, unless
        this thread is within :meth:`given` for ``epoch``.

        Raises:
            ConfigError: the sampler yields something other than one sample ID at a time.
            DatasetError: the sampler yielded an ID outside the dataset (named).
        """
        given = getattr(self._given, "order", None)
        if given is not None and given[0] == epoch:
            return given[1]
        if self._resumed is not None and self._resumed[0] == epoch:
            return self._resumed[1]
        if self.declared:
            rank, world = self.split()  # type: ignore[misc]
            ids = part_of(self._declared_order(epoch), rank, world)
            return ids[: len(ids) - len(ids) % self.batch_size] if self.drop_last else ids
        if self.deterministic:
            sampler = copy.copy(self.sampler)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            return self.order_of(sampler)
        own = getattr(self.sampler, "generator", None)
        if isinstance(own, torch.Generator):
            self.drawn_from = (epoch, bytes(own.get_state().numpy()))
        ids = self.order_of(self.sampler)
        skip = self._skip[1] if self._skip is not None and self._skip[0] == epoch else 0
        if skip:
            self._skip = None
        self.skipped = (epoch, skip)  # (the samples of this draw left out: delivered before a resume)
        return ids[skip:]

    def skip_drawn(self, epoch: int, generator_state: bytes, samples: int) -> None:
        """Draw ``epoch`` next from the sampler's own generator put back to ``generator_state`` (its
        state when that epoch was drawn before), leaving out its first ``samples`` (delivered before
        a resume at another batch size).

        Raises:
            ConfigError: the sampler has no generator of its own to put back (named).
        """
        own = getattr(self.sampler, "generator", None)
        if not isinstance(own, torch.Generator):
            raise ConfigError(
                f"dataset {self.dataset!r}: sampler {self.identity} draws from torch's global generator: give it a "
                "torch.Generator of its own (seeded) to resume it at another batch size",
                field="sampler",
                value=self.identity,
            )
        own.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
        self._skip = (epoch, samples)

    def _declared_order(self, epoch: int) -> np.ndarray:
        """The global order of ``epoch`` a sampler of the caller's declares, checked against the
        dataset (named).

        Raises:
            ConfigError: it is not a sequence of sample IDs.
            DatasetError: it names a sample outside the dataset.
        """
        raw = self.sampler.global_order(epoch)  # type: ignore[attr-defined]
        ids = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
            raise ConfigError(
                f"sampler {self.identity}: global_order({epoch}) must give one sample ID per position, got "
                f"{type(raw).__name__} of shape {ids.shape} and dtype {ids.dtype}",
                field="sampler",
                value=self.identity,
            )
        return self._within(ids)

    def check_declared(self) -> None:
        """Establish that a sampler that declares its global order yields its rank's part of it,
        split as ``DistributedSampler`` splits: its order of the current epoch is drawn once, from
        a copy, and compared.

        Raises:
            ConfigError: it does not (named): its order could not be split again on a resume.
        """
        if not self.declared:
            return
        copied = copy.copy(self.sampler)
        rank, world = self.split()  # type: ignore[misc]
        epoch = 0
        if hasattr(copied, "set_epoch"):
            copied.set_epoch(epoch)
        yielded = sampler_order(copied)
        if self.drop_last:
            yielded = yielded[: len(yielded) - len(yielded) % self.batch_size]
        if not np.array_equal(yielded, self.order(epoch)):
            raise ConfigError(
                f"dataset {self.dataset!r}: sampler {self.identity} declares a global order (global_order, rank "
                f"{rank}, num_replicas {world}) but yields something else than rank {rank}'s part of it, split as "
                "DistributedSampler splits (every num_replicas-th sample from its rank, padded from the start)",
                field="sampler",
                value=self.identity,
            )

    def order_of(self, sampler: Iterable[int]) -> np.ndarray:
        """The IDs ``sampler`` (this one's sampler, or a copy of it) yields as an epoch's order: cut with
        ``drop_last``, checked against the dataset, as narrow as they fit.

        Raises:
            ConfigError: the sampler yields something other than one sample ID at a time.
            DatasetError: the sampler yielded an ID outside the dataset (named).
        """
        try:
            ids = sampler_order(sampler)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"sampler {self.identity} must yield one sample ID at a time ({exc}); for a sampler of batches, "
                "pass its underlying sampler and set batch_size",
                field="sampler",
                value=self.identity,
            ) from exc
        if self.drop_last:
            ids = ids[: len(ids) - len(ids) % self.batch_size]
        return self._within(ids)

    def _within(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` as narrow as they fit, checked against the dataset.

        Raises:
            DatasetError: an ID outside the dataset (named).
        """
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            sample = int(ids[np.flatnonzero((ids < 0) | (ids >= self.num_samples))[0]])
            raise DatasetError(
                f"dataset {self.dataset!r} has {self.num_samples} samples (IDs 0.."
                f"{self.num_samples - 1}); the sampler yielded sample {sample}",
                dataset=self.dataset,
                sample=sample,
            )
        return ids.astype(id_dtype(self.num_samples), copy=False)

    @contextlib.contextmanager
    def given(self, epoch: int, ids: np.ndarray) -> Iterator[None]:
        """Within the block, :meth:`order` of ``epoch`` in this thread is ``ids`` (an order of
        :meth:`order_of` drawn or predicted already, planned without drawing it again)."""
        self._given.order = (epoch, ids)
        try:
            yield
        finally:
            self._given.order = None
