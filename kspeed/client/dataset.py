"""KSpeedDataset: an ``IterableDataset`` of ready batches pushed by the servers into a receive ring.

Usage (normally through :meth:`kspeed.KSpeedClient.dataset`)::

    ds = client.dataset(spec, batch_size=64, rank=rank, world_size=world)
    ds.preload()
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in ds:              # or DataLoader(ds, batch_size=None)
            train(batch.samples, batch.labels)

With ``device="cuda"`` (or ``"cuda:N"``) every batch is copied to that GPU in one asynchronous copy
of its ring range (:mod:`kspeed.client.device`); ``batch.samples`` are then views of the device copy.

Resume: :meth:`KSpeedDataset.state_dict` is a few hundred bytes (epoch, batches consumed, seed and
the sampler's identity). For samplers deterministic in (seed, epoch) (the built-in one,
``DistributedSampler``, ``SequentialSampler``) :meth:`KSpeedDataset.load_state_dict` continues with
exactly the batches that were not yet delivered. For any other sampler the epoch's order is drawn
again from the sampler when the resumed epoch starts and its first ``batches`` batches are
skipped: the same *number* of batches remains, but they are the same samples only if the
sampler's own random state was restored too (e.g. a seeded ``torch.Generator`` saved by the user).
"""

from __future__ import annotations

import itertools
import logging
import os
import pwd
import re
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from kspeed.config import ClientConfig, gpu_environment
from kspeed.errors import ConfigError, KSpeedError, StateError
from kspeed.layout import SAMPLE_ALIGN
from kspeed.proto import kspeed_pb2
from kspeed.rdma.options import RailOptions
from kspeed.rdma.topology import pin, place

from .batch import Batch
from .device import make_delivery
from .feed import Feed
from .pacing import Pacer
from .plans import EpochPlan, make_plan
from .pump import Pump
from .rail_choice import choose_rail, is_local, local_address_towards
from .sampling import EpochOrders
from .stats import RankStats, StatsReporter, default_job

__all__ = ["KSpeedDataset"]

log = logging.getLogger(__name__)

MIN_RING = 256 << 20
RING_BATCHES = 4
STATE_VERSION = 1
NO_WORKERS = (
    "KSpeedDataset cannot run in DataLoader worker processes (num_workers > 0): its gRPC channels and "
    "data-plane resources (the receive ring and the servers' connections to it) do not survive fork or "
    "pickling, and every worker would receive the whole epoch again. Use DataLoader(ds, batch_size=None, "
    "num_workers=0): the servers already load and push the samples in parallel."
)


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _feed_id(dataset: str, rank: int) -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:20]
    return f"{host}-{os.getpid()}-r{rank}-{dataset[:16]}-{os.urandom(3).hex()}"


