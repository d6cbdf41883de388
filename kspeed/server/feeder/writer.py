"""One feed in a feeder process: the thread that answers a client's grants when their samples are ready.

A grant names plan positions (docs/feeding.md). Each owned position has a location the main process
keeps current (:mod:`kspeed.server.production.core`): a pool region and offset (the sample's home,
or a slot of the production window), or none yet. A grant whose samples all have one is written at
once, up to :data:`GRANTS_PER_WRITE` grants with one vectorized write per region, the last op of
each carrying the grant's tag; a grant that needs a sample not produced yet waits (grants behind it
that are ready do not), until ``production_timeout`` seconds pass in which no grant of the feed was
written (a grant queued behind its feed's earlier ones waits its turn while they are served), after
which the client gets an ERROR naming the sample; a sample whose production failed fails its grants
at once with the reason. What was written is reported to the main process (window slots are
reclaimed from those reports), with how long grants waited, and so are positions granted a second
time (the client fenced a server and grants again what it had not delivered): production then holds
them, or makes them resident again, for the new grant. A plan the client truncated (it re-split the
rest into a new pass) is served up to the batch it named; a grant of a batch from there on is
refused, like one of an epoch with no plan, and production is told to produce nothing more for
them.

Before a write, every sample whose crc32c the main process gave with its place (a stored sample,
at home or in the window as the backend's bytes) is checked against it, per write of up to
:data:`GRANTS_PER_WRITE` grants: a sample at home the first time this feeder writes it from there
(``verify_served: first``; from then on only the server can write the pool: its files are the
server's alone, its feeders map it read-only and its preprocessing workers never map it), or at
every write (``always``: it costs about a second copy of the bytes); a window copy, made for the
plans moments before, at every write. A sample whose bytes changed in memory is never written: its
grants wait, it counts as not resident here, and the main process is told
(:class:`~kspeed.server.feeder.protocol.Corrupt`); it re-reads the sample from the backend and tells
its place again. What a feeder reports is defined in :mod:`kspeed.server.feeder.protocol`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kspeed import grants
from kspeed.errors import KSpeedError, PeerLostError
from kspeed.rdma.base import RegionKey, Writer
from kspeed.server.feeder.doorbell import Doorbell
from kspeed.server.feeder.plan_part import PlanPart
from kspeed.server.feeder.protocol import Corrupt, Event, FeedGone, FeedProgress, Freed
from kspeed.server.memory.checksum import crc32c
from kspeed.server.memory.flags import Flags
from kspeed.server.memory.pool import map_region

__all__ = ["FeedWriter", "FeederShared", "PlanPart"]

log = logging.getLogger(__name__)

CLOSE_GRACE = 2.0  # seconds a closed feed's thread has to finish before its I/O is interrupted
WAIT_POLL = 0.002  # a grant waiting longer than this for its samples counts as held (reported to the client)
#: Longest a feed with waiting grants sleeps: it is woken when a command moves samples or a message
#: arrives, so this only bounds how late it notices what changes without a command.
PENDING_WAIT = 0.05
# epoch plans a feed keeps: the current pass, its re-split tail (a new pass from a later batch), the
# next epoch's plan and a spare
MAX_PLANS = 4
GRANTS_PER_WRITE = 8  # grants served by one write: fewer calls, yet the first tags are not held back long
REPORT_EVERY = 0.02  # seconds between progress reports to the main process (at most)
RESCAN_EVERY = 0.25  # waiting grants are looked at again this often even when no sample moved
HEAD_GRANTS = 16  # when samples moved, the oldest waiting grants looked at


@dataclass(slots=True)
class _Waiting:
    """A grant not written yet: when it arrived, and the owned positions ``i:j`` of ``plan`` it covers
    (``plan`` None until its plan is here)."""

    grant: np.void
    arrival: float
    plan: PlanPart | None = None
    i: int = 0
    j: int = 0


@functools.cache
def _filler() -> np.ndarray:
    """What probes write (allocated by the first probe)."""
    return np.zeros(grants.MAX_PROBE, dtype=np.uint8)


class RegionMaps:
    """Read-only numpy views of the pool's region files, mapped once when a plan first names them."""

    def __init__(self) -> None:
        self._arrays: dict[int, np.ndarray] = {}

    def add(self, paths: dict[int, str]) -> None:
        """Map the regions of ``paths`` (pool index -> file) not mapped yet."""
        for index, path in paths.items():
            if index not in self._arrays:
                self._arrays[index] = np.frombuffer(map_region(path), dtype=np.uint8)

    def get(self, index: int) -> np.ndarray:
        return self._arrays[index]


