"""KSpeedDataset: an ``IterableDataset`` of ready batches pushed by the servers into a receive ring.

Usage (normally through :meth:`kspeed.KSpeedClient.dataset`)::

    ds = client.dataset(spec, batch_size=64, rank=rank, world_size=world)
    ds.preload()
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in ds:              # or DataLoader(ds, batch_size=None)
            train(batch.samples, batch.labels)

With ``device="cuda"`` (or ``"cuda:N"``) every batch is copied to that GPU in one asynchronous copy
of its ring range (:mod:`kspeed.client.delivery.device`); ``batch.samples`` are then views of the device copy.

Resume: :meth:`KSpeedDataset.state_dict` is a few hundred bytes (epoch, batches consumed, seed and
the sampler's identity). For samplers deterministic in (seed, epoch) (the built-in one,
``DistributedSampler``, ``SequentialSampler``) :meth:`KSpeedDataset.load_state_dict` continues with
exactly the batches that were not yet delivered. For any other sampler the epoch's order is drawn
again from the sampler when the resumed epoch starts and its first ``batches`` batches are
skipped: the same *number* of batches remains, but they are the same samples only if the
sampler's own random state was restored too (e.g. a seeded ``torch.Generator`` saved by the user).
Predicting such a sampler's next order to plan it ahead (:mod:`kspeed.client.feeding.foresight`)
draws only from copies, so the state saved is the one the training loop left.
"""

from __future__ import annotations

import base64
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from kspeed.client.accelerate_guard import check_not_resharded
from kspeed.client.batch import Batch
from kspeed.client.feeding.builder import FeedParts
from kspeed.client.lease import LeaseKeeper
from kspeed.client.live import LivePositions
from kspeed.client.options import FeedOptions
from kspeed.client.planning.plans import EpochPlan, PrepSplit
from kspeed.client.planning.resize import Pass, part_of, remainder
from kspeed.client.planning.sampling import job_rank
from kspeed.client.sampler_view import SamplerView
from kspeed.client.stats import default_job
from kspeed.client.tuning.auto import AutoOffload
from kspeed.client.tuning.store import model_signature, record_of
from kspeed.control.manager_client import ManagerClient
from kspeed.control.progress import PreloadSummary, follow_preload
from kspeed.errors import ConfigError, KSpeedError, StateError
from kspeed.preprocess.pipeline import Pipeline
from kspeed.proto import kspeed_pb2

__all__ = ["KSpeedDataset"]

log = logging.getLogger(__name__)

T = TypeVar("T")

STATE_VERSION = 2  # (1: no passes; still loaded)
NO_WORKERS = (
    "KSpeedDataset cannot run in DataLoader worker processes (num_workers > 0): its gRPC channels and "
    "data-plane resources (the receive ring and the servers' connections to it) do not survive fork or "
    "pickling, and every worker would receive the whole epoch again. Use DataLoader(ds, batch_size=None, "
    "num_workers=0): the servers already load and push the samples in parallel."
)