class KSpeedDataset(IterableDataset):
    """Batches of one dataset for this rank, in the sampler's order.

    Args:
        info: the dataset as the manager describes it (shares, addresses, sample count).
        links: one control-plane link per server of the dataset.
        config: the client configuration (rail, ring size, timeouts, credentials).
        batch_size: samples per batch.
        sampler: any torch sampler of sample IDs; ``None``: every sample, shuffled per epoch when
            ``shuffle`` (a ``DistributedSampler`` over ``rank``/``world_size``).
        seed: seed of the built-in shuffle.
        shuffle: whether the built-in sampler shuffles.
        drop_last: drop the last incomplete batch of each epoch.
        rank: this rank (built-in sampler only).
        world_size: ranks sharing each epoch (built-in sampler only).
        rail: ``"auto"``, ``"shm"`` or ``"tcp"`` (default: ``config.rail``).
        ring_bytes: receive ring size (default: ``config.ring_bytes`` or max(256 MiB, 4 batches)).
        quiet: no progress bar in :meth:`preload`.
        hostnames: per server id, the host it reported (to recognize co-located servers).
        manager: a ``ManagerClient`` for :meth:`preload`.
        lease: the lease keeper to stop on :meth:`close`.
        device: where batches are delivered: ``"cpu"`` (zero-copy ring views), ``"cuda"`` or
            ``"cuda:N"`` (one asynchronous copy per batch from the page-locked ring).

    Raises:
        ConfigError: a bad batch size, ring size, rail, sampler or device argument (named), or a
            CUDA device while none is available.
        CapacityError: the ring cannot be page-locked for a CUDA device.
        RailUnavailableError: a forced rail that cannot serve every server.
        UnavailableError: a server is unreachable (named).
    """

    def __init__(
        self,
        info: kspeed_pb2.DatasetInfo,
        links: Sequence[Any],
        *,
        config: ClientConfig,
        batch_size: int,
        sampler: Any = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        rail: str | None = None,
        ring_bytes: int | None = None,
        quiet: bool = False,
        hostnames: Mapping[str, str] | None = None,
        manager: Any = None,
        lease: Any = None,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self._closed = True
        self.name = info.spec.name
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(
                f"dataset {self.name!r}: batch_size must be a positive integer, got {batch_size!r}",
                field="batch_size",
                value=batch_size,
            )
        self.batch_size = batch_size
        self.num_samples = int(info.fingerprint.count)
        self.class_names = list(info.class_names)
        self._labelled = bool(info.spec.labels)
        self._orders = EpochOrders(
            sampler,
            num_samples=self.num_samples,
            batch_size=batch_size,
            drop_last=drop_last,
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            dataset=self.name,
        )
        self._delivery = make_delivery(device)
        self.device = self._delivery.device
        self._ring_bytes = self._ring_size(info, ring_bytes if ring_bytes is not None else config.ring_bytes)
        self._quiet = quiet
        self._manager = manager
        self._lease = lease
        self._links = list(links)
        self._epoch = 0
        self._consumed = 0
        self._resume = 0
        self._loaded_epoch: int | None = None
        self._iterations = 0
        self._passes = itertools.count(1)
        # The NIC and cores nearest this process's GPU (no preference without a GPU or NIC); a forced
        # NIC that does not exist is an error here, never a silent fallback.
        self.placement = place(environ=gpu_environment(), nic=config.nic or None)
        if self.placement.gpu_bus_id or self.placement.nic:
            log.info("dataset %s: placement %s", self.name, self.placement.reason)
        cores = self.placement.cores if config.pin_threads else ()
        self._io = ThreadPoolExecutor(
            min(8, max(len(self._links), 1)), thread_name_prefix="kspeed-io", initializer=pin, initargs=(cores,)
        )
        hostnames = hostnames or {}
        choice = choose_rail(
            {link.server_id: (link.address, hostnames.get(link.server_id, "")) for link in self._links},
            rail or config.rail,
        )
        options = RailOptions(token=config.security.data_plane_token(), **self._tcp_host(config, hostnames))
        self._feed_id = _feed_id(self.name, rank or 0)
        holder = f"{_user()}@{socket.gethostname()} pid {os.getpid()} rank {rank or 0}"
        try:
            self._feed = Feed(
                dataset=self.name,
                feed_id=self._feed_id,
                links=self._links,
                rail=choice.rail,
                reasons=choice.reasons,
                ring_bytes=self._ring_bytes,
                options=options,
                completion_timeout=config.completion_timeout,
                holder=holder[:200],
                pacer=self._pacer(config, choice.rail, hostnames),
            )
        except BaseException:
            self._io.shutdown(wait=False)
            raise
        try:
            self._delivery.attach(self._feed.ring)
        except BaseException:
            self._feed.close()
            self._io.shutdown(wait=False)
            raise
        for pid in self._feed.helper_pids if cores else ():  # the tcp receiver process shares the node
            try:
                os.sched_setaffinity(pid, cores)
            except OSError as exc:
                log.warning("dataset %s: cannot pin receiver process %d to cores %s: %s", self.name, pid, cores, exc)
        self._pump = Pump(
            self._feed, self._plan_epoch, self._orders.deterministic, thread_cores=cores, delivery=self._delivery
        )
        self._stats = RankStats([link.server_id for link in self._links])
        self._reporter = None
        if manager is not None:
            me = getattr(sampler, "rank", rank or 0)
            world = getattr(sampler, "num_replicas", world_size or 1)
            self._reporter = StatsReporter(
                manager,
                job=config.job or default_job(),
                rank=int(me),
                world_size=int(world),
                dataset=self.name,
                collect=self.stats,
                interval=config.stats_interval,
            )
        self._closed = False

    def _pacer(self, config: ClientConfig, rail: str, hostnames: Mapping[str, str]) -> Pacer | None:
        """A pacer unless pacing is off; ``auto`` paces when data crosses a network (some server is remote).

        Co-located servers share no link with anyone: shm needs no pacing, and neither does tcp over
        loopback, where a window would only add round trips.
        """
        if config.pacing == "off":
            return None
        if config.pacing == "auto" and (
            rail == "shm" or all(is_local(link.address, hostnames.get(link.server_id, ""))[0] for link in self._links)
        ):
            return None
        return Pacer(
            len(self._links), credit=config.credit, node_loaders=config.loaders_on_node(), round_s=config.pace_round
        )

    def _ring_size(self, info: kspeed_pb2.DatasetInfo, requested: int) -> int:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
            raise ConfigError(
                f"dataset {self.name!r}: ring_bytes must be a non-negative integer, got {requested!r}",
                field="ring_bytes",
                value=requested,
            )
        if requested:
            return requested
        count = max(int(info.fingerprint.count), 1)
        average = -(-int(info.fingerprint.total_bytes) // count)
        per_sample = -(-average // SAMPLE_ALIGN) * SAMPLE_ALIGN
        return max(MIN_RING, RING_BATCHES * self.batch_size * per_sample)

    def _tcp_host(self, config: ClientConfig, hostnames: Mapping[str, str]) -> dict[str, str]:
        if config.data_host:
            return {"bind_host": config.data_host}
        remote = [
            link.address for link in self._links if not is_local(link.address, hostnames.get(link.server_id, ""))[0]
        ]
        return {"bind_host": local_address_towards(remote[0]) if remote else "127.0.0.1"}

    # -- planning --------------------------------------------------------------------------------

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        return make_plan(
            self._links,
            dataset=self.name,
            feed_id=self._feed_id,
            epoch=epoch,
            feed_epoch=next(self._passes),
            ids=self._orders.order(epoch),
            batch_size=self.batch_size,
            labelled=self._labelled,
            deterministic=self._orders.deterministic,
            ring_bytes=self._ring_bytes,
            pool=self._io,
        )

    # -- the IterableDataset protocol ------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if get_worker_info() is not None:
            raise StateError(NO_WORKERS)
        self._check_open()
        self._iterations += 1
        first, self._resume, self._loaded_epoch = self._resume, 0, None
        plan = self._pump.start(self._epoch, first)
        self._consumed = first
        return _EpochIterator(self, plan, first, self._iterations)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self._orders.num_batches()

    def __reduce__(self) -> Any:
        raise StateError(NO_WORKERS)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration delivers (and pass it to the sampler's ``set_epoch``).

        Right after :meth:`load_state_dict`, setting the saved epoch keeps the saved position, so
        the usual ``for epoch in range(start, n): ds.set_epoch(epoch)`` loop resumes mid-epoch.
        Without a call, every iteration repeats the same epoch (as with ``DistributedSampler``);
        the next epoch is prepared on the assumption that ``set_epoch(epoch + 1)`` follows.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}", field="epoch", value=epoch)
        if self._loaded_epoch != epoch:
            self._resume, self._loaded_epoch = 0, None
        self._epoch = epoch
        self._consumed = self._resume
        self._orders.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where training stands: epoch, batches consumed in it, seed and sampler identity (no buffers)."""
        return {
            "version": STATE_VERSION,
            "dataset": self.name,
            "epoch": self._epoch,
            "batches": self._consumed,
            "seed": self._orders.seed,
            "sampler": self._orders.identity,
            "batch_size": self.batch_size,
            "drop_last": self._orders.drop_last,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken: the next iteration skips the consumed batches.

        Raises:
            ConfigError: the state belongs to another dataset, sampler, seed or batch size (named).
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"not a KSpeedDataset state of version {STATE_VERSION}: {state!r:.200}", field="state")
        mine = self.state_dict()
        for key in ("dataset", "seed", "sampler", "batch_size", "drop_last", "num_samples"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"dataset {self.name!r}: the state was saved with {key}={state.get(key)!r}, this "
                    f"dataset has {key}={mine[key]!r}",
                    field=key,
                    value=state.get(key),
                )
        epoch, batches = state.get("epoch"), state.get("batches")
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(batches, int) or batches < 0:
            raise ConfigError(
                f"dataset {self.name!r}: bad epoch/batches in state: {epoch!r}/{batches!r}", field="epoch"
            )
        self.set_epoch(epoch)
        self._resume = self._consumed = min(batches, len(self))
        self._loaded_epoch = epoch

    # -- operations ------------------------------------------------------------------------------

    def preload(self, timeout: float | None = None) -> kspeed_pb2.DatasetInfo:
        """Start (or join) the servers' preload and wait for it, with a progress bar unless quiet.

        Raises:
            DatasetError: samples failed to load (named).
            StateError: the dataset was closed or has no manager.
        """
        from kspeed.control.progress import follow_preload

        self._check_open()
        if self._manager is None:
            raise StateError(f"dataset {self.name!r} was built without a manager connection; preload needs one")
        return follow_preload(self._manager, self.name, out=None if self._quiet else sys.stderr, timeout=timeout)

    def fence(self, server_id: str, reason: str = "fenced by the client") -> int:
        """Cut one server's data-plane path (see docs/feeding.md, Fencing); returns grants quarantined."""
        self._check_open()
        return self._feed.fence(server_id, reason)

    def stats(self) -> dict[str, Any]:
        """This rank's delivery figures.

        Batches, samples and bytes delivered and their rates, the data wait per batch (total, and
        mean/p50/p99/max over the recent batches, in ms), the bytes each server wrote, and the
        feed's grants, stale completions and ring use. The same figures reach the manager every
        ``stats_interval`` (``kspeed status --job``); :class:`kspeed.client.stats.PrometheusCollector`
        exports them.
        """
        return {
            **self._feed.stats(),
            **self._stats.summary(),
            "wait_s": self._pump.wait_s,
            "last_wait_s": self._pump.last_wait_s,
            "rail": self._feed.rail,
        }

    @property
    def rail(self) -> str:
        """The rail of the receive ring."""
        return self._feed.rail

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"dataset {self.name!r} is closed; attach it again with KSpeedClient.dataset()")

    def close(self) -> None:
        """Close the feeds, release the ring (views still held stay readable) and the lease."""
        if self._closed:
            return
        self._closed = True
        if self._reporter is not None:
            self._reporter.close()
        for step in (self._pump.close, self._delivery.close, self._feed.close):
            try:
                step()
            except KSpeedError as exc:
                log.warning("dataset %s: error while closing: %s", self.name, exc)
        self._io.shutdown(wait=False, cancel_futures=True)
        for link in self._links:
            link.close()
        if self._lease is not None:
            self._lease.close()

    def __enter__(self) -> KSpeedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _EpochIterator:
    """Delivers the batches of one epoch; a newer iteration of the same dataset supersedes it."""

    def __init__(self, dataset: KSpeedDataset, plan: EpochPlan, first: int, token: int) -> None:
        self._ds = dataset
        self._plan = plan
        self._next = first
        self._token = token

    def __iter__(self) -> _EpochIterator:
        return self

    def __len__(self) -> int:
        return max(self._plan.num_batches - self._next, 0)

    def __next__(self) -> Batch:
        ds = self._ds
        if ds._closed:
            raise StateError(f"dataset {ds.name!r} was closed during iteration")
        if self._token != ds._iterations:
            raise StateError(f"dataset {ds.name!r}: this iterator was superseded by a newer iter() of the dataset")
        if self._next >= self._plan.num_batches:
            raise StopIteration
        batch = ds._pump.next_batch(self._plan, self._next)
        lo, hi = int(self._plan.layout.starts[self._next]), int(self._plan.layout.starts[self._next + 1])
        ds._stats.record(ds._pump.last_wait_s, self._plan.owner[lo:hi], self._plan.lengths[lo:hi])
        self._next += 1
        ds._consumed = self._next
        return batch
