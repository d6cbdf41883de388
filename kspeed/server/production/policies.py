"""The policies a server produces a share under: one small class each, registered by name.

Production (:mod:`kspeed.server.production.core`) asks a share's policy what to do instead of
comparing its name: whether the share has a window of its own, which of its feeds' plans it
works for, how much of the window prefetching may fill, whether a written sample stays, and which
cached samples leave first when room is needed. The state those decisions read and change (what a
caching policy keeps) is a :class:`CacheState`, so each decision can be made, and tested, without
production's threads.

=============  ===========  ==========================================================================
policy         own window   what it keeps of the written samples
=============  ===========  ==========================================================================
``whole``      no           everything: a written sample goes home (the share's pool regions)
``on_demand``  no           nothing: the server's window holds a sample until it is written
``stream``     yes          nothing: a sample leaves once no feed's horizon or current plan needs it
``minio``      yes          the first samples that fit the kept part of the window, for good
``reuse``      yes          every one, until room is needed: the farthest next use leaves first
``lru``        yes          every one, until room is needed: the least recently written leaves first
=============  ===========  ==========================================================================

The four with a window of their own are the memory policies a dataset asks for by name
(:data:`kspeed.policies.MEMORY_POLICIES`). The other two are this module's own names for what the
manager's assignment says without one: :data:`WHOLE` (``Share.policy`` empty: the share is held
whole at home) and :data:`ON_DEMAND` (``Share.on_demand``: a survivor serving a lost server's
share, with no copy, from the server's window); :func:`share_policy` reads an assignment so.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kspeed.errors import ConfigError
from kspeed.policies import LRU, MEMORY_POLICIES, MINIO, REUSE, STREAM

__all__ = [
    "EVICT_BATCH",
    "ON_DEMAND",
    "POLICY_CLASSES",
    "STAGING",
    "WHOLE",
    "CacheState",
    "Caching",
    "Lru",
    "MemoryPolicy",
    "Minio",
    "NextUse",
    "OnDemand",
    "Plan",
    "Reuse",
    "Stream",
    "Whole",
    "farthest_first",
    "policy_for",
    "share_policy",
]

WHOLE = "whole"  # the share held whole: every sample has its place at home
ON_DEMAND = "on_demand"  # a survivor serves a lost server's share with no copy, from the server's window

STAGING = 4  # a caching policy prefetches into at most 1/STAGING of its share's window (it keeps the rest)
EVICT_BATCH = 16  # samples a caching policy lets go at once when its window is full

NextUse = Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]]
"""For some samples, how many samples the share's feeds consume before each is needed again
(larger than any when no known plan needs it)."""


class Plan(Protocol):
    """What a policy reads of a followed plan: its samples, and the first position not written."""

    @property
    def ids(self) -> npt.NDArray[Any]: ...

    @property
    def next(self) -> int: ...


PlanT = TypeVar("PlanT", bound=Plan)


@dataclasses.dataclass
class CacheState:
    """What a caching policy keeps of one share's written samples in the share's window.

    Attributes:
        recent: written samples no horizon holds, least recently written first (``lru`` and
            ``reuse`` choose their victims among these).
        kept: the samples ``minio`` keeps for good.
        kept_bytes: their bytes.
        kept_room: the bytes ``minio`` may keep (``None`` until the first write sets it; it only
            shrinks after, when a first grant needs the room).
    """

    recent: collections.OrderedDict[int, None] = dataclasses.field(default_factory=collections.OrderedDict)
    kept: set[int] = dataclasses.field(default_factory=set)
    kept_bytes: int = 0
    kept_room: int | None = None

    def holds(self, sample: int) -> bool:
        """Whether the policy keeps ``sample`` in the window (cached, or kept for good)."""
        return sample in self.recent or sample in self.kept

    def drop(self, sample: int, nbytes: int) -> None:
        """``sample`` (``nbytes`` in the window) left the window: it is neither cached nor kept now."""
        self.recent.pop(sample, None)
        if sample in self.kept:
            self.kept.discard(sample)
            self.kept_bytes -= nbytes

    def clear(self) -> None:
        """Forget every cached and kept sample (their slots were freed)."""
        self.recent.clear()
        self.kept.clear()


def farthest_first(ids: npt.NDArray[np.int64], next_use: npt.NDArray[np.int64], limit: int) -> npt.NDArray[np.int64]:
    """The at most ``limit`` of ``ids`` needed last (``next_use``: each one's distance to its next
    use), the farthest first; ties keep the order of ``ids``."""
    return ids[np.argsort(-next_use, kind="stable")[:limit]]


class MemoryPolicy:
    """A policy's decisions; the base makes those of a share with no copy at home that keeps
    nothing once written. Instances are stateless: :func:`policy_for` hands out one per class."""

    __slots__ = ()

    name: ClassVar[str]
    own_window: ClassVar[bool] = False
    """The share produces into a window of its own (the regions the manager gave it), not the server's."""
    home: ClassVar[bool] = False
    """The share's samples have a place at home: a written one is copied there, and each feed's
    horizon is ``depth`` positions; without a home it is as much as the feed's fair share of the
    window holds."""
    caching: ClassVar[bool] = False
    """Written samples stay in the window for their next use (as :meth:`keeps` decides)."""
    holds_planned_uses: ClassVar[bool] = False
    """A sample a feed's current plan still needs stays until written, even outside every horizon
    (one read for a horizon that shrank as another feed began is never read twice for one plan)."""

    def followed(self, plans: Sequence[PlanT]) -> list[PlanT]:
        """The plans production works for, of a feed's ``plans`` in epoch order: those not
        written yet (each in turn, the next ones once the current one's rest fits)."""
        return [plan for plan in plans if plan.next < len(plan.ids)]

    def prefetch_room(self, capacity: int) -> int:
        """The bytes of a window of ``capacity`` that prefetching for the feeds may fill."""
        return capacity

    def keep_room(self, capacity: int) -> int:
        """The bytes of a window of ``capacity`` that samples kept for good may fill."""
        return 0

    def keeps(self, cache: CacheState, sample: int, nbytes: int) -> bool:
        """``sample`` (``nbytes``) was written and no horizon holds it: whether it stays in the
        window; records it in ``cache`` if so."""
        return False

    def needed_again(self, cache: CacheState, sample: int) -> None:
        """A horizon holds cached ``sample`` again (a later plan, or a position granted again): it
        is held until that use is written, not a victim meanwhile; :meth:`keeps` decides again after."""
        cache.recent.pop(sample, None)

    def victims(self, cache: CacheState, next_use: NextUse) -> npt.NDArray[np.int64]:
        """The cached samples to let go, first, when the window is full (none: the policy does not
        evict; production then moves only what keeps a first grant from completing)."""
        return np.zeros(0, np.int64)

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


