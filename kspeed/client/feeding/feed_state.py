"""What a feed holds per server and per granted batch: the records :class:`~kspeed.client.feeding.feed.Feed`
keeps and its :class:`~kspeed.client.feeding.granting.Granting` reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from kspeed.client.feeding.links import Link
from kspeed.client.planning.plans import EpochPlan

__all__ = ["GrantedBatch", "ServerPath"]


@dataclass(eq=False)
class ServerPath:
    """One server's data-plane path into the ring.

    Attributes:
        index: the server's position in the feed's server list (the plan's owner index).
        link: its control-plane link.
        reason: why this rail serves it (logged).
        feed_id: the feed's id on that server (the feed's own, or, where another path of the
            feed leads to the same server, one of its own).
        generation: stamped into every tag; bumped by fencing.
        conn: the receiver's connection id of its feeder, once it said HELLO.
        lost: why the path was fenced ("" while healthy).
        last_heard: monotonic time of its last completion or message.
    """

    index: int
    link: Link
    reason: str
    feed_id: str = ""
    generation: int = 1
    conn: int | None = None
    lost: str = ""
    last_heard: float = 0.0


@dataclass(eq=False)
class GrantedBatch:
    """A granted batch: where it lies in the ring and which completions it still waits for."""

    plan: EpochPlan
    batch: int
    offset: int
    owed: dict[int, int]  # server index -> completions still owed (one per sub-batch it writes in)
    granted_at: float
    sent_at: float = 0.0  # when its last grant went out (paced: its last sub-batch left the window)
    finished: dict[int, float] = field(default_factory=dict)  # server index -> its last completion's time
    discarded: bool = False
    fenced: bool = False
    error: str = ""
    error_sample: int | None = None  # the sample a server's error named, where it named one
    errors_from: list[str] = field(default_factory=list)
    settled: bool = False

    @property
    def done(self) -> bool:
        return not self.owed