class FeederShared:
    """What the feeds of one feeder process share with its command loop: one lock over every plan's
    locations, the reads in progress per window ticket, failed samples, the event pipe, and the
    doorbell idle feeds wait on."""

    def __init__(self, send_event: Callable[[Event], object], *, recheck: bool = False) -> None:
        self.lock = threading.Lock()
        self.recheck = recheck  # check a sample at home at every write, not only the first
        self._checked: dict[str, Flags] = {}  # per dataset, by sample ID: checked at home since placed there
        self.placements = 0  # bumped when a sample gets a new place: a check begun before proves nothing of it
        self.in_use: dict[int, int] = {}
        self.draining: set[int] = set()  # tickets to report freed once no read uses them
        self.failed: dict[str, dict[int, str]] = {}  # per dataset, samples whose production failed
        self._send = send_event
        self._send_lock = threading.Lock()
        self.doorbell = Doorbell()

    def checked(self, dataset: str, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` were checked at home since they were placed there (all False with ``recheck``)."""
        seen = self._checked.get(dataset)
        if self.recheck or seen is None:
            return np.zeros(len(ids), dtype=bool)
        inside = ids < len(seen)
        out = np.zeros(len(ids), dtype=bool)
        out[inside] = seen[ids[inside]]
        return out

    def mark_checked(self, dataset: str, ids: np.ndarray, since: int) -> None:
        """Samples ``ids`` passed their check at home, begun when :attr:`placements` was ``since``
        (if a sample was placed anew meanwhile, nothing is marked: the next write checks again)."""
        if self.recheck or not len(ids) or since != self.placements:
            return
        seen = self._checked.get(dataset)
        top = int(ids.max()) + 1
        if seen is None or len(seen) < top:
            grown = Flags(max(top, 2 * len(seen) if seen is not None else top))
            if seen is not None:
                grown.bits[: len(seen.bits)] = seen.bits
            seen = self._checked[dataset] = grown
        seen.set(ids)

    def unchecked(self, dataset: str, ids: np.ndarray) -> None:
        """Samples ``ids`` have a new place, or new bytes at their place: their next write checks them."""
        self.placements += 1
        seen = self._checked.get(dataset)
        if seen is not None:
            ids = np.asarray(ids, dtype=np.int64)
            seen.set(ids[ids < len(seen)], False)

    def send(self, event: Event) -> None:
        """Report ``event`` to the main process (nothing, once the pipe is closed)."""
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._send(event)

    def hold(self, tickets: np.ndarray) -> None:
        for t in tickets.tolist():
            self.in_use[t] = self.in_use.get(t, 0) + 1

    def let_go(self, tickets: np.ndarray) -> list[int]:
        """Drop reads of ``tickets``; returns those now free to reuse (no read left, and retired)."""
        freed = []
        for t in tickets.tolist():
            left = self.in_use.get(t, 0) - 1
            if left > 0:
                self.in_use[t] = left
                continue
            self.in_use.pop(t, None)
            if t in self.draining:
                self.draining.discard(t)
                freed.append(t)
        return freed

    def retire(self, tickets: list[int]) -> list[int]:
        """Tickets no longer located anywhere: those still being read are reported later; returns them."""
        busy = [t for t in tickets if self.in_use.get(t, 0) > 0]
        self.draining.update(busy)
        return busy


class FeedWriter:
    """One client's data-plane path and the thread that serves its grants."""

    def __init__(
        self,
        feed_id: str,
        dataset: str,
        writer: Writer,
        key: RegionKey,
        regions: RegionMaps,
        shared: FeederShared,
        *,
        production_timeout: float = 60.0,
        generation: int = 0,
    ) -> None:
        self.feed_id = feed_id
        self.generation = generation  # the client's connection generation this feed serves
        self.dataset = dataset
        self.changed: dict[int, str] = {}  # samples whose backend file changed since listing: never served
        self._changed_ids = np.zeros(0, dtype=np.int64)
        self.writer = writer
        self.key = key
        self.regions = regions
        self.shared = shared
        self.production_timeout = production_timeout
        self.plans: dict[int, PlanPart] = {}
        self.served = 0
        self._pending: deque[_Waiting] = deque()  # grants not written yet, in arrival order
        self._written: list[tuple[int, int, int, int]] = []
        self._waited: list[float] = []
        self._again: list[tuple[int, np.ndarray]] = []
        self._dropped: list[int] = []
        self._truncated: list[tuple[int, int]] = []
        self._last_report = time.monotonic()
        self._last_waiting = 0
        # when a grant of this feed was last written (or the feed opened): production_timeout counts
        # from here, not from a grant's arrival (a client grants far ahead: a grant behind its
        # feed's earlier ones waits its turn, as long as the feed moves)
        self._progressed = time.monotonic()
        self._reason = ""
        self.moves = 0  # bumped by every command that may make this feed's waiting grants ready
        self._awaiting_moves = False  # asleep in _sleep_pending: a move rings the bell
        self._seen_moves = -1
        self._last_scan = 0.0
        self._stop = threading.Event()
        self._bell = threading.Event()  # set by the doorbell (the connection is readable) or by close()
        self._fd = writer.fileno()
        self._thread = threading.Thread(target=self._run, name=f"feed-{feed_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def moved(self) -> None:
        """A command may have made this feed's waiting grants ready (a place of its plan, a location,
        a failure of its dataset): they are looked at again now, not at the next poll. Only the
        feeds a command concerns are woken: waking every feed of the feeder for every command cost
        each feed a scan per other feed's placement, a feeder's CPU growing with the square of its feeds.
        A feed with no grants waiting is not woken (it sleeps until its connection has something)."""
        self.moves += 1
        if self._awaiting_moves:
            self._bell.set()

    def mark_changed(self, what: dict[int, str]) -> None:
        """Refuse from now on the grants that need these samples (ID -> what changed)."""
        self.changed = {**self.changed, **what}
        self._changed_ids = np.array(sorted(self.changed), dtype=np.int64)

    def install(self, epoch: int, plan: PlanPart) -> list[int]:
        """Add an epoch plan (dropping the oldest beyond :data:`MAX_PLANS`); returns the epochs dropped."""
        self.plans[epoch] = plan
        dropped = sorted(self.plans)[:-MAX_PLANS]
        for old in dropped:
            self.plans.pop(old, None)
        return dropped

    # -- the feed thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                unreported = (
                    self._written
                    or self._waited
                    or self._again
                    or self._dropped
                    or self._truncated
                    or len(self._pending) != self._last_waiting
                )
                if self._pending:
                    message = self.writer.recv(0)
                    if message is None and self.moves == self._seen_moves:
                        due = REPORT_EVERY - (time.monotonic() - self._last_report) if unreported else PENDING_WAIT
                        self._sleep_pending(min(max(due, 0.001), PENDING_WAIT))
                        message = self.writer.recv(0)
                elif unreported:
                    message = self.writer.recv(REPORT_EVERY)
                else:
                    message = self.writer.recv(0)
                    if message is None:
                        self._idle()
                        continue
                arrived = []
                if message is not None:
                    decoded = grants.decode(message)
                    if isinstance(decoded, np.ndarray):
                        arrived = self._note(decoded, time.monotonic())
                        self._pending.extend(arrived)
                    elif isinstance(decoded, grants.DropPlan):
                        with self.shared.lock:  # the feeder's commands walk the plans under it
                            self.plans.pop(decoded.epoch, None)
                        self._dropped.append(decoded.epoch)
                    elif isinstance(decoded, grants.TruncatePlan):
                        self._truncate(decoded.epoch, decoded.batch)
                if self._pending:
                    look = self._worth_a_scan(message is not None and not arrived, len(arrived))
                    if look:
                        self._serve_pending(None if look == "all" else HEAD_GRANTS, len(arrived))
                self._report()
        except PeerLostError as exc:
            log.info("feed %s: client gone (%s)", self.feed_id, exc)
            gone = f"its client is gone ({exc})"
        except KSpeedError as exc:
            log.warning("feed %s: closed after error: %s", self.feed_id, exc)
            gone = f"it failed: {exc}"
        else:
            gone = ""
        finally:
            self._report(force=True)
            self.shared.doorbell.forget(self._fd)
            with contextlib.suppress(KSpeedError):
                if self._reason:  # the feed ends for good: the client learns why before the connection goes
                    self.writer.send(grants.encode_closing(grants.Closing(self._reason)))
                self.writer.close()
        if gone and not self._stop.is_set():  # ended by the client's side, not closed here: reclaim it
            self.shared.send(FeedGone(self.feed_id, self.generation, gone))

    def _truncate(self, epoch: int, batch: int) -> None:
        """The client grants the plan of ``epoch`` no more from ``batch`` on: its grants of those
        batches are refused from now on, and production stops producing them."""
        with self.shared.lock:  # the feeder's commands walk the plans under it
            plan = self.plans.get(epoch)
            if plan is not None:
                plan.truncate(batch)
        self._truncated.append((epoch, batch))

    def _sleep_pending(self, timeout: float) -> None:
        """Sleep while grants wait, until samples move (a command), a message arrives, the feed is
        closed, or ``timeout`` passes (a feed woke every 2 ms before: a third of a feeder's CPU per
        offloaded sample while production was the bottleneck)."""
        self._bell.clear()
        self.shared.doorbell.watch(self._fd, self._bell)
        self._awaiting_moves = True  # (before the check: a move after it rings the bell, see moved())
        try:
            if not self._stop.is_set() and self.moves == self._seen_moves:
                self._bell.wait(timeout)
        finally:
            self._awaiting_moves = False

    def _idle(self) -> None:
        """Sleep until the connection is readable or the feed is closed (nothing to serve, nothing
        to report: no reason to wake before)."""
        self._bell.clear()
        self.shared.doorbell.watch(self._fd, self._bell)
        if not self._stop.is_set():  # (close() sets the stop before the bell: a ring is never lost)
            self._bell.wait()

    def _worth_a_scan(self, other: bool, granted: int) -> str:
        """How much of the waiting grants to look at: ``"all"`` every :data:`RESCAN_EVERY` (what
        became hopeless) or when a message other than grants arrived (a plan dropped or cut),
        ``"head"`` when samples moved or grants arrived (those are looked at too), ``""``
        otherwise. Looking only then keeps a feed whose grants wait on production from burning
        the server's CPU. (Every arrival once looked at all of them: a client grants up to an
        epoch ahead, and its feeder spent more on looking than on writing.)"""
        now = time.monotonic()
        moves = self.moves
        if other or now - self._last_scan > RESCAN_EVERY:
            self._seen_moves, self._last_scan = moves, now
            return "all"
        if granted or moves != self._seen_moves:
            self._seen_moves = moves
            return "head"
        return ""

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        waiting = len(self._pending)
        changed = (
            self._written
            or self._waited
            or self._again
            or self._dropped
            or self._truncated
            or waiting != self._last_waiting
        )
        if not changed or (not force and now - self._last_report < REPORT_EVERY and len(self._written) < 256):
            return
        written = np.array(self._written, dtype=np.int64).reshape(-1, 4)
        progress = FeedProgress(
            self.feed_id,
            written,
            waiting,
            tuple(self._waited),
            tuple(self._again),
            tuple(self._dropped),
            tuple(self._truncated),
        )
        self.shared.send(progress)
        self._written, self._waited, self._again, self._dropped, self._truncated = [], [], [], [], []
        self._last_report, self._last_waiting = now, waiting

    def _note(self, rows: np.ndarray, now: float) -> list[_Waiting]:
        """Record the positions newly arrived grants ask for; those a grant asked for before are
        reported as granted again (a client that fenced a server grants again every batch it has
        not delivered, on every server: production must make them resident once more). Returns
        the grants to wait, with the positions they cover where their plan is here."""
        arrived = []
        for grant in rows:
            entry = _Waiting(grant, now)
            arrived.append(entry)
            plan = self.plans.get(int(grant["epoch"]))
            index = int(grant["batch"])
            if plan is None or not 0 <= index < plan.batches:  # (a probe, or refused when served)
                continue
            entry.plan = plan
            entry.i, entry.j = plan.span(index, int(grant["first"]), int(grant["end"]))
            again = plan.grant(entry.i, entry.j)
            if len(again):
                self._again.append((int(grant["epoch"]), again))
        return arrived

    def _serve_pending(self, head: int | None = None, tail: int = 0) -> None:
        """Write every pending grant whose samples are ready (in arrival order); fail the hopeless.

        With ``head``, only the first ``head`` pending grants (and the next ``head`` as long as
        none of the last ones still waits) and the last ``tail`` (those just arrived) are looked
        at: samples are produced in plan order, so when some moved it is the oldest grants that
        became ready; the others keep their place for the next full look.
        """
        now = time.monotonic()
        ready: list[tuple[np.void, PlanPart | None, int, int]] = []
        held: list[tuple[int, float]] = []
        pending = self._pending
        if head is None or len(pending) <= head + tail:
            keep = self._look(pending, now, ready, held, full=head is None)
        else:  # the head, and the next as long as all of the last one went
            end, start = len(pending) - tail, 0
            keep = deque()
            while start < end:
                stop = min(start + head, end)
                kept = self._look(itertools.islice(pending, start, stop), now, ready, held, full=False)
                keep.extend(kept)
                start = stop
                if kept:
                    break
            keep.extend(itertools.islice(pending, start, end))
            keep.extend(self._look(itertools.islice(pending, end, None), now, ready, held, full=False))
        self._pending = keep
        if held:  # before the writes: the client's pacing must not take these waits for the path's latency
            tags, seconds = zip(*held, strict=True)
            self.writer.send(grants.encode_held(tags, seconds))
        for start in range(0, len(ready), GRANTS_PER_WRITE):
            self._write(ready[start : start + GRANTS_PER_WRITE])

    def _look(
        self,
        entries: Iterable[_Waiting],
        now: float,
        ready: list[tuple[np.void, PlanPart | None, int, int]],
        held: list[tuple[int, float]],
        *,
        full: bool,
    ) -> deque[_Waiting]:
        """Sort waiting grants: the ready ones into ``ready`` (those that waited into ``held``),
        the hopeless refused; returns those still to wait. A grant with a sample changed at the
        backend is refused at once; whether one still waiting is hopeless is asked only when it
        may be (:meth:`_may_be_hopeless`)."""
        keep: deque[_Waiting] = deque()
        for entry in entries:
            grant, arrival = entry.grant, entry.arrival
            epoch, index, tag = int(grant["epoch"]), int(grant["batch"]), int(grant["tag"])
            if epoch == grants.PROBE_EPOCH:
                self._probe(grant)
                continue
            plan = self.plans.get(epoch)
            if plan is None or index >= plan.batches:
                if plan is None:
                    why = f"no plan for epoch {epoch}"
                elif index < len(plan.starts) - 1:
                    why = f"epoch {epoch} was truncated at batch {plan.cut}: batch {index} is no longer granted"
                else:
                    why = f"epoch {epoch} has no batch {index}"
                self._refuse(epoch, index, tag, why)
                continue
            if entry.plan is not plan:  # (the span is found once per plan: a grant is looked at often)
                entry.plan = plan
                entry.i, entry.j = plan.span(index, int(grant["first"]), int(grant["end"]))
            i, j = entry.i, entry.j
            absent = plan.region[i:j] < 0
            waits = bool(absent.any())
            if (waits and self._may_be_hopeless(plan, full, now)) or len(self._changed_ids):
                why, sample = self._hopeless(plan, i, j, absent, now - max(arrival, self._progressed))
                if why:
                    self._refuse(epoch, index, tag, why, sample)
                    continue
            if waits:
                keep.append(entry)
                continue
            if now - arrival > WAIT_POLL:
                self._waited.append(now - arrival)
                held.append((tag, now - arrival))
            ready.append((grant, plan, i, j))
        return keep

    def _may_be_hopeless(self, plan: PlanPart, full: bool, now: float) -> bool:
        """Whether a waiting grant of ``plan`` may be hopeless: its plan has failed positions, or,
        on a ``full`` look (every :data:`RESCAN_EVERY`), its dataset has samples that could not be
        read or the feed wrote nothing for ``production_timeout``. Asking every waiting grant at
        every full look took most of a feed's CPU while production was the bottleneck (a client
        grants up to an epoch ahead)."""
        if plan.failures:
            return True
        return full and (bool(self.shared.failed.get(self.dataset)) or now - self._progressed > self.production_timeout)

    def _hopeless(self, plan: PlanPart, i: int, j: int, absent: np.ndarray, stalled: float) -> tuple[str, int]:
        """Why a grant of positions ``i:j`` can never be served and the sample at fault, or ``("", -1)``;
        ``absent``: which of them are not where the feed can write them from; ``stalled``: seconds
        it has waited with no grant of the feed written meanwhile."""
        ids = plan.ids[i:j]
        if len(self._changed_ids):
            hit = np.flatnonzero(np.isin(ids, self._changed_ids))
            if len(hit):
                sample = int(ids[hit[0]])
                why = f"dataset {self.dataset!r} sample {sample}: {self.changed[sample]}; its cached bytes are stale"
                return why, sample
        if not absent.any():
            return "", -1
        absent = absent.copy()
        if plan.failures:  # processed positions of this plan whose server stages failed
            for k in np.flatnonzero(absent).tolist():
                if i + k in plan.failures:
                    return plan.failures[i + k], int(ids[k])
        if plan.processed is not None:
            absent &= ~plan.processed[i:j]
        missing = ids[absent]
        failed = self.shared.failed.get(self.dataset)
        if failed:
            for sample in missing.tolist():
                if sample in failed:
                    return f"dataset {self.dataset!r} sample {sample} could not be produced: {failed[sample]}", sample
        if stalled > self.production_timeout:
            late = int(missing[0]) if len(missing) else int(ids[np.flatnonzero(plan.region[i:j] < 0)[0]])
            why = (
                f"dataset {self.dataset!r} sample {late} was not produced within "
                f"{self.production_timeout:g}s (the server is still reading it from the backend, or preprocessing it)"
            )
            return why, late
        return "", -1

    def _refuse(self, epoch: int, index: int, tag: int, why: str, sample: int = -1) -> None:
        self.writer.send(grants.encode_error(grants.GrantError(epoch, index, tag, why, sample)))

    def _probe(self, grant: np.void) -> None:
        """Write filler of the probed size (docs/feeding.md, Pacing); a bad size is an ERROR, named."""
        nbytes, tag = int(grant["end"]), int(grant["tag"])
        if not 0 < nbytes <= grants.MAX_PROBE:
            self._refuse(grants.PROBE_EPOCH, 0, tag, f"probe of {nbytes} bytes is outside 1..{grants.MAX_PROBE}")
            return
        self.writer.write_batch(
            self.key,
            _filler(),
            np.zeros(1, np.int64),
            np.array([nbytes], np.int64),
            np.array([int(grant["ring_offset"])], np.int64),
            imms=[tag],
        )

    def _write(self, ready: list[tuple[np.void, PlanPart | None, int, int]]) -> None:
        """Serve ready grants with one vectorized write per pool region; their tags follow the bytes.
        A grant with a sample whose bytes fail their check waits (see :meth:`_withhold`)."""
        parts, tags, served, checks = [], [], [], []
        with self.shared.lock:  # a consistent snapshot of the locations, and the window slots held
            for grant, plan, i, j in ready:
                assert plan is not None
                if (plan.region[i:j] < 0).any():  # moved away since it was found ready: wait again
                    self._pending.appendleft(_Waiting(grant, time.monotonic(), plan, i, j))
                    continue
                served.append(grant)
                parts.append(  # (int64 copies of the plan's compact columns)
                    (
                        plan.region[i:j].astype(np.int64),
                        plan.src[i:j].astype(np.int64),
                        plan.length[i:j].astype(np.int64),
                        plan.dst[i:j].astype(np.int64) + int(grant["ring_offset"]),
                        plan.ticket[i:j].astype(np.int64),
                    )
                )
                checks.append((plan.ids[i:j].astype(np.int64), None if plan.crc is None else plan.crc[i:j].copy()))
                tags.append(int(grant["tag"]))
            if not parts:
                return
            held = np.concatenate([part[4] for part in parts])
            held = held[held > 0]
            self.shared.hold(held)
        try:
            # (the window slots are held: none is reused while its bytes are checked and written)
            spoiled = self._check(parts, checks)
            if spoiled:
                keep = [n for n in range(len(parts)) if n not in spoiled]
                for n in sorted(spoiled, reverse=True):
                    self._pending.appendleft(_Waiting(served[n], time.monotonic()))
                parts, tags, served = [parts[n] for n in keep], [tags[n] for n in keep], [served[n] for n in keep]
                if not parts:
                    return
            region, src_at, nbytes, dst_at, _ = (np.concatenate(a) for a in zip(*parts, strict=True))
            groups = np.unique(region)
            if len(groups) == 0:  # nothing of ours in these ranges: still exactly one completion each
                self.writer.write_batch(self.key, b"", src_at, nbytes, dst_at, imms=tags)
            for n, r in enumerate(groups.tolist()):
                mask = region == r if len(groups) > 1 else slice(None)
                self.writer.write_batch(
                    self.key,
                    self.regions.get(r),
                    src_at[mask],
                    nbytes[mask],
                    dst_at[mask],
                    imms=tags if n == len(groups) - 1 else None,
                )
        finally:
            with self.shared.lock:
                freed = self.shared.let_go(held)
            if freed:
                self.shared.send(Freed(tuple(freed)))
        self.served += len(tags)
        self._progressed = time.monotonic()
        for grant in served:
            self._written.append((int(grant["epoch"]), int(grant["batch"]), int(grant["first"]), int(grant["end"])))

    def _check(
        self,
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        checks: list[tuple[np.ndarray, np.ndarray | None]],
    ) -> set[int]:
        """Check each sample of the parts that has a crc32c to match where it is; the parts (grants)
        with a sample that fails, whose samples are withheld. One loop over the write's samples,
        a C call each (:func:`~kspeed.server.memory.checksum.crc32c`)."""
        if all(crc is None for _, crc in checks):
            return set()
        crc = np.concatenate([c if c is not None else np.full(len(ids), -1) for ids, c in checks])
        ids = np.concatenate([ids for ids, _ in checks])
        home = np.concatenate([part[4] for part in parts]) == 0
        with self.shared.lock:
            done = home & self.shared.checked(self.dataset, ids)
            since = self.shared.placements
        want = np.flatnonzero((crc >= 0) & ~done)
        if not len(want):
            return set()
        region, src, length = (np.concatenate([part[k] for part in parts])[want] for k in range(3))
        arrays = self.regions.get
        bad = [
            k
            for k, r, at, n, c in zip(want.tolist(), region.tolist(), src.tolist(), length.tolist(), crc[want].tolist())
            if crc32c(arrays(r)[at : at + n]) != c
        ]
        good = np.setdiff1d(want[home[want]], np.asarray(bad, dtype=np.int64))
        with self.shared.lock:
            self.shared.mark_checked(self.dataset, ids[good], since)
        if not bad:
            return set()
        owner = np.repeat(np.arange(len(parts)), [len(ids) for ids, _ in checks])
        self._withhold(np.unique(ids[bad]))
        return set(owner[bad].tolist())

    def _withhold(self, ids: np.ndarray) -> None:
        """Samples whose bytes changed in memory: not resident here until production places them
        again (it re-reads them from the backend); their grants wait meanwhile."""
        log.warning(
            "feed %s: dataset %s sample(s) %s fail their crc32c check; re-read", self.feed_id, self.dataset, ids[:8]
        )
        with self.shared.lock:
            for plan in self.plans.values():
                at, _ = plan.where(ids)
                if plan.processed is not None:
                    at = at[~plan.processed[at]]
                plan.region[at] = -1
        self.shared.send(Corrupt(self.feed_id, tuple(ids.tolist())))

    def close(self, reason: str = "") -> None:
        """Stop serving; with a ``reason``, tell the client why first (it ends the feed with that).

        The serving thread closes the writer itself (no write of it can meet released memory); a
        thread blocked on a stalled client is interrupted after a short grace.
        """
        self._reason = reason  # sent by the serving thread itself, never beside one of its writes
        self._stop.set()
        self._bell.set()
        self._thread.join(timeout=CLOSE_GRACE)
        if self._thread.is_alive():
            self.writer.interrupt()
            self._thread.join(timeout=CLOSE_GRACE)
        if self._thread.is_alive():
            log.warning("feed %s: serving thread still busy after close; it closes the writer when done", self.feed_id)
