"""Production's side of shared preparation (:mod:`kspeed.server.production.groups`): processed
positions of a group member's plan are placed at the group's outputs, made once for every member
that will need them, and released once each of those was written them or the lag bound let them go.

:class:`SharedProduction` is the part of :class:`kspeed.server.production.core.Production` that
does this; it uses its lock, window, feeds and feeder commands, and everything here runs under the lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kspeed.errors import ConflictError, KSpeedError
from kspeed.proto import kspeed_pb2
from kspeed.server.feeder.protocol import Command, Place, Reply
from kspeed.server.memory.residency import ABSENT, FAILED, READING, WINDOW
from kspeed.server.memory.window import ProductionWindow, Slot
from kspeed.server.production.groups import (
    NARROW_BATCHES,
    PEER,
    SAMPLES,
    GroupState,
    Membership,
    Output,
    OutputKey,
    Use,
)
from kspeed.server.production.state import Draining, FeedState, PlanState, PrepSpec, ShareState

__all__ = ["SharedProduction"]

log = logging.getLogger(__name__)

ShareKey = tuple[str, int]


def signature(prep: PrepSpec) -> tuple[int, int, bool, int]:
    """What, beside the seed and the epoch, decides a processed output's bytes (the pipeline is the dataset's)."""
    return prep.stages, prep.start, prep.skip, prep.nbytes


class SharedProduction:
    """Group members' processed positions, placed at shared outputs."""

    window: ProductionWindow
    _lock: threading.RLock
    _tell: Callable[[int, Command], Reply]
    _feeds: dict[str, FeedState]
    _draining: dict[int, Draining]
    _groups: dict[tuple[ShareKey, str], GroupState]
    _output_tickets: dict[int, Output]

    # -- members ---------------------------------------------------------------------------------

    def _join(
        self, share: ShareState, feed_id: str, membership: Membership, prep: PrepSpec | None, dataset_size: int
    ) -> None:
        """Before a plan of ``feed_id`` is followed: a samples-mode member joins its group here.

        Raises:
            ConflictError: the plan's server stages draw from another seed than the group's.
        """
        if membership.share != SAMPLES:
            return
        key = (share.key, membership.group)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = GroupState(membership.group, share.size, dataset_size)
        if prep is not None:
            if group.seed is not None and group.seed != prep.seed and set(group.members) - {membership.member}:
                raise ConflictError(
                    f"group {membership.group!r} shares the samples of dataset {share.dataset!r} drawn with seed "
                    f"{group.seed}; this job's plan draws from seed {prep.seed}: give every job of a group with "
                    "share='samples' the same seed, or use share='decoded' for augmentations of its own"
                )
            group.seed = prep.seed
        if membership.member not in group.members:  # a new member will want what is made (bounded: kept)
            for output in group.outputs.values():
                output.waiting.add(membership.member)
        group.join(membership.member, feed_id, membership.lag)

    def _group_of(self, feed: FeedState) -> GroupState | None:
        m = feed.membership
        if m is None or m.share != SAMPLES:
            return None
        return self._groups.get((feed.share, m.group))

    def _leave(self, feed: FeedState) -> None:
        """A member's feed closed: a member with none left here is waited for no more."""
        group = self._group_of(feed)
        if group is None or feed.membership is None:
            return
        if group.leave(feed.membership.member, feed.feed_id):
            for output in list(group.outputs.values()):
                output.waiting.discard(feed.membership.member)
                self._settle_output(group, output)
        if not group.members:
            for output in list(group.outputs.values()):
                self._free_output(group, output)
            self._groups.pop((feed.share, feed.membership.group), None)
            self.window.forget(group.owner)

    def _drop_groups(self, key: ShareKey) -> None:
        """The share is dropped: its groups' outputs go."""
        for gk in [gk for gk in self._groups if gk[0] == key]:
            group = self._groups.pop(gk)
            for output in list(group.outputs.values()):
                self._free_output(group, output)
            self.window.forget(group.owner)

    # -- sharing out -----------------------------------------------------------------------------

    def _share_out(
        self, share: ShareState, feed: FeedState, plan: PlanState, at: np.ndarray, *, hold: bool = False
    ) -> tuple[np.ndarray, list[OutputKey | None]]:
        """Of processed positions ``at`` of ``feed``'s plan (not made, not written): place those
        whose group output is made, have those whose output is being made wait for it, and return
        the rest, to make as outputs of the group (their keys; None outside a group); with
        ``hold`` (the member leads a peer by more than the bound: :meth:`_ahead_of_peers`), none."""
        group = self._group_of(feed)
        if group is None or plan.prep is None or plan.state is None or feed.membership is None:
            return at, [None] * len(at)
        sig = signature(plan.prep)
        member = feed.membership.member
        rest: list[tuple[int, int]] = []
        placed: list[tuple[int, Slot]] = []
        for k, sample in zip(at.tolist(), plan.ids[at].tolist(), strict=True):
            key: OutputKey = (sig, plan.user_epoch, sample)
            output = group.outputs.get(key)
            if output is None:
                rest.append((k, sample))
                continue
            self._add_use(output, feed, (feed.feed_id, plan.epoch, k))
            group.unkeep(output)
            plan.shared[k] = key
            group.figures.count(member, shared=1)
            if output.slot is None:
                plan.state[k] = READING
            else:
                plan.state[k] = WINDOW
                plan.slots[k] = output.slot
                placed.append((k, output.slot))
        make: list[int] = []
        keys: list[OutputKey | None] = []
        # Made as an output even when no other member is to need it (one that joins while it is
        # placed here finds it); it is held only while a member waits for it. Made while every
        # other member is past it, it is this member's alone: it lags behind them.
        if rest and not hold:
            others = [m for m in group.members if m != member]
            ids = np.array([sample for _, sample in rest], dtype=np.int64)
            bound = group.bound(self.window.capacity, plan.prep.nbytes)
            if not group.narrow:
                self._warn_narrow(share, group, member, plan, bound)
            ahead = np.array([k for k, _ in rest], dtype=np.int64) - plan.next  # (made ahead of where it reads)
            wanted = self._wanted(others, group, sig, plan.user_epoch, ids, bound, ahead, plan.next)
            for (k, sample), wanting in zip(rest, wanted, strict=True):
                key = (sig, plan.user_epoch, sample)
                output = group.outputs[key] = Output(key, plan.prep.nbytes, wanting | {member})
                self._add_use(output, feed, (feed.feed_id, plan.epoch, k))
                plan.shared[k] = key
                make.append(k)
                keys.append(key)
                group.figures.count(member, **({"alone": 1} if others and not wanting else {"produced": 1}))
        if placed:
            self._place_at(feed, plan, placed)
        return np.array(make, dtype=np.int64), keys

    def _with_outputs(self, feed: FeedState, plan: PlanState, at: np.ndarray) -> np.ndarray:
        """Of processed positions ``at`` of ``feed``'s plan, those whose group output exists (made
        or being made). A member held back (:meth:`_held`) looks at no more: it used to pass its
        whole depth through :meth:`_share_out` at every look for work (four members over three
        epochs of 1024 samples made 42,820 calls of it, where 1,149 do now)."""
        group = self._group_of(feed)
        if group is None or plan.prep is None or not len(at):
            return at
        sig, epoch, outputs = signature(plan.prep), plan.user_epoch, group.outputs
        exists = [(sig, epoch, sample) in outputs for sample in plan.ids[at].tolist()]
        return at[np.array(exists, dtype=bool)]

    def _warn_narrow(self, share: ShareState, group: GroupState, member: str, plan: PlanState, bound: int) -> None:
        """Warn once per group when its lag bound is under two of ``member``'s batches: the group
        then shares little (measured: four jobs made 2.15x one job's outputs, docs/groups.md)."""
        # (every batch but a plan's last holds its batch size: the first two say it, with no pass
        # over all of its batches at each task made)
        batch = int(np.diff(plan.starts[:3]).max()) if len(plan.starts) > 1 else 0
        if not group.narrow_for(bound, batch):
            return
        group.narrow = True
        log.warning(
            "dataset %s, group %s: its lag bound (%d samples here, outputs of %d bytes in a production window "
            "of %d bytes) is under %d of member %s's batches of %d samples: members a batch apart are served "
            "alone and their outputs made again; give the server a larger production_window, or the jobs a "
            "larger group_lag (up to half the window)",
            share.dataset,
            group.name,
            bound,
            plan.prep.nbytes if plan.prep is not None else 0,
            self.window.capacity,
            NARROW_BATCHES,
            member,
            batch,
        )

    def _held(self, feed: FeedState, plan: PlanState) -> bool:
        """Whether ``feed``'s member makes nothing for now: it leads a peer by more than the bound."""
        group = self._group_of(feed)
        if group is None or feed.membership is None:
            return False
        return self._ahead_of_peers(group, feed.membership.member, plan)

    def _ahead_of_peers(self, group: GroupState, member: str, plan: PlanState) -> bool:
        """Whether ``member`` (reading ``plan``) leads another member by more than the lag bound
        while that one is a **peer**: written lately, at least :data:`PEER` of this one's peak rate.

        Two jobs that run at the servers' pace but started apart would otherwise stay apart for
        good, each served alone at half the servers' rate; holding the leader back lets the
        other's samples be made alone at the whole rate until it is within the bound, and both
        share from then on. A straggler (a job whose own step is slower) is no peer: it is served
        alone for what it lags on, at its turn among the feeds, and holds nobody. (A leader held
        back from the start never runs faster than a straggler's pace by much, and may take it
        for a peer: docs/groups.md, limits.)"""
        if len(group.members) < 2 or not len(plan.ids):
            return False
        mine = plan.user_epoch + plan.next / len(plan.ids)
        bound = group.bound(self.window.capacity, plan.prep.nbytes if plan.prep else 1)
        now = time.monotonic()
        rate = group.peak(member, now)  # (not its rate now: held back, a leader slows to the laggard's pace)
        for other, feed_ids in group.members.items():
            if other == member:
                continue
            places = []
            for feed_id in feed_ids:
                feed = self._feeds.get(feed_id)
                current = (
                    next((p for _, p in sorted(feed.plans.items()) if p.next < len(p.ids)), None) if feed else None
                )
                if current is not None and len(current.ids):
                    places.append(current.user_epoch + current.next / len(current.ids))
            if not places:
                continue
            behind = (mine - min(places)) * group.share_size
            theirs = group.rate(other, now)
            if behind > bound and theirs > 0 and theirs >= PEER * rate:  # (one that stopped reading is none)
                return True
        return False

    def _wanted(
        self,
        members: list[str],
        group: GroupState,
        sig: tuple[int, int, bool, int],
        epoch: int,
        ids: np.ndarray,
        bound: int,
        ahead: np.ndarray,
        reading: int,
    ) -> list[set[str]]:
        """Per sample of ``ids``, the ``members`` that will need its output of ``epoch`` while
        they lag the maker by at most the lag ``bound`` (in this share's samples; the maker reads
        its plan of ``epoch`` at position ``reading`` and makes each sample ``ahead`` of that):
        those whose plan of that epoch holds it unwritten at most ``bound`` + ``ahead`` positions
        past where they read (or that have a rank whose feed is not open here yet); those whose
        plans are all of earlier epochs, if what is left of them and ``reading`` are together
        within the bound; and those with none (not begun). (An output is kept from when the
        maker was written it until the others are: for as long as they lag it.)

        A member further behind is served alone when it gets there: keeping the output for it
        would only fill the kept outputs' cap with what it never reaches in time, pushing out
        what the members within the bound are about to read (a job three times slower than its
        group kept the cap full and had the others' outputs evicted and made again)."""
        out: list[set[str]] = [set() for _ in range(len(ids))]
        for member in members:
            feeds = [self._feeds[f] for f in group.members.get(member, ()) if f in self._feeds]
            plans = [p for f in feeds for p in f.plans.values()]
            now = [p for p in plans if p.user_epoch == epoch and p.prep is not None and signature(p.prep) == sig]
            if now:
                found = np.zeros(len(ids), dtype=bool)
                due = np.zeros(len(ids), dtype=bool)
                for p in now:
                    k = p.locate(ids)
                    hit = np.flatnonzero(k >= 0)
                    found[hit] = True
                    if p.processed is not None and p.state is not None and len(hit):
                        kk = k[hit]  # (a position made, or placed at another output, needs none)
                        soon = kk - p.next <= bound + ahead[hit]
                        due[hit] |= ~p.written[kk] & p.processed[kk] & (p.state[kk] == ABSENT) & soon
                unopened = max((f.ranks for f in feeds), default=0) > len(feeds)
                wants = due | (~found & unopened)
            elif not plans:
                wants = np.ones(len(ids), dtype=bool)
            elif max(p.user_epoch for p in plans) < epoch:
                left = min(len(p.ids) - p.next for p in plans if p.user_epoch == max(q.user_epoch for q in plans))
                wants = np.full(len(ids), left + reading <= bound, dtype=bool)
            else:
                continue  # past this epoch
            for i in np.flatnonzero(wants).tolist():
                out[i].add(member)
        return out

    def _add_use(self, output: Output, feed: FeedState, use: Use) -> None:
        output.users.add(use)
        feed.made += output.nbytes

    def _drop_use(self, output: Output, use: Use) -> None:
        if use in output.users:
            output.users.discard(use)
            feed = self._feeds.get(use[0])
            if feed is not None:
                feed.made -= output.nbytes

    def _place_at(self, feed: FeedState, plan: PlanState, placed: list[tuple[int, Slot]]) -> None:
        at = np.array([k for k, _ in placed], dtype=np.int64)
        slots = [s for _, s in placed]
        with contextlib.suppress(KSpeedError):  # the feeder is gone
            self._tell(
                feed.feeder,
                Place(
                    feed.feed_id,
                    plan.epoch,
                    at,
                    np.array([s.region for s in slots], np.int64),
                    np.array([s.offset for s in slots], np.int64),
                    np.array([s.ticket for s in slots], np.int64),
                    quiet=True,  # (positions not made, not placed: no slot of theirs to leave)
                ),
            )

    # -- made, written, let go -------------------------------------------------------------------

    def _settle_outputs(
        self, group: GroupState | None, keys: list[OutputKey], slots: list[Slot], results: list[int | str]
    ) -> None:
        """Outputs of ``group`` made (or failed): placed at every position waiting for them (one
        command per feed's plan for all of them: a command is a round trip to the feeder)."""
        places: dict[tuple[str, int], list[tuple[int, Slot]]] = {}
        settled: list[Output] = []
        for key, slot, result in zip(keys, slots, results, strict=True):
            output = group.outputs.get(key) if group is not None else None
            if output is None or group is None:  # the group went meanwhile: nobody waits for it
                self.window.free(slot)
                continue
            if isinstance(result, str) and not key[0][2]:  # (skipping: the slot holds its failure record)
                self.window.free(slot)
                group.forget(output)
                self._fail_users(output, result)
                continue
            output.slot = slot
            for use in list(output.users):
                user = self._feeds.get(use[0])
                plan = user.plans.get(use[1]) if user is not None else None
                if (
                    plan is None
                    or plan.state is None
                    or use[2] >= plan.cut
                    or plan.state[use[2]] != READING
                    or plan.shared.get(use[2]) != key
                ):
                    self._drop_use(output, use)
                    if plan is not None and plan.shared.get(use[2]) == key:
                        del plan.shared[use[2]]
                    continue
                plan.state[use[2]] = WINDOW
                plan.slots[use[2]] = slot
                places.setdefault((use[0], use[1]), []).append((use[2], slot))
            settled.append(output)
        for (feed_id, epoch), spots in places.items():
            self._place_at(self._feeds[feed_id], self._feeds[feed_id].plans[epoch], spots)
        for output in settled:
            if group is not None:
                self._settle_output(group, output)

    def _fail_users(self, output: Output, reason: str) -> None:
        """Output ``output`` could not be made: the grants of every position waiting for it fail."""
        for feed_id, epoch, k in list(output.users):
            self._drop_use(output, (feed_id, epoch, k))
            user = self._feeds.get(feed_id)
            plan = user.plans.get(epoch) if user is not None else None
            if plan is None or plan.state is None or user is None:
                continue
            plan.shared.pop(k, None)
            plan.state[k] = FAILED
            one = np.array([k], dtype=np.int64)
            with contextlib.suppress(KSpeedError):
                self._tell(user.feeder, Place(feed_id, epoch, one, one * 0 - 1, one * 0, one * 0, (reason,)))

    def _abandon_outputs(self, group: GroupState | None, keys: list[OutputKey | None]) -> None:
        """Outputs of ``group`` a producer was making and did not (it failed or the window was
        full): the positions waiting for them are to be made again."""
        if group is None:
            return
        for key in keys:
            output = group.outputs.get(key) if key is not None else None
            if output is None or output.slot is not None:
                continue
            group.forget(output)
            for fid, epoch, k in list(output.users):
                self._drop_use(output, (fid, epoch, k))
                user = self._feeds.get(fid)
                plan = user.plans.get(epoch) if user is not None else None
                if plan is not None and plan.state is not None and plan.shared.get(k) == key:
                    del plan.shared[k]
                    if plan.state[k] == READING:
                        plan.state[k] = ABSENT

    def _unshare(self, feed: FeedState, plan: PlanState, k: int, busy: set[int], written: bool) -> None:
        """Position ``k`` of ``feed``'s plan no longer uses its output (written, or its plan
        dropped); the output is released when nobody uses or waits for it."""
        key = plan.shared.pop(k, None)
        group = self._group_of(feed)
        output = group.outputs.get(key) if group is not None and key is not None else None
        if output is None or group is None:
            return
        self._drop_use(output, (feed.feed_id, plan.epoch, k))
        if written and feed.membership is not None:
            output.waiting.discard(feed.membership.member)
        if output.slot is not None and output.slot.ticket in busy:
            output.busy.add(feed.feeder)
            self._output_tickets[output.slot.ticket] = output
        self._settle_output(group, output)

    def _settle_output(self, group: GroupState, output: Output) -> None:
        """An output no position uses: kept while a member waits for it (within the lag bound,
        the oldest going first), else freed."""
        if output.users or output.slot is None or group.outputs.get(output.key) is not output:
            return
        if not output.waiting:
            self._free_output(group, output)
            return
        group.keep(output)
        for victim in group.over_cap(self.window.capacity):
            group.figures.evicted += 1
            self._free_output(group, victim)

    def _free_output(self, group: GroupState, output: Output) -> None:
        group.forget(output)
        for use in list(output.users):
            self._drop_use(output, use)
        slot, output.slot = output.slot, None
        if slot is None:
            return
        self._output_tickets.pop(slot.ticket, None)
        if output.busy:
            self._draining[slot.ticket] = Draining(slot, set(output.busy), self.window)
        else:
            self.window.free(slot)

    def _output_freed(self, feeder: int, ticket: int) -> None:
        """A feeder no longer reads ``ticket`` of an output it was un-placed from."""
        output = self._output_tickets.get(ticket)
        if output is not None:
            output.busy.discard(feeder)

    def _let_kept_go(self) -> bool:
        """The window is full: let the oldest outputs kept for lagging members go. Returns whether any went."""
        with self._lock:
            for group in self._groups.values():
                if group.kept:
                    for key in list(group.kept)[:16]:
                        group.figures.evicted += 1
                        self._free_output(group, group.outputs[key])
                    return True
        return False

    def _let_output_go(self, group: GroupState, output: Output) -> None:
        """Take ``output`` out of every plan and free it (it is made again when needed)."""
        self._unplace(output)
        self._free_output(group, output)

    def _unplace(self, output: Output) -> None:
        """Take ``output`` out of every plan it is placed in: those positions are to be made again."""
        for feed_id, epoch, k in list(output.users):
            self._drop_use(output, (feed_id, epoch, k))
            user = self._feeds.get(feed_id)
            plan = user.plans.get(epoch) if user is not None else None
            if user is None or plan is None or plan.state is None:
                continue
            plan.shared.pop(k, None)
            plan.slots.pop(k, None)
            plan.state[k] = ABSENT
            none = np.zeros(1, dtype=np.int64)
            try:
                reply = self._tell(user.feeder, Place(feed_id, epoch, np.array([k], np.int64), none - 1, none, none))
            except KSpeedError:
                continue
            if output.slot is not None and output.slot.ticket in reply.busy:
                output.busy.add(user.feeder)

    # -- figures ---------------------------------------------------------------------------------

    def group_datasets(self) -> list[str]:
        """The datasets some group shares preparation of here."""
        with self._lock:
            return sorted({key[0] for key, _ in self._groups})

    def group_figures(self, dataset: str) -> list[kspeed_pb2.GroupFigures]:
        """Per group of ``dataset`` on this server, what its sharing did (its shares summed)."""
        merged: dict[str, kspeed_pb2.GroupFigures] = {}
        with self._lock:
            for (key, name), group in sorted(self._groups.items()):
                if key[0] != dataset:
                    continue
                out = merged.setdefault(name, kspeed_pb2.GroupFigures(group=name))
                f = group.figures
                out.produced += f.produced
                out.shared += f.shared
                out.alone += f.alone
                out.evicted += f.evicted
                out.held_bytes += sum(o.nbytes for o in group.outputs.values() if o.slot is not None)
                out.kept_bytes += group.kept_bytes
                typical = next(iter(group.outputs.values())).nbytes if group.outputs else 1
                out.cap_bytes += group.cap(self.window.capacity, typical)
                out.members = max(out.members, len(group.members))
                for m, n in f.member_shared.items():
                    out.member_shared[m] += n
                for m, n in f.member_alone.items():
                    out.member_alone[m] += n
                for m, n in f.member_produced.items():
                    out.member_produced[m] += n
        return list(merged.values())