class KSpeedDataset(IterableDataset):
    """Batches of one dataset for this rank, in the sampler's order.

    Build one with :meth:`KSpeedClient.dataset <kspeed.KSpeedClient.dataset>`.

    Args:
        info: the dataset as the manager describes it (name, sample count, classes).
        parts: the feed's parts (:func:`kspeed.client.feeding.builder.build_feed`).
        options: the feed's options.
        manager: a ``ManagerClient`` for :meth:`preload`.
        lease: the lease keeper to stop on :meth:`close`.
        pipeline: the dataset's pipeline with this rank's places (its batches are then raw or
            server-preprocessed bytes; :class:`kspeed.client.prepared.PreparedDataset` runs the rest).
        prep: how the plans split the pipeline's server stages.

    Raises:
        ConfigError: the dataset's ``cache`` does not fit its pipeline.
    """

    def __init__(
        self,
        info: kspeed_pb2.DatasetInfo,
        parts: FeedParts,
        *,
        options: FeedOptions,
        manager: ManagerClient | None = None,
        lease: LeaseKeeper | None = None,
        pipeline: Pipeline | None = None,
        prep: PrepSplit | None = None,
    ) -> None:
        super().__init__()
        self.name = info.spec.name
        self.pipeline = pipeline
        #: leading stages the servers keep applied (a dataset cached preprocessed): every sample arrives past them
        self.cached_stages = pipeline.cached_stages(info.spec.cache) if pipeline is not None else 0
        self.prep = prep
        self.seed = options.seed
        self.labelled = bool(info.spec.labels)
        self.on_error = options.on_error
        self.batch_size = options.batch_size
        self._model = options.model
        self._raw_bytes = int(info.fingerprint.total_bytes) / max(int(info.fingerprint.count), 1)
        self.num_samples = int(info.fingerprint.count)
        self.class_names = list(info.class_names)
        self.device = parts.delivery.device
        self.placement = parts.placement
        self._parts = parts
        self._orders = parts.orders
        self._feed = parts.feed
        self._pump = parts.pump
        self._stats = parts.stats
        self._quiet = options.quiet
        self._manager = manager
        self._lease = lease
        self._epoch = 0
        self._consumed = 0
        self._resume = 0
        self._loaded_epoch: int | None = None
        # the passes over an epoch resumed at another world size before this rank's (docs/resume.md)
        self._passes: list[Pass] = []
        self._passes_epoch: int | None = None
        self._resumed_iterations = 0
        #: where the servers keep this rank's position (``resume="live"``); ``_live_here``: whether
        #: this dataset reports it (not when a PreparedDataset hands the batches on: it does)
        self._live: LivePositions | None = None
        self._live_here = True
        self._iterations = 0
        self._closed = False

    # -- the IterableDataset protocol ------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if get_worker_info() is not None:
            raise StateError(NO_WORKERS)
        check_not_resharded(self.name)
        self._check_open()
        self._settle_rank(strict=True)
        self._iterations += 1
        if self._orders.resumed_epoch == self._epoch:
            # (iterated again without set_epoch: the whole epoch, as a sampler repeats one)
            self._resumed_iterations += 1
            if self._resumed_iterations > 1:
                self._forget_resume()
        first, self._resume, self._loaded_epoch = self._resume, 0, None
        plan = self._pump.start(self._epoch, first)
        self._consumed = first
        if self._live_here:
            self.keep_position(first)  # (a pass begun: a live resume finds it, not the one before)
        return _EpochIterator(self, plan, first, self._iterations)

    def __len__(self) -> int:
        """Batches per epoch for this rank, as ``len()`` of a ``DataLoader`` counts batches.

        :attr:`samples_per_epoch` counts this rank's samples, :attr:`num_samples` the dataset's.
        """
        self._settle_rank(strict=False)
        return self._orders.num_batches()

    def _settle_rank(self, *, strict: bool) -> None:
        """A dataset opened before its process group (in a Lightning module's ``__init__``, say) took
        its rank as a guess: rank 0 of 1 where nothing said there were several, or rank 0 of 1 for now
        where the launcher said there were several but not which this is. Asked again here (when
        an epoch starts or a state loads, ``strict``: a rank still unknown then is a ``ConfigError``;
        on ``len()``, only if known by now), the split follows the process group or launcher from
        then on, its plans made again.

        Raises:
            ConfigError: ``strict``, and the launcher's variables still say there are several ranks
                but nothing says which this is.
        """
        if self._orders.provisional is None:
            return
        try:
            rank, world, source = job_rank(None, None)
        except ConfigError:
            if strict:
                raise
            return
        self._orders.provisional = None
        if (rank, world) == (self._orders.rank, self._orders.world_size):
            return
        log.info(
            "dataset %s: rank %d of %d, from %s (opened before it was known, as rank %s of %s)",
            self.name,
            rank,
            world,
            source,
            self._orders.rank,
            self._orders.world_size,
        )
        self._forget_resume()
        self._orders.resplit(rank, world)
        self._pump.forget_all()
        if self._parts.reporter is not None:
            self._parts.reporter.set_rank(rank, world)

    @property
    def rank(self) -> int | None:
        """This process's rank in the built-in sampler's split (given, or from the process group or
        torchrun's ``RANK``); None with a sampler of your own."""
        self._settle_rank(strict=False)
        return self._orders.rank

    @property
    def world_size(self) -> int | None:
        """Ranks sharing each epoch in the built-in sampler's split; None with a sampler of your own."""
        self._settle_rank(strict=False)
        return self._orders.world_size

    @property
    def sampler(self) -> SamplerView:
        """What a trainer takes for this loader's sampler: ``ds.sampler.set_epoch(e)`` is
        :meth:`set_epoch` (PyTorch Lightning sets epochs only so); ``len()``: :attr:`samples_per_epoch`;
        ``.sampler``: the torch sampler that draws each epoch's order."""
        return SamplerView(self, lambda: self.samples_per_epoch, self._orders.sampler)

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank receives per epoch (with ``drop_last``, the dropped ones not counted)."""
        self._settle_rank(strict=False)
        n = self._orders.samples_per_epoch()
        return n - n % self.batch_size if self._orders.drop_last else n

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
        if self._orders.resumed_epoch not in (None, epoch):
            self._forget_resume()
        self._epoch = epoch
        self._consumed = self._resume
        self._orders.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where training stands: epoch, batches consumed in it, seed and sampler identity (no
        buffers); for an order split over the ranks as ``DistributedSampler`` splits it, also
        where in the epoch's global order each pass over it stands (docs/resume.md)."""
        return self.state_at(self._consumed)

    def state_at(self, batches: int) -> dict[str, Any]:
        """:meth:`state_dict` as it reads once ``batches`` batches of the current epoch are consumed."""
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "dataset": self.name,
            "epoch": self._epoch,
            "batches": batches,
            "seed": self._orders.seed,
            "sampler": self._orders.identity,
            "batch_size": self.batch_size,
            "drop_last": self._orders.drop_last,
            "num_samples": self.num_samples,
        }
        split = self._orders.split()
        drawn = self._orders.drawn_from
        if split is None and drawn is not None and drawn[0] == self._epoch:
            # (drawn from its own generator: another batch size draws the epoch again from there)
            skipped = self._orders.skipped[1] if self._orders.skipped[0] == self._epoch else 0
            mine = self.samples_per_epoch if batches >= len(self) else batches * self.batch_size
            state.update(generator=base64.b64encode(drawn[1]).decode(), position=skipped + mine)
        if split is not None:
            rank, world = split
            # (a rank knows its own count; the ranks of a synchronous job consume alike: merge_states
            # puts every rank's own in where they may differ)
            mine = self._orders.samples_per_epoch() if batches >= len(self) else batches * self.batch_size
            earlier = self._passes if self._passes_epoch == self._epoch else []
            state.update(
                order=self._orders.order_identity,
                rank=rank,
                world_size=world,
                passes=[p.to_state() for p in [*earlier, Pass(world, (mine,) * world)]],
            )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken (docs/resume.md).

        For an order split as ``DistributedSampler`` splits one global order (the built-in
        sampler's, a ``DistributedSampler``'s, a sampler's that declares it): at the world size
        and batch size of the state's last pass, this rank continues its own part of that pass
        at its own position (the state may be another rank's, as a checkpoint keeps one copy);
        otherwise the next iteration delivers this rank's part of what no rank had delivered of
        the epoch, split anew over this world size. For any other sampler, at the state's batch
        size the next iteration skips the consumed batches, and at another one a sampler with a
        generator of its own draws the epoch again from the generator's saved state and
        delivers the rest. The epochs after are whole again.

        Raises:
            ConfigError: the state belongs to another dataset, seed or sampler; or it was saved at
                another world size, batch size or rank by a sampler whose order cannot be split again
                (named).
        """
        if not isinstance(state, Mapping) or state.get("version") not in (1, STATE_VERSION):
            raise ConfigError(f"not a KSpeedDataset state of version {STATE_VERSION}: {state!r:.200}", field="state")
        self._settle_rank(strict=True)
        mine = self.state_dict()
        for key in ("dataset", "seed", "num_samples", "drop_last"):
            self._same(state, mine, key)
        epoch, batches = state.get("epoch"), state.get("batches")
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(batches, int) or batches < 0:
            raise ConfigError(
                f"dataset {self.name!r}: bad epoch/batches in state: {epoch!r}/{batches!r}", field="epoch"
            )
        raw = state.get("passes", [])
        if not isinstance(raw, list | tuple):
            raise ConfigError(f"dataset {self.name!r}: bad passes in state: {raw!r:.200}", field="passes")
        passes = [Pass.from_state(p) for p in raw]
        split = self._orders.split()
        if not passes and split is None and "generator" in state and state.get("batch_size") != self.batch_size:
            self._same(state, mine, "sampler")
            try:
                drawn, position = base64.b64decode(state["generator"], validate=True), state["position"]
                if not isinstance(position, int) or position < 0:
                    raise ValueError(f"position {position!r}")
                self._forget_resume()
                self._orders.skip_drawn(epoch, drawn, position)
            except (ValueError, TypeError, RuntimeError) as exc:  # (torch refuses a state of another size)
                raise ConfigError(
                    f"dataset {self.name!r}: bad generator state or position in state: {exc}", field="state"
                ) from exc
            self.set_epoch(epoch)
            self._resume = self._consumed = 0
            self._loaded_epoch = epoch
            return
        if not passes or split is None:  # (saved, or resumed, by a sampler that cannot resize)
            for key in ("sampler", "batch_size"):
                self._same(state, mine, key)
            if passes:
                self._orders.global_order(epoch)  # raises, naming the sampler
            self._forget_resume()
            self.set_epoch(epoch)
            self._resume = self._consumed = min(batches, len(self))
            self._loaded_epoch = epoch
            return
        self._same(state, mine, "order")
        rank, world = split
        last = passes[-1]
        joins = last.world == world and state.get("batch_size") == self.batch_size
        # Of the same world size and batch size, the rank continues its part of the last pass at its
        # own position (ranks that load at different moments, while others read on, agree on it);
        # otherwise the rest of the epoch is split anew over this world size.
        earlier = passes[:-1] if joins else passes
        rest = remainder(self._orders.global_order(epoch), earlier)
        part = part_of(rest, rank, world)
        if self._orders.drop_last:
            part = part[: len(part) - len(part) % self.batch_size]
        self._forget_resume()
        if earlier:
            self._orders.resume(epoch, part)
            self._pump.forget(epoch)
            self._passes, self._passes_epoch, self._resumed_iterations = earlier, epoch, 0
        self.set_epoch(epoch)
        if joins:
            done = last.positions[rank]
            skip = -(-len(part) // self.batch_size) if done >= len(part) else done // self.batch_size
        else:
            skip = 0
        self._resume = self._consumed = min(skip, len(self))
        self._loaded_epoch = epoch
        log.info(
            "dataset %s: epoch %d resumed as rank %d of %d: %d of its %d samples were delivered before %s; "
            "this rank's part is %d, %d batches of it delivered",
            self.name,
            epoch,
            rank,
            world,
            self.num_samples - len(rest),
            self.num_samples,
            "this pass" if joins else "this resize",
            len(part),
            self._resume,
        )

    def resume_live(self, job: str) -> bool:
        """Keep this rank's position on the servers from now on, with every batch handed out, and
        continue from the position the job's ranks had reached, if the servers keep one (a job
        restarted under the same job name: docs/resume.md). Returns whether one was found.

        Raises:
            ConfigError: the sampler's order is not split from one global order (it cannot take
                another rank's position), or a found position does not fit this dataset (named).
        """
        self._settle_rank(strict=True)
        if self._orders.split() is None:
            raise ConfigError(
                f"dataset {self.name!r}: resume='live' needs the built-in sampler (or a DistributedSampler without "
                f"drop_last), whose epochs split one global order over the ranks; sampler {self._orders.identity} "
                "does not: resume from a state_dict() of each rank instead",
                field="resume",
            )
        live = LivePositions(self.name, job, self._server_links)
        state = live.load()
        if state is not None:
            self.load_state_dict(state)
        self._live = live
        return state is not None

    def hand_positions_over(self) -> None:
        """A dataset that hands this one's batches on (a PreparedDataset, after its transforms)
        reports the positions itself, counting what it handed on (:meth:`keep_position`)."""
        self._live_here = False

    def _server_links(self) -> list[Any]:
        """The dataset's servers now, one link each."""
        return list({path.link.server_id: path.link for path in self._feed.paths}.values())

    def keep_position(self, batches: int) -> None:
        """With ``resume="live"``, have the servers keep this rank's position: ``batches`` of the
        current epoch handed out (see :meth:`resume_live`)."""
        if self._live is not None:
            self._live.keep(self.state_at(batches))

    @staticmethod
    def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One state for the whole job from every rank's :meth:`state_dict` (in any order), with
        each rank's own position in the epoch: for ranks that consumed different numbers of
        batches (a single rank's state takes every rank to be where it is).

        Raises:
            ConfigError: the states are not one of each rank of one job at one epoch (named).
        """
        if not states:
            raise ConfigError("merge_states needs the states of every rank, got none", field="state")
        first = states[0]
        world = first.get("world_size")
        if not isinstance(world, int) or not first.get("passes"):
            raise ConfigError(
                f"dataset {first.get('dataset')!r}: its sampler's states hold no per-rank positions to merge "
                f"(sampler {first.get('sampler')!r})",
                field="state",
            )
        ranks = sorted(int(s.get("rank", -1)) for s in states)
        if ranks != list(range(world)):
            raise ConfigError(
                f"dataset {first.get('dataset')!r}: merge_states needs one state of each of the {world} ranks, "
                f"got ranks {ranks}",
                field="rank",
            )
        positions = [0] * world
        for s in states:
            for key in ("dataset", "epoch", "seed", "order", "world_size", "batch_size"):
                if s.get(key) != first.get(key):
                    raise ConfigError(
                        f"dataset {first.get('dataset')!r}: the ranks' states differ in {key} "
                        f"({first.get(key)!r} and {s.get(key)!r})",
                        field=key,
                    )
            if s["passes"][:-1] != first["passes"][:-1]:
                raise ConfigError(
                    f"dataset {first.get('dataset')!r}: the ranks' states differ in earlier passes", field="passes"
                )
            positions[int(s["rank"])] = int(s["passes"][-1][1][int(s["rank"])])
        return {**first, "passes": [*first["passes"][:-1], [world, positions]]}

    def _same(self, state: Mapping[str, Any], mine: Mapping[str, Any], key: str) -> None:
        if state.get(key) != mine.get(key):
            raise ConfigError(
                f"dataset {self.name!r}: the state was saved with {key}={state.get(key)!r}, this "
                f"dataset has {key}={mine.get(key)!r}",
                field=key,
                value=state.get(key),
            )

    def _forget_resume(self) -> None:
        """The order given to a resumed epoch is the sampler's again (its plan is made again)."""
        epoch = self._orders.resumed_epoch
        if epoch is not None:
            self._orders.resume(epoch, None)
            self._pump.forget(epoch)
        self._passes, self._passes_epoch = [], None

    # -- operations ------------------------------------------------------------------------------

    def preload(self, *, quiet: bool | None = None, timeout: float | None = None) -> PreloadSummary:
        """Start (or join) the servers' preload and wait for it, with a progress bar on stderr.

        Args:
            quiet: no progress bar (default: as the dataset was opened).
            timeout: give up after this many seconds (default: wait).

        Returns:
            what the servers hold now: state, samples, bytes, servers and how long this call waited.

        Raises:
            DatasetError: samples failed to load (named), or the timeout passed.
            StateError: the dataset was closed or has no manager.
        """
        self._check_open()
        if self._manager is None:
            raise StateError(f"dataset {self.name!r} was built without a manager connection; preload needs one")
        quiet = self._quiet if quiet is None else quiet
        started = time.monotonic()
        info = follow_preload(self._manager, self.name, out=None if quiet else sys.stderr, timeout=timeout)
        return PreloadSummary.of(info, time.monotonic() - started)

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
        return self._parts.figures()

    def server_stage_seconds(self) -> dict[str, float] | None:
        """Seconds the servers' preprocessing workers spent per stage (``"<index>:<op>"``) on this
        dataset, summed over its servers and every job using it, as their last heartbeats told the
        manager (caching it preprocessed at preload included); ``None`` when the manager cannot be asked.
        """
        if self._manager is None:
            return None
        try:
            info = self._manager.dataset(self.name)
        except KSpeedError as exc:
            log.debug("dataset %s: no server stage times: %s", self.name, exc)
            return None
        spent: dict[str, float] = {}
        for status in info.share_status:
            for stage, seconds in status.stage_seconds.items():
                spent[stage] = spent.get(stage, 0.0) + seconds
        return spent

    def server_prep_figures(self) -> dict[str, kspeed_pb2.PrepFigures]:
        """Each server's preprocessing counters now, this job's samples among them, by server id
        (a server that does not report them, or cannot be reached, is left out): what
        ``offload="auto"`` and ``kspeed analyze`` read the servers' capacity from."""
        manager = self._manager
        job = (manager.config.job if manager is not None else "") or default_job()
        return self._ask_servers("preprocessing", lambda link: link.prep_figures(job[:200]))

    def server_production_figures(self) -> dict[str, kspeed_pb2.ProductionFigures]:
        """Each server's production figures for this dataset now (its reads from the backend and
        its preprocessing per stage), by server id: what ``kspeed analyze`` reads the backend's
        rate from."""
        return self._ask_servers("production", lambda link: link.production_figures(self.name))

    def group_figures(self) -> dict[str, Any] | None:
        """What this job's group shared on the servers (docs/groups.md), summed over them, or
        ``None`` outside a group: outputs ``produced`` to be shared, positions ``shared`` (served
        an output made for another plan) and ``alone`` (made for one job alone while the group
        had others: it lagged beyond the bound), outputs ``evicted`` by the lag bound, the window
        bytes held (``kept_bytes`` for jobs that lag, within ``cap_bytes``), and ``mine``: this
        job's own produced, shared and alone positions (each position it was written is one of the three)."""
        group, member = self._feed.group.get("group"), self._feed.group.get("member")
        if not group:
            return None
        out: dict[str, Any] = {"group": group, "member": member, "members": 0}
        fields = ("produced", "shared", "alone", "evicted", "held_bytes", "kept_bytes", "cap_bytes")
        out.update(dict.fromkeys(fields, 0))
        mine = {"produced": 0, "shared": 0, "alone": 0}
        for figures in self.server_production_figures().values():
            for g in figures.groups:
                if g.group != group:
                    continue
                for name in fields:
                    out[name] += getattr(g, name)
                out["members"] = max(out["members"], g.members)
                for name, counts in (
                    ("produced", g.member_produced),
                    ("shared", g.member_shared),
                    ("alone", g.member_alone),
                ):
                    mine[name] += counts.get(str(member), 0)
        out["mine"] = mine
        return out

    def _ask_servers(self, what: str, ask: Callable[[Any], T | None]) -> dict[str, T]:
        out: dict[str, T] = {}
        for link in self._server_links():
            try:
                figures = ask(link)
            except KSpeedError as exc:
                log.debug("dataset %s: no %s figures from %s: %s", self.name, what, link.name, exc)
                continue
            if figures is not None:
                out[link.server_id] = figures
        return out

    @property
    def rail(self) -> str:
        """The rail of the receive ring."""
        return self._feed.rail

    def report_also(self, figures: Callable[[], dict[str, Any]]) -> None:
        """Add ``figures()`` to :meth:`stats` and to what the rank reports to the manager."""
        self._parts.more.append(figures)

    def offload_tuner(self) -> AutoOffload | None:
        """The self-tuned split of this rank's preprocessing (``offload="auto"``), or ``None`` when
        its split is fixed (a ratio given, no server stages, or library versions that differ)."""
        prep, pipeline = self.prep, self.pipeline
        if prep is None or not prep.adjustable or pipeline is None:
            return None
        feed = self._feed
        stage = pipeline.stages[prep.server_stages - 1]
        probed = getattr(feed.granting, "probed_rate", 0.0)
        manager = self._manager
        job = (manager.config.job if manager is not None else "") or default_job()
        model = model_signature(self._model, job, self.batch_size)
        kept = None
        if manager is not None:
            try:
                kept = manager.tuning(self.name, model)
            except KSpeedError as exc:  # the manager away: decided from scratch
                log.debug("dataset %s: no kept offload decision: %s", self.name, exc)
        ratio = prep.fraction
        if kept is not None and kept.server_stages == prep.server_stages:
            ratio = kept.ratio
            log.info(
                "dataset %s: offload starts at %.2f, as the last run with this model settled (%s)",
                self.name,
                ratio,
                kept.reason,
            )
            self._pump.resplit(ratio)  # before the first plan: it is made with this split
        return AutoOffload(
            dataset=self.name,
            links=lambda: [path.link for path in feed.paths],
            server_stages=prep.server_stages,
            nbytes=prep.nbytes,
            label=f"after {prep.server_stages - 1}:{stage.op}",
            apply=self._pump.resplit,
            ratio=ratio,
            rail_bytes_per_s=probed if probed > 0 else math.inf,
            raw_bytes=self._raw_bytes,
            keep=manager.save_tuning if manager is not None else None,
            record=lambda r, d: record_of(self.name, model, r, prep.server_stages, d),
            kept=dict(kept.rates) if kept is not None else None,
            job=job[:200],
            loop=self._parts.attribution.loop,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"dataset {self.name!r} is closed; attach it again with KSpeedClient.dataset()")

    def close(self) -> None:
        """Close the feeds, release the ring (views still held stay readable) and the lease."""
        if self._closed:
            return
        self._closed = True
        self._parts.close()
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
        attribution = self._ds._parts.attribution  # (the time in here is the rank's data wait)
        attribution.enter()
        try:
            batch = self._advance()
        except StopIteration:
            attribution.leave(0)
            attribution.forget_step()  # until the next epoch's first batch is no training step
            raise
        except BaseException:
            attribution.leave(0)
            raise
        attribution.leave(len(batch.ids))
        return batch

    def _advance(self) -> Batch:
        ds = self._ds
        if ds._closed:
            raise StateError(f"dataset {ds.name!r} was closed during iteration")
        if self._token != ds._iterations:
            raise StateError(f"dataset {ds.name!r}: this iterator was superseded by a newer iter() of the dataset")
        if self._next >= self._plan.num_batches:
            raise StopIteration
        batch = ds._pump.next_batch(self._plan, self._next)
        lo, hi = int(self._plan.layout.starts[self._next]), int(self._plan.layout.starts[self._next + 1])
        paths = ds._pump.feed.paths
        ds._stats.record(
            ds._pump.last_wait_s,
            self._plan.owner[lo:hi],
            self._plan.lengths[lo:hi],
            [p.link.server_id for p in paths] if ds._pump.feed.counters["replaced_servers"] else None,
        )
        self._next += 1
        ds._consumed = self._next
        if ds._live_here:
            ds.keep_position(self._next)
        return batch