class Whole(MemoryPolicy):
    """The share is held whole: production stages samples in the server's window ``depth``
    positions ahead of every plan of each feed, and a written one goes home."""

    __slots__ = ()
    name = WHOLE
    home = True

    def followed(self, plans: Sequence[PlanT]) -> list[PlanT]:
        """Every plan of the feed (a written one only adds nothing to the horizon)."""
        return list(plans)


class OnDemand(MemoryPolicy):
    """A survivor serves a lost server's share with no copy: its samples are read into the
    server's window as consumed and let go once written."""

    __slots__ = ()
    name = ON_DEMAND

    def followed(self, plans: Sequence[PlanT]) -> list[PlanT]:
        """Only the plan being consumed: a window that kept samples for later plans would fill with
        them and starve the ones needed now."""
        return super().followed(plans)[:1]


class Stream(MemoryPolicy):
    """Each feed's horizon is as much of its plans as its fair share of the share's window
    holds; a sample leaves once no horizon holds it and no feed's current plan needs it."""

    __slots__ = ()
    name = STREAM
    own_window = True
    holds_planned_uses = True


class Caching(MemoryPolicy):
    """Prefetching into :data:`STAGING`'s part of the share's window, keeping written samples
    in the rest; every written sample is cached, the least recently written first."""

    __slots__ = ()
    own_window = True
    caching = True

    def prefetch_room(self, capacity: int) -> int:
        return capacity // STAGING

    def keep_room(self, capacity: int) -> int:
        return capacity - capacity // STAGING

    def keeps(self, cache: CacheState, sample: int, nbytes: int) -> bool:
        cache.recent[sample] = None
        cache.recent.move_to_end(sample)
        return True


