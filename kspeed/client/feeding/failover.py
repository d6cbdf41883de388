"""Carrying a feed over a server's death: the training loop sees a pause, never an error.

When a server that holds a share of the dataset is lost (its connection failed, or the manager
declared it failed while it stayed silent), the client:

1. fences its path (:meth:`Feed.fence <kspeed.client.feeding.feed.Feed.fence>`: a new generation, its
   outstanding ranges quarantined until its writer is gone) as soon as it learns the server is
   lost: its connection broke, it stayed silent, or the manager's membership stream (followed by
   :mod:`kspeed.control.membership_watch`, so no question is asked) says it was declared failed;
2. waits, at most ``failover_timeout``, for the manager to move the share to another server (a
   spare, or a survivor with room) and for that server to be ready;
3. connects the new holder under the path's new generation, looks the moved IDs up there (they
   must be the same samples, of the same lengths), and commits the plans in use to it;
4. grants again, from the first batch not yet delivered, everything that was in flight.

The new holder reads the share from the backend in the order the committed plans consume it, so
the pause is about the time to produce a ring's worth, not to reload the share. Every sample of
the epoch arrives exactly once, in the sampler's order: batches are delivered in order, and a
batch is delivered only when all of its samples arrived under current generations.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np

from kspeed.client.feeding.feed import Feed
from kspeed.client.feeding.links import ServerLink
from kspeed.client.planning.compact import owned_positions
from kspeed.client.planning.plans import EpochPlan, EpochPlanner, reaching
from kspeed.config import ClientConfig
from kspeed.control.lifecycle import GONE, SERVING, state_name
from kspeed.control.manager_client import ManagerClient
from kspeed.errors import DatasetError, KSpeedError, NotFoundError, PeerLostError, ProtocolError
from kspeed.proto import kspeed_pb2

__all__ = ["Failover"]

log = logging.getLogger(__name__)

POLL_S = 0.25  # between looks at the manager while a share moves
SAME_SERVER_AFTER = 5.0  # a fenced server the manager still calls ready is dialled again after this long
HELLO_TIMEOUT = 10.0  # longest wait for a new holder's feeder to connect


class Failover:
    """Replaces the lost servers of one feed (see the module docstring).

    Args:
        dataset: the dataset's name.
        info: the dataset as the feed was built from it (its shares, in path order).
        feed: the feed.
        planner: the feed's planner (its links follow the paths).
        manager: asked where shares are and which servers are ready.
        config: credentials and deadlines for the new links, and ``failover_timeout``.
    """

    def __init__(
        self,
        *,
        dataset: str,
        info: kspeed_pb2.DatasetInfo,
        feed: Feed,
        planner: EpochPlanner,
        manager: ManagerClient,
        config: ClientConfig,
    ) -> None:
        self.dataset = dataset
        self.feed = feed
        self.planner = planner
        self.manager = manager
        self.timeout = config.failover_timeout
        self._config = config
        self._ranges = [(int(s.first_id), int(s.end_id)) for s in info.shares]
        self._members = manager.membership()
        self._seen = -1  # the membership revision last looked at
        # Per path, the incarnation of the server its link was made to: one that restarts before
        # this feed notices is back as a newer one by then, and is dialled at once.
        self._dialled: dict[int, int | None] = {}
        self._note_incarnations()

    def _note_incarnations(self) -> None:
        """Note the incarnation of each path's server not noted yet (the membership may not be known
        when the feed starts)."""
        with self.feed.lock:
            servers = [(p.index, p.link.server_id) for p in self.feed.paths if self._dialled.get(p.index) is None]
        for index, server_id in servers:
            self._dialled[index] = self._members.incarnation(server_id)

    # -- noticing ----------------------------------------------------------------------------------

    def fence_failed(self) -> None:
        """Fence the paths whose server the manager has declared failed, stopped or gone: looked at when
        the membership changed (the watch stream tells; no question is asked). A server silent
        beyond ``completion_timeout`` is lost whatever the manager says (the feed fences it)."""
        members = self._members
        revision = members.revision
        if not members.synced or revision == self._seen:
            return
        self._seen = revision
        self._note_incarnations()
        with self.feed.lock:  # the paths (a few), not the grants
            gone = [p for p in self.feed.paths if not p.lost and members.state(p.link.server_id) in GONE]
        for path in gone:
            self.feed.fence_path(path, "the manager declared it failed")

    # -- recovering --------------------------------------------------------------------------------

    def recover(self, cause: KSpeedError) -> list[int]:
        """Replace every fenced path by the server its share moved to; returns the paths replaced
        (the caller re-commits its plans to them with :meth:`recommit` and grants again).

        Raises:
            the ``cause`` again: no path was fenced (the failure is not a lost server), or the
                feed was ended by a server (its dataset removed).
            PeerLostError: a share did not move to a ready server within ``failover_timeout``
                (no spare with room?); the message names the server and the wait.
        """
        if self.feed.ended:
            raise cause
        named = getattr(cause, "server_id", None)  # a control-plane call to it failed
        share = getattr(cause, "first_id", None)  # about one share there: only that path is lost
        for path in self.feed.paths:
            ours = share is None or path.link.first_id is None or path.link.first_id == share
            if named is not None and path.link.server_id == named and not path.lost and ours:
                self.feed.fence_path(path, str(cause))
        self._seen = -1
        self.fence_failed()
        lost = [p for p in self.feed.paths if p.lost]
        if not lost:
            raise cause
        give_up = time.monotonic() + self.timeout
        for path in lost:
            self._take_over(path.index, give_up)
        return [p.index for p in lost]

    def _take_over(self, index: int, give_up: float) -> None:
        """Connect path ``index`` to the ready server holding its share: another server, its own
        again once that has registered again (it restarted), or once it has been fenced for
        :data:`SAME_SERVER_AFTER` and is still called ready (a cut link that healed)."""
        path = self.feed.paths[index]
        old, why = path.link.server_id, path.lost
        since = time.monotonic()
        lost_as = self._dialled.get(index)  # a server back as a newer incarnation restarted: dial it at once
        if lost_as is None:
            lost_as = self._members.incarnation(old)
        last = ""
        while True:
            found = self._holder(index, old, last)
            if isinstance(found, str):
                last = found
            elif (
                found[0] != old
                or (lost_as is not None and self._members.incarnation(old) != lost_as)
                or time.monotonic() - since > SAME_SERVER_AFTER
            ):
                first, end = self._ranges[index]
                link = ServerLink(*found, self._config, first_id=first, end_id=end)
                try:
                    self.feed.replace(index, link, hello_timeout=HELLO_TIMEOUT)
                except KSpeedError as exc:
                    link.close()
                    last = f"{link.name} could not take it: {exc}"
                else:
                    self.planner.replace_link(index, link, path.feed_id)
                    self._dialled[index] = self._members.incarnation(found[0])
                    log.warning(
                        "dataset %s: %s was lost (%s); %s serves its share now", self.dataset, old, why, link.name
                    )
                    return
            else:
                last = f"the manager still calls {old} ready"
            if time.monotonic() > give_up:
                first, end = self._ranges[index]
                raise PeerLostError(
                    f"dataset {self.dataset!r}: server {old} was lost ({why}) and its share (samples "
                    f"{first}..{end - 1}) was not served again within failover_timeout ({self.timeout:g}s): {last}; "
                    f"`kspeed status` shows the servers and the dataset (a server stopped for a restart is waited for "
                    "restart_grace, a failed one's share moves to a server with room or is served on demand)"
                )
            self._members.wait(self._members.revision, POLL_S)  # a membership change, or the next look

    def _holder(self, index: int, old: str, last: str) -> tuple[str, str] | str:
        """``(server id, address)`` of the ready server holding path ``index``'s share, or why none is.

        Raises:
            ProtocolError: no share covers the path's samples any more.
        """
        first, end = self._ranges[index]
        try:
            info = self.manager.dataset(self.dataset)
            ready = self._members.ready() if self._members.synced else self._ready()
        except NotFoundError as exc:
            raise DatasetError(f"dataset {self.dataset!r} was removed: {exc}", dataset=self.dataset) from exc
        except KSpeedError as exc:  # the manager is away: keep asking until the deadline
            return f"the manager cannot be asked: {exc}"
        share = next((s for s in info.shares if (s.first_id, s.end_id) == (first, end)), None)
        if share is None:
            raise ProtocolError(f"dataset {self.dataset!r}: no share covers samples {first}..{end - 1} any more")
        if share.server_id not in ready:
            return f"its share is with {share.server_id}, which is {self._state_of(share.server_id)}"
        return share.server_id, ready[share.server_id]

    def _state_of(self, server_id: str) -> str:
        """A server's state and why, as the manager last said ("unknown to the manager" when it does not know it)."""
        try:
            record = next((r for r in self.manager.servers(include_left=True) if r.id == server_id), None)
        except KSpeedError:
            state = self._members.state(server_id)
            return state_name(state) if state is not None else "not known to be ready"
        if record is None:
            return "unknown to the manager"
        return (
            f"{state_name(record.state)} ({record.state_reason})" if record.state_reason else state_name(record.state)
        )

    def _ready(self) -> dict[str, str]:
        """Server id -> address of the serving servers, asked of the manager (before the watch has a snapshot)."""
        return {r.id: r.address for r in self.manager.servers() if r.state in SERVING}

    def recommit(self, plan: EpochPlan, replaced: list[int], first_batch: int = 0) -> None:
        """Commit ``plan`` from batch ``first_batch`` on (the ones before were delivered) to the
        servers of paths ``replaced``, after checking they hold its samples as the old holders did.

        Raises:
            ProtocolError: a new holder does not own a sample its share should, or knows one with
                another length.
        """
        for index in replaced:
            link = self.feed.paths[index].link
            mine = owned_positions(plan.owner, index)
            asked = plan.ids[mine]
            positions, lengths, _ = reaching(link, functools.partial(link.lookup, self.dataset, asked))
            if not np.array_equal(np.sort(positions), np.arange(len(mine))):
                raise ProtocolError(
                    f"dataset {self.dataset!r}: {link.name} does not hold every sample of the share it took over"
                )
            raw = ~plan.remote[mine][positions] if plan.remote is not None else np.ones(len(positions), dtype=bool)
            if not np.array_equal(lengths[raw], plan.lengths[mine][positions][raw]):
                raise ProtocolError(
                    f"dataset {self.dataset!r}: {link.name} knows the samples of the share it took over with "
                    "other lengths"
                )
            self.planner.commit(plan, index, first_batch)
