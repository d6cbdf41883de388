"""Shared preparation: the jobs of a group share what the server stages make of each sample.

Jobs that name the same group when they open their feeds (``client.dataset(..., group="hp-17")``)
are its **members** (one per job, whatever its ranks). In ``share="samples"`` mode the output of
the server stages for a sample in an epoch depends only on the pipeline's cut, the seed and the
epoch, and every member draws from the same seed (a plan that draws from another is refused), so
one output serves every member: production makes it once, places it in each member's plan where
that plan reaches it, and keeps it in the production window until every member that needs it has
been written it (its **waiting** members, a use counter per sample and job), then frees it.

Members at different speeds: an output no plan is about to write but some member still waits for
is **kept**; the kept outputs of a group are bounded (its lag bound, :meth:`GroupState.cap`), and
the oldest go first. A member that falls further behind than that finds the outputs gone and has
its samples produced again for it alone, counted (:attr:`GroupFigures.alone`); the others never
wait for it. A member that joins later shares from wherever its plans meet the outputs kept, and
one that leaves (or dies: its feeds close) stops being waited for.

``share="decoded"`` members draw from seeds of their own and share no outputs; their dataset keeps
the deterministic prefix of the pipeline at home (``cache="preprocessed"``), which every job
already shares.

The records here are kept under :class:`~kspeed.server.production.core.Production`'s lock;
:class:`~kspeed.server.production.processed.ProcessedProduction` does the producing and placing.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque

import numpy as np

from kspeed.server.memory.window import Slot

__all__ = ["PEER", "SAMPLES", "SHARE_MODES", "GroupFigures", "GroupState", "Membership", "Output", "OutputKey", "Use"]

SAMPLES = "samples"
DECODED = "decoded"
SHARE_MODES = (SAMPLES, DECODED)
DEFAULT_CAP_FRACTION = 4  # with no lag asked for, a group keeps at most 1/4 of the window for laggards
MAX_CAP_FRACTION = 2  # and never more than half of it
RATE_SPAN_S = 5.0  # a member's rate is measured over about this long
PEAK_SPAN_S = 30.0  # a member's peak rate is the highest over about this long
NARROW_BATCHES = 2  # a lag bound under this many of a member's batches is warned about (members a batch apart go alone)
PEER = 0.75  # a member lagging beyond the bound at this fraction of the leader's peak rate is waited for

#: (server stages, the stages stored already, skip records, output bytes), user epoch, sample
OutputKey = tuple[tuple[int, int, bool, int], int, int]
#: a position an output is placed (or due) at: (feed, plan number, owned index)
Use = tuple[str, int, int]


@dataclasses.dataclass(frozen=True)
class Membership:
    """A feed's job in a group, as its client told when it opened the feed."""

    group: str
    member: str
    share: str = SAMPLES
    lag: int = 0  # samples of the dataset the fastest member may lead the slowest by (0: default)


@dataclasses.dataclass
class Output:
    """One shared output: a sample after the server stages, for one epoch."""

    key: OutputKey
    nbytes: int
    waiting: set[str]  # members not written it yet that will need it
    # positions it is placed (or, while made, due) at; each counts its bytes in its feed's window
    # share, so that a member placing outputs far ahead of where it reads holds no more than its share
    users: set[Use] = dataclasses.field(default_factory=set)
    slot: Slot | None = None  # None while it is being made
    busy: set[int] = dataclasses.field(default_factory=set)  # feeders still reading it after an un-place


@dataclasses.dataclass
class GroupFigures:
    """What a group's sharing did on one server, counted since the group began here."""

    produced: int = 0  # outputs made to be shared
    shared: int = 0  # positions served an output made for another member's plan
    alone: int = 0  # positions of a member made for it alone while the group had others
    evicted: int = 0  # outputs the lag bound let go while members still waited for them
    member_shared: dict[str, int] = dataclasses.field(default_factory=dict)
    member_alone: dict[str, int] = dataclasses.field(default_factory=dict)
    member_produced: dict[str, int] = dataclasses.field(default_factory=dict)

    def count(self, member: str, *, produced: int = 0, shared: int = 0, alone: int = 0) -> None:
        self.produced += produced
        self.shared += shared
        self.alone += alone
        if produced:
            self.member_produced[member] = self.member_produced.get(member, 0) + produced
        if shared:
            self.member_shared[member] = self.member_shared.get(member, 0) + shared
        if alone:
            self.member_alone[member] = self.member_alone.get(member, 0) + alone