class Minio(Caching):
    """Keeps the first written samples that fit its kept room, for good (never others: a room that
    shrinks keeps fewer); the rest are read each epoch. Evicts nothing."""

    __slots__ = ()
    name = MINIO

    def keeps(self, cache: CacheState, sample: int, nbytes: int) -> bool:
        if sample in cache.kept:
            return True
        room = cache.kept_room if cache.kept_room is not None else 0
        if cache.kept_bytes + nbytes > room:
            return False
        cache.kept.add(sample)
        cache.kept_bytes += nbytes
        return True


class Reuse(Caching):
    """Lets go, when room is needed, the cached samples whose next use in the known plans is
    farthest (those no plan needs first)."""

    __slots__ = ()
    name = REUSE

    def victims(self, cache: CacheState, next_use: NextUse) -> npt.NDArray[np.int64]:
        cached = np.fromiter(cache.recent.keys(), dtype=np.int64, count=len(cache.recent))
        if not len(cached):
            return cached
        return farthest_first(cached, next_use(cached), EVICT_BATCH)


class Lru(Caching):
    """Lets go, when room is needed, the least recently written cached samples."""

    __slots__ = ()
    name = LRU

    def victims(self, cache: CacheState, next_use: NextUse) -> npt.NDArray[np.int64]:
        cached = np.fromiter(cache.recent.keys(), dtype=np.int64, count=len(cache.recent))
        return cached[:EVICT_BATCH]


POLICY_CLASSES: dict[str, type[MemoryPolicy]] = {cls.name: cls for cls in (Whole, OnDemand, Stream, Minio, Reuse, Lru)}
"""Every policy class by name: :data:`WHOLE`, :data:`ON_DEMAND` and the memory policies."""

_INSTANCES: dict[str, MemoryPolicy] = {name: cls() for name, cls in POLICY_CLASSES.items()}

if sorted(name for name, cls in POLICY_CLASSES.items() if cls.own_window) != sorted(MEMORY_POLICIES):
    raise AssertionError("the policies with a window of their own are not kspeed.policies.MEMORY_POLICIES")


def policy_for(name: str) -> MemoryPolicy:
    """The policy registered as ``name``.

    Raises:
        ConfigError: no policy is registered as ``name`` (a share assigned by a manager that knows
            policies this server does not).
    """
    policy = _INSTANCES.get(name)
    if policy is None:
        raise ConfigError(
            f"memory policy {name!r} is not one of {', '.join(POLICY_CLASSES)}", field="policy", value=name
        )
    return policy


def share_policy(assigned: str, *, on_demand: bool) -> MemoryPolicy:
    """The policy of a share as the manager assigns it: ``on_demand`` (``Share.on_demand``: no copy,
    whatever else it says) is :data:`ON_DEMAND`; else ``assigned`` (``Share.policy``) names a memory
    policy, or is empty: :data:`WHOLE`.

    Raises:
        ConfigError: ``assigned`` names no memory policy this server knows (the two members of
            this module's own are not assigned by name).
    """
    if on_demand:
        return policy_for(ON_DEMAND)
    if not assigned:
        return policy_for(WHOLE)
    policy = policy_for(assigned)
    if not policy.own_window:
        raise ConfigError(
            f"memory policy {assigned!r} is not one of {', '.join(MEMORY_POLICIES)}", field="policy", value=assigned
        )
    return policy
