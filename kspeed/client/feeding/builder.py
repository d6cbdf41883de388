"""Assembles the parts of one rank's feed of a dataset; :class:`~kspeed.client.dataset.KSpeedDataset` only drives them.

In order: the sampler's orders, the delivery to the training device, where this process should
run (its GPU's nearest NIC and cores), the rail from the rails' capabilities, the receive ring and
its paths to every server (a :class:`~kspeed.client.feeding.feed.Feed`, paced or not), the planner of
epochs and the pump that keeps the ring granted, and the statistics with their reporter. A
failure half-way closes what was already built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pwd
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kspeed import wire
from kspeed.client.attribution import Attribution
from kspeed.client.delivery.device import Delivery, make_delivery
from kspeed.client.delivery.device_ring import CupyRingViews, DeviceRingDelivery, device_ring
from kspeed.client.feeding.failover import Failover
from kspeed.client.feeding.feed import Feed
from kspeed.client.feeding.foresight import Foresight
from kspeed.client.feeding.granting import Granting, Paced, Unpaced
from kspeed.client.feeding.links import Link
from kspeed.client.feeding.membership import group_fields
from kspeed.client.feeding.pacing import Pacer
from kspeed.client.feeding.pump import Pump
from kspeed.client.feeding.rail_choice import ServerPlace, choose_rail, local_address_towards, needs_pacing
from kspeed.client.options import FeedOptions
from kspeed.client.planning.plans import EpochPlanner, PrepSplit
from kspeed.client.planning.prediction import Predictor
from kspeed.client.planning.sampling import SINGLE, EpochOrders, job_rank
from kspeed.client.stats import RankStats, StatsReporter, default_job
from kspeed.config import ClientConfig, gpu_environment
from kspeed.control.manager_client import ManagerClient
from kspeed.errors import CapacityError, ConfigError, KSpeedError
from kspeed.layout import SAMPLE_ALIGN
from kspeed.proto import kspeed_pb2
from kspeed.rdma.device_memory import DeviceMemory
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import use_verbs_api
from kspeed.rdma.topology import Placement, pin, place

__all__ = ["MAX_IO_THREADS", "MIN_RING", "RING_BATCHES", "FeedParts", "build_feed", "ring_size"]

log = logging.getLogger(__name__)

MIN_RING = 256 << 20
RING_BATCHES = 4
PLANNER_JOIN_S = 10.0  # longest wait at close for a plan in progress to end (its links closed, it ends at once)
RING_MEMORY_SHARE = 0.25  # of the memory available when a ring is made: the default cap of one ring
MAX_IO_THREADS = 8  # threads that talk to the servers at once (lookups, commits)


@dataclass
class FeedParts:
    """Everything one rank's feed of a dataset is made of.

    Attributes:
        links: the dataset's servers, in plan-owner order.
        orders: the sampler's orders.
        delivery: how batches reach the training device.
        placement: the NIC and cores nearest this process's GPU.
        io: threads that talk to several servers at once.
        feed: the receive ring and its paths.
        pump: keeps the ring granted ahead of the training loop.
        stats: what this rank received.
        reporter: sends the statistics to the manager (``None`` without a manager).
        ring_bytes: the ring's size.
        planner: plans (looks up and commits) the epochs.
    """

    links: list[Link]
    orders: EpochOrders
    delivery: Delivery
    placement: Placement
    io: ThreadPoolExecutor
    feed: Feed
    pump: Pump
    stats: RankStats
    reporter: StatsReporter | None
    ring_bytes: int
    planner: EpochPlanner
    #: where the rank's data wait goes (the pump attributes each batch's)
    attribution: Attribution = field(default_factory=lambda: Attribution([]))
    #: more figures for :meth:`figures` (the prepared dataset's split of preprocessing)
    more: list[Callable[[], dict[str, Any]]] = field(default_factory=list)

    def close(self) -> None:
        """Stop the reporter and the pump, undo the delivery, close the feed and the links (best effort)."""
        if self.reporter is not None:
            self.reporter.close()
        for step in (self.pump.close, self.delivery.close, self.feed.close):
            try:
                step()
            except KSpeedError as exc:
                log.warning("dataset %s: error while closing: %s", self.feed.dataset, exc)
        self.io.shutdown(wait=False, cancel_futures=True)
        # Every link in use, a failover's too: closing its channel ends the calls in flight on
        # it, so a plan being made (ahead, on the planner thread) ends now, not at its deadline.
        for link in {id(link): link for link in [*self.links, *self.planner.links]}.values():
            link.close()
        if not self.pump.join(PLANNER_JOIN_S):
            log.warning(
                "dataset %s: the planner thread has not ended %gs after close", self.feed.dataset, PLANNER_JOIN_S
            )

    def figures(self) -> dict[str, Any]:
        """This rank's delivery figures: the feed's counters, the rank's statistics, its data wait and
        (a sampler not deterministic in (seed, epoch)) its orders predicted and planned ahead."""
        foresight = self.pump.foresight
        return {
            **self.feed.stats(),
            **self.stats.summary(),
            **(foresight.stats() if foresight is not None else Foresight.NONE),
            "wait_s": self.pump.wait_s,
            "last_wait_s": self.pump.last_wait_s,
            "rail": self.feed.rail,
            "attribution": self.attribution.figures(self.feed.held_s, self.feed.latency_s),
            **{k: v for more in self.more for k, v in more().items()},
        }

    def production_figures(self, server: str) -> kspeed_pb2.ProductionFigures | None:
        """``server``'s production figures for this dataset (``None``: not one of its servers now,
        or one that does not report them)."""
        link = next((p.link for p in self.feed.paths if p.link.server_id == server), None)
        return link.production_figures(self.feed.dataset) if link is not None else None


def available_memory() -> int:
    """Bytes of memory this host can give without swapping (``MemAvailable``; all of it if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ring_cap(configured: int) -> int:
    """The largest ring a dataset may allocate: ``configured``, or (for 0) a
    :data:`RING_MEMORY_SHARE` of the memory available now, at least :data:`MIN_RING`."""
    return configured or max(MIN_RING, int(available_memory() * RING_MEMORY_SHARE))


def ring_size(
    info: kspeed_pb2.DatasetInfo, batch_size: int, requested: int, sample_bytes: int = 0, cap: int = 0
) -> int:
    """``requested``, or (for 0) room for :data:`RING_BATCHES` batches of ``batch_size`` average samples
    (at least ``sample_bytes`` each: what the servers' preprocessing makes of one), at least
    :data:`MIN_RING` unless twice the dataset's bytes are less, and at most ``cap`` (0: no cap).

    ``batch_size`` is the largest batch an epoch makes: the batch size asked for, or the rank's
    samples per epoch when there are fewer (:meth:`~kspeed.client.planning.sampling.EpochOrders.largest_batch`).

    Raises:
        CapacityError: ``requested``, or one batch of average samples, is larger than ``cap``
            (nothing is allocated yet; the message names the sizes and the settings to change).
    """
    name = info.spec.name
    count = max(int(info.fingerprint.count), 1)
    average = max(-(-int(info.fingerprint.total_bytes) // count), sample_bytes)
    per_sample = -(-average // SAMPLE_ALIGN) * SAMPLE_ALIGN
    batch = batch_size * per_sample
    if cap and batch > cap:
        raise CapacityError(
            f"dataset {name!r}: one batch of {batch_size} samples of about {average} bytes takes {batch} bytes, "
            f"more than the largest receive ring allowed ({cap} bytes: ring_max_bytes, default a quarter of the "
            "available memory); use a smaller batch_size or raise ring_max_bytes"
        )
    if requested:
        if cap and requested > cap:
            raise CapacityError(
                f"dataset {name!r}: a receive ring of {requested} bytes is larger than the largest allowed "
                f"({cap} bytes: ring_max_bytes, default a quarter of the available memory)"
            )
        return requested
    # A small dataset needs no more than twice its own bytes (every batch fits, with room to wrap
    # around): a ring is allocated and mapped whole at the start, a fixed cost of each job.
    whole = 2 * count * (per_sample + SAMPLE_ALIGN)
    wanted = max(RING_BATCHES * batch, min(MIN_RING, whole))
    return min(wanted, cap) if cap else wanted


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _feed_id(dataset: str, rank: int) -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:16]  # room for a path's suffix (Feed.feed_id_for)
    return f"{host}-{os.getpid()}-r{rank}-{dataset[:16]}-{os.urandom(3).hex()}"


def rail_options_for(config: ClientConfig, bind_host: str, placement: Placement) -> RailOptions:
    """The rails' options of a feed: the cluster's token, the tcp receiver's address, and for
    ``verbs`` the RDMA NIC the placement chose (nearest the GPU, or the one ``client.nic`` forced)."""
    return RailOptions(
        token=config.security.data_plane_token(),
        bind_host=bind_host,
        nic=placement.nic if placement.rail == "verbs" else None,
        verbs_api=config.verbs_api,
    )


def _tcp_host(config: ClientConfig, places: Mapping[str, ServerPlace]) -> str:
    """Where a network receiver listens: the configured address, loopback, or the route to the servers."""
    if config.data_host:
        return config.data_host
    remote = [p.address for p in places.values() if not p.local[0]]
    return local_address_towards(remote[0]) if remote else "127.0.0.1"


def _granting(config: ClientConfig, rail: str, places: Mapping[str, ServerPlace], servers: int) -> Granting:
    """Paced unless pacing is off; ``auto`` paces when the rail crosses a network that incast can overrun."""
    if config.pacing == "off" or (config.pacing == "auto" and not needs_pacing(rail, places)):
        return Unpaced()
    pacer = Pacer(servers, credit=config.credit, node_loaders=config.loaders_on_node(), round_s=config.pace_round)
    return Paced(pacer)


def build_feed(
    info: kspeed_pb2.DatasetInfo,
    links: Sequence[Link],
    *,
    config: ClientConfig,
    options: FeedOptions,
    places: Mapping[str, ServerPlace] | None = None,
    manager: ManagerClient | None = None,
    prep: PrepSplit | None = None,
) -> FeedParts:
    """Build every part of this rank's feed of ``info`` from its servers' ``links``.

    Args:
        info: the dataset as the manager describes it (shares, addresses, sample count).
        links: one control-plane link per server of the dataset.
        config: the client configuration (rail, ring size, pacing, timeouts, credentials).
        options: the feed's options.
        places: per server id, where it runs and which rails it offers (default: only its address).
        manager: reports the rank's statistics when given.
        prep: how the dataset's pipeline is split between the servers and this client.

    Raises:
        ConfigError: a bad option (named) or a CUDA device while none is available.
        CapacityError: the ring cannot be set up.
        RailUnavailableError: a forced rail cannot serve every server.
        UnavailableError: a server is unreachable (named).
    """
    name = info.spec.name
    options, provisional = _with_job_rank(name, options)
    group = group_fields(info, options, config.job)
    places = {link.server_id: (places or {}).get(link.server_id) or ServerPlace(link.address) for link in links}
    requested = options.ring_bytes if options.ring_bytes is not None else config.ring_bytes
    if requested < 0:
        raise ConfigError(f"dataset {name!r}: ring_bytes must not be negative, got {requested}", field="ring_bytes")
    orders = _epoch_orders(info, options)
    orders.check_declared()
    orders.provisional = provisional
    delivery = make_delivery(options.device)
    ring_bytes = ring_size(
        info, orders.largest_batch(), requested, prep.nbytes if prep is not None else 0, ring_cap(config.ring_max_bytes)
    )
    # The NIC and cores nearest this process's GPU (no preference without a GPU or NIC); a forced
    # NIC that does not exist is an error here, never a silent fallback.
    placement = place(environ=gpu_environment(), nic=config.nic or None)
    if placement.gpu_bus_id or placement.nic:
        log.debug("dataset %s: placement %s", name, placement.reason)
    cores = placement.cores if config.pin_threads else ()
    use_verbs_api(config.verbs_api)
    choice = choose_rail(places, options.rail or config.rail)
    rail_options = rail_options_for(config, _tcp_host(config, places), placement)
    device_memory = None
    if delivery.device.type == "cuda":
        delivery, device_memory = _gpu_delivery(name, config, choice.rail, delivery, ring_bytes)
    rank = options.rank or 0
    holder = f"{_user()}@{socket.gethostname()} pid {os.getpid()} rank {rank}"
    with contextlib.ExitStack() as undo:
        if device_memory is not None:
            undo.callback(device_memory.close)  # (the feed's receiver frees it once it has it)
        io = ThreadPoolExecutor(
            min(MAX_IO_THREADS, max(len(links), 1)), thread_name_prefix="kspeed-io", initializer=pin, initargs=(cores,)
        )
        undo.callback(io.shutdown, wait=False)
        feed = Feed(
            dataset=name,
            feed_id=_feed_id(name, rank),
            links=links,
            rail=choice.rail,
            reasons=choice.reasons,
            ring_bytes=ring_bytes,
            options=rail_options,
            completion_timeout=config.completion_timeout,
            holder=holder[:200],
            granting=_granting(config, choice.rail, places, len(links)),
            ranks=int(getattr(options.sampler, "num_replicas", options.world_size or 1)),
            device_memory=device_memory,
            job=(config.job or default_job())[:200],
            group=group,
        )
        undo.callback(feed.close)
        delivery.attach(feed.ring)
        undo.callback(delivery.close)
        _pin_helpers(name, feed, cores)
        planner = EpochPlanner(
            links,
            dataset=name,
            feed_ids=[path.feed_id for path in feed.paths],
            orders=orders,
            batch_size=options.batch_size,
            labelled=bool(info.spec.labels),
            ring_bytes=ring_bytes,
            pool=io,
            prep=prep,
            drop=feed.drop_plan,
            truncate=feed.truncate_plan,
        )
        sample = (info.sample_dtype, tuple(int(d) for d in info.sample_shape))
        foresight = None if orders.deterministic else Foresight(Predictor(orders), planner, feed.drop_plan, cores)
        pump = Pump(
            feed,
            planner,
            orders.deterministic,
            thread_cores=cores,
            delivery=delivery,
            sample=sample,
            splitter=planner if prep is not None and prep.adjustable else None,
            foresight=foresight,
        )
        if manager is not None:  # a lost server's share is followed to its new holder
            pump.failover = Failover(
                dataset=name, info=info, feed=feed, planner=planner, manager=manager, config=config
            )
        stats = RankStats([link.server_id for link in links])
        pump.attribution = Attribution([link.server_id for link in links])
        undo.pop_all()
    parts = FeedParts(
        list(links),
        orders,
        delivery,
        placement,
        io,
        feed,
        pump,
        stats,
        None,
        ring_bytes,
        planner,
        attribution=pump.attribution,
    )
    if manager is not None:  # the rank's statistics, reported to the manager
        parts.reporter = _reporter(manager, config, options, name, parts)
    return parts


def _reporter(
    manager: ManagerClient, config: ClientConfig, options: FeedOptions, name: str, parts: FeedParts
) -> StatsReporter:
    sampler = options.sampler
    return StatsReporter(
        manager,
        job=config.job or default_job(),
        rank=int(getattr(sampler, "rank", options.rank or 0)),
        world_size=int(getattr(sampler, "num_replicas", options.world_size or 1)),
        dataset=name,
        collect=parts.figures,
        interval=config.stats_interval,
        refresh=lambda: parts.attribution.refresh(parts.production_figures),
    )


def _with_job_rank(name: str, options: FeedOptions) -> tuple[FeedOptions, str | None]:
    """``options`` with this process's rank and world size when the built-in sampler splits each
    epoch over the job's ranks (a given sampler splits it itself), and, where that rank is a
    guess (nothing says there are several ranks, or the launcher says there are but not which
    this is: a dataset opened before the process group), why: it is checked again when the first
    epoch starts."""
    if options.sampler is not None:
        return options, None
    try:
        rank, world_size, source = job_rank(options.rank, options.world_size)
        provisional = source if source == SINGLE else None
    except ConfigError as exc:  # (raised again when the epoch starts if nothing says more by then)
        rank, world_size, source = options.rank or 0, options.world_size or 1, str(exc)
        provisional = source
    if source != "given":
        log.debug("dataset %s: rank %d of %d, from %s", name, rank, world_size, source)
    return dataclasses.replace(options, rank=rank, world_size=world_size), provisional


def _epoch_orders(info: kspeed_pb2.DatasetInfo, options: FeedOptions) -> EpochOrders:
    """Each epoch's sample order for this rank, from the sampler or the built-in one."""
    name = info.spec.name
    return EpochOrders(
        options.sampler,
        num_samples=int(info.fingerprint.count),
        batch_size=options.batch_size,
        drop_last=options.drop_last,
        seed=options.seed,
        shuffle=options.shuffle,
        rank=options.rank,
        world_size=options.world_size,
        dataset=name,
        shard_starts=wire.unpack_i64(info.shard_starts, f"dataset {name!r}: shard starts")
        if info.shard_starts
        else None,
        shuffle_buffer=options.shuffle_buffer,
    )


def _gpu_delivery(
    name: str, config: ClientConfig, rail: str, delivery: Delivery, ring_bytes: int
) -> tuple[Delivery, DeviceMemory | None]:
    """Delivery to a CUDA device: straight into a device ring the rail writes (GPUDirect RDMA)
    where one can be made, else ``delivery`` (copies from the pinned host ring)."""
    device_memory, why = device_ring(config.gpudirect, rail, delivery.device, ring_bytes)
    if device_memory is None:
        log.debug(
            "dataset %s: rail %s writes into the pinned host ring, copied to %s (no GPUDirect ring: %s)",
            name,
            rail,
            delivery.device,
            why,
        )
        return delivery, None
    log.debug(
        "dataset %s: rail %s writes straight into a %d-byte ring on %s (GPUDirect RDMA)",
        name,
        rail,
        device_memory.nbytes,
        delivery.device,
    )
    return DeviceRingDelivery(delivery.device, CupyRingViews(device_memory)), device_memory


def _pin_helpers(name: str, feed: Feed, cores: tuple[int, ...]) -> None:
    """Pin the feed's helper processes (the tcp receiver shares the node) to the training process's cores."""
    for pid in feed.helper_pids if cores else ():
        try:
            os.sched_setaffinity(pid, cores)
        except OSError as exc:
            log.warning("dataset %s: cannot pin receiver process %d to cores %s: %s", name, pid, cores, exc)