class GroupState:
    """One group on one share of a server: its members' feeds, seed and outputs.

    Args:
        name: the group's name.
        share_size: samples of the share.
        dataset_size: samples of the whole dataset (the lag is asked for in those).
    """

    def __init__(self, name: str, share_size: int, dataset_size: int) -> None:
        self.name = name
        self.share_size = share_size
        self.dataset_size = max(dataset_size, share_size, 1)
        self.seed: int | None = None  # the seed its samples-mode plans draw from (set by the first)
        self.members: dict[str, set[str]] = {}  # member -> its feeds here
        self.lags: dict[str, int] = {}  # member -> the lag it asked for
        self.outputs: dict[OutputKey, Output] = {}
        self.kept: OrderedDict[OutputKey, None] = OrderedDict()  # outputs no position uses, oldest first
        self.kept_bytes = 0
        self.figures = GroupFigures()
        self.narrow = False  # warned that its lag bound is under :data:`NARROW_BATCHES` of a member's batches
        # Asked at every look for work of every member, so each costs O(1) (summing and taking the
        # highest over the recent entries at each ask was over a millisecond per look with eight members):
        self._written: dict[str, deque[tuple[float, int]]] = {}  # member -> (when, positions written)
        self._sums: dict[str, int] = {}  # member -> the positions of its _written
        # member -> (when, its rate then), the rates decreasing: one lower than a later one is never the peak
        self._rates: dict[str, deque[tuple[float, float]]] = {}

    def wrote(self, member: str, positions: int, now: float) -> None:
        """``member``'s feeds here were written ``positions`` more positions."""
        self._written.setdefault(member, deque()).append((now, positions))
        self._sums[member] = self._sums.get(member, 0) + positions
        rate = self.rate(member, now)
        rates = self._rates.setdefault(member, deque())
        while rates and rates[-1][1] <= rate:
            rates.pop()
        rates.append((now, rate))
        self.peak(member, now)

    def peak(self, member: str, now: float) -> float:
        """The highest rate ``member`` was written at lately (over :data:`PEAK_SPAN_S`): what it
        runs at when nothing holds it back."""
        rates = self._rates.get(member)
        while rates and now - rates[0][0] > PEAK_SPAN_S:
            rates.popleft()
        return rates[0][1] if rates else 0.0

    def rate(self, member: str, now: float) -> float:
        """Positions per second ``member`` was written lately here."""
        recent = self._written.get(member)
        if not recent:
            return 0.0
        while recent and now - recent[0][0] > RATE_SPAN_S:
            self._sums[member] -= recent.popleft()[1]
        return self._sums[member] / RATE_SPAN_S

    @property
    def owner(self) -> str:
        """The window owner its outputs are placed under (they fill chunks of their own)."""
        return f"group/{self.name}"

    def join(self, member: str, feed_id: str, lag: int) -> None:
        self.members.setdefault(member, set()).add(feed_id)
        self.lags[member] = max(int(lag), 0)

    def leave(self, member: str, feed_id: str) -> bool:
        """A feed of ``member`` closed; returns whether the member has none left here (it left)."""
        feeds = self.members.get(member)
        if feeds is None:
            return False
        feeds.discard(feed_id)
        if feeds:
            return False
        del self.members[member]
        self.lags.pop(member, None)
        self._written.pop(member, None)
        self._sums.pop(member, None)
        self._rates.pop(member, None)
        return True

    def cap(self, capacity: int, nbytes: int) -> int:
        """Bytes the outputs kept for members that lag behind may hold in a window of
        ``capacity``: the largest lag its members asked for, as this share's part of it, in
        outputs of ``nbytes``; a quarter of the window when none asked; never over half."""
        lag = max(self.lags.values(), default=0)
        if lag <= 0:
            return capacity // DEFAULT_CAP_FRACTION
        here = -(-lag * self.share_size // self.dataset_size)
        return min(here * max(nbytes, 1), capacity // MAX_CAP_FRACTION)

    def narrow_for(self, bound: int, batch: int) -> bool:
        """Whether a lag bound of ``bound`` of this share's samples is under :data:`NARROW_BATCHES`
        of a member's batches of ``batch`` positions (this share's part of them): two members a
        batch apart then lag each other by about the bound, and are served alone."""
        here = -(-batch * self.share_size // self.dataset_size)
        return bound < NARROW_BATCHES * here

    def bound(self, capacity: int, nbytes: int) -> int:
        """The lag bound in this share's samples: how many outputs of ``nbytes`` the cap holds."""
        return self.cap(capacity, nbytes) // max(nbytes, 1)

    def keep(self, output: Output) -> None:
        """``output`` is no longer placed anywhere but members wait for it: kept, newest last."""
        if output.key not in self.kept:
            self.kept[output.key] = None
            self.kept_bytes += output.nbytes

    def unkeep(self, output: Output) -> None:
        if self.kept.pop(output.key, 0) is None:
            self.kept_bytes -= output.nbytes

    def over_cap(self, capacity: int) -> list[Output]:
        """The oldest kept outputs to let go so that the kept ones fit the cap."""
        out = []
        excess = self.kept_bytes - self.cap(capacity, self._typical())
        for key in self.kept:
            if excess <= 0:
                break
            output = self.outputs[key]
            out.append(output)
            excess -= output.nbytes
        return out

    def _typical(self) -> int:
        for key in self.kept:
            return self.outputs[key].nbytes
        return 1

    def forget(self, output: Output) -> None:
        self.unkeep(output)
        self.outputs.pop(output.key, None)


def plan_lookup(ids: np.ndarray, order: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Owned indices of ``wanted`` samples in a plan whose IDs are ``ids`` and ``order`` their
    argsort (-1 where the plan does not hold one; the first where it holds one twice)."""
    if not len(ids):
        return np.full(len(wanted), -1, np.int64)
    sorted_ids = ids[order]
    at = np.searchsorted(sorted_ids, wanted)
    at = np.minimum(at, len(ids) - 1)
    found = sorted_ids[at] == wanted
    return np.where(found, order[at], -1).astype(np.int64)
