"""Where shares go when their holder is gone or retiring, and back when room appears.

A **failover** gives the shares of a server that failed, or stopped and did not come back within
``restart_grace``, to another server (an empty spare first, then the survivor with the most room),
which reloads them in the order the feeds consume them; with no room anywhere, to a survivor that
serves them on demand (the dataset is degraded). A **handoff** (a drain) has the new holder load a
share while the old one still serves it, and moves it once loaded, so jobs switch to a server that
already holds the data. A **rehome** gives a share served on demand a server with room once one
has it. Every move is a new revision of the dataset's record, sent with the assignment.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from kspeed.control.lifecycle import SERVING
from kspeed.errors import CapacityError, KSpeedError
from kspeed.manager.catalog_state import CatalogState, needed_regions, record_of
from kspeed.manager.membership import READY
from kspeed.proto import kspeed_pb2

__all__ = ["ShareMoves"]

log = logging.getLogger(__name__)


def _loaded(status: kspeed_pb2.ShareStatus, share: kspeed_pb2.Share) -> bool:
    """Whether a share's new holder has what the old one served: a share under a memory policy (or
    served on demand) once it is held at all, a whole one once its preload has read every sample."""
    if share.policy or share.on_demand:
        return True
    p = status.progress
    return not p.running and p.samples_total > 0 and p.samples_loaded + p.error_count >= p.samples_total


class ShareMoves(CatalogState):
    """Failover, handoff and rehome of shares (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._degrade: dict[str, bool] = {}  # servers being drained -> whether a share may go on demand

    async def fail_over(self, server_id: str) -> int:
        """Move every share of a server that is gone (failed, or stopped past ``restart_grace``):
        one it was handing off goes to the server taking it over, the others as :meth:`_move`
        says; shares being handed *to* it go back to being held by their server alone. Returns
        the shares moved."""
        moved = 0
        for name in sorted(self._datasets):
            async with self._lock(name):
                info = self._datasets.get(name)
                if info is None:
                    continue
                for share in info.shares:
                    if share.handoff_to == server_id:
                        log.warning(
                            "dataset %s: %s, which was taking over samples %d..%d, is gone; %s keeps them",
                            name,
                            server_id,
                            share.first_id,
                            share.end_id - 1,
                            share.server_id,
                        )
                        self._share_status.pop((name, server_id, share.first_id), None)
                        share.handoff_to = ""
                        self._changed(info)
                    elif share.server_id == server_id and await self._fail_share(info, share):
                        moved += 1
        return moved

    async def _fail_share(self, info: kspeed_pb2.DatasetInfo, share: kspeed_pb2.Share) -> bool:
        """Give the share of a gone server the server it was being handed to, if that one serves; else :meth:`_move`."""
        target = share.handoff_to
        share.handoff_to = ""
        record = next((r for r in self._membership.snapshot() if r.id == target and r.state in SERVING), None)
        if record is None:
            return await self._move(info, share)
        old = share.server_id
        share.server_id = target
        self._share_status.pop((info.spec.name, old, share.first_id), None)
        self._changed(info)
        self.failovers += 1
        log.warning(
            "dataset %s: samples %d..%d of %s (gone mid-handoff) are held by %s, which was taking them over",
            info.spec.name,
            share.first_id,
            share.end_id - 1,
            old,
            target,
        )
        return True

    async def rehome(self) -> int:
        """Give the shares held on demand a holder with a copy, where a ready server has the
        regions free now (a spare registered, or a dataset was removed): the dataset is whole
        again once it has loaded. Returns the shares moved."""
        moved = 0
        for name in sorted(self._datasets):
            info = self._datasets.get(name)
            if info is None or not any(s.on_demand for s in info.shares):
                continue
            async with self._lock(name):
                for share in info.shares:
                    if share.on_demand and await self._move(info, share, copy_only=True):
                        moved += 1
        return moved

    def _targets(
        self, info: kspeed_pb2.DatasetInfo, share: kspeed_pb2.Share, *, copy_only: bool
    ) -> list[tuple[kspeed_pb2.ServerRecord, bool]]:
        """Where ``share`` may go, best first, each with whether it would be served on demand: the
        ready servers (never a draining one) with the regions free (an empty spare first, then the
        one with the most room); then, unless ``copy_only``, the ready survivors that can serve it
        on demand (the one serving the fewest such shares first)."""
        old = share.server_id
        ready = [
            r
            for r in self._membership.snapshot()
            if r.state == READY and r.id != old and r.inventory.region_size == info.region_size
        ]
        holding = self.holders()
        roomy = [
            r
            for r in ready
            if (
                self._slice_room(r) >= share.slice_bytes
                if share.slice_bytes
                else self._free_regions(r) >= needed_regions(share)
            )
        ]
        roomy.sort(key=lambda r: (r.id in holding, -self._free_regions(r), r.id))
        targets = [(r, False) for r in roomy]
        if not copy_only:
            load = collections.Counter(s.server_id for d in self._datasets.values() for s in d.shares if s.on_demand)
            survivors = sorted((r for r in ready if r.inventory.regions_window > 0), key=lambda r: (load[r.id], r.id))
            targets += [(r, True) for r in survivors]
        return targets

    async def _give(
        self,
        info: kspeed_pb2.DatasetInfo,
        share: kspeed_pb2.Share,
        target: kspeed_pb2.ServerRecord,
        on_demand: bool,
        *,
        handoff: bool = False,
    ) -> bool:
        """Assign ``share`` to ``target`` and start its load there (``handoff``: while its holder
        serves on); whether the server took it. The record sent is the dataset as it will be once
        the share has gone there."""
        moving = kspeed_pb2.Share()
        moving.CopyFrom(share)
        moving.server_id, moving.on_demand = target.id, on_demand
        record = record_of(info)
        record.revision += 1
        planned = next(s for s in record.shares if s.first_id == share.first_id)
        if handoff:
            planned.handoff_to = target.id
        else:
            planned.server_id, planned.on_demand, planned.handoff_to = target.id, on_demand, ""
        request = kspeed_pb2.DatasetRequest(name=info.spec.name, first_id=share.first_id)
        try:
            await self._calls.call(
                target.address, target.id, "AssignShare", self._assignment(info, moving, record=record)
            )
            await self._calls.call(target.address, target.id, "StartPreload", request)
        except KSpeedError as exc:
            log.warning(
                "dataset %s: %s cannot take the share of %s: %s", info.spec.name, target.id, share.server_id, exc
            )
            return False
        return True

    async def _move(self, info: kspeed_pb2.DatasetInfo, share: kspeed_pb2.Share, *, copy_only: bool = False) -> bool:
        """Give ``share`` another holder (:meth:`_targets`), which reloads it in the order the feeds
        consume it, or serves it **on demand**, reading each sample from the backend into its
        production window as feeds need it (the dataset is degraded until :meth:`rehome` finds it a
        holder with room). Returns whether it moved."""
        name, old = info.spec.name, share.server_id
        for target, on_demand in self._targets(info, share, copy_only=copy_only):
            if not await self._give(info, share, target, on_demand):
                continue
            share.server_id, share.on_demand = target.id, on_demand
            self._share_status.pop((name, old, share.first_id), None)
            self._changed(info)
            self.failovers += 1
            if on_demand:
                log.error(
                    "dataset %s: no ready server has %d regions free for samples %d..%d of %s; %s serves them on "
                    "demand, reading each from the backend (the dataset is degraded until a server with room "
                    "registers)",
                    name,
                    share.num_regions,
                    share.first_id,
                    share.end_id - 1,
                    old,
                    target.id,
                )
            else:
                log.warning(
                    "dataset %s: samples %d..%d moved from %s to %s, which loads them",
                    name,
                    share.first_id,
                    share.end_id - 1,
                    old,
                    target.id,
                )
                if copy_only:  # the survivor that served them on demand lets them go
                    await self._release_share(info, old, share.first_id)
            return True
        if not copy_only:
            log.error(
                "dataset %s: no ready server can take samples %d..%d of %s, which is gone; the dataset is degraded "
                "until it returns or a server registers",
                name,
                share.first_id,
                share.end_id - 1,
                old,
            )
        return False

    def plan_drain(self, server_id: str, *, allow_degraded: bool) -> list[kspeed_pb2.ShareRef]:
        """The shares a drain of ``server_id`` hands off, once it is checked that each has somewhere
        to go (changes nothing).

        Raises:
            CapacityError: a share has no ready server with room (and may not go on demand), named
                with what would let the drain go ahead.
        """
        refs = []
        for name in sorted(self._datasets):
            info = self._datasets[name]
            for share in info.shares:
                if share.server_id != server_id:
                    continue
                refs.append(kspeed_pb2.ShareRef(dataset=name, first_id=share.first_id))
                if share.handoff_to or self._targets(info, share, copy_only=not allow_degraded):
                    continue
                need = f"{share.slice_bytes} bytes" if share.slice_bytes else f"{needed_regions(share)} region(s)"
                raise CapacityError(
                    f"cannot drain {server_id}: no ready server has {need} free for samples {share.first_id}.."
                    f"{share.end_id - 1} of dataset {name!r}; start a spare server, remove a dataset, or let a "
                    "survivor serve it on demand (kspeed server drain --allow-degraded)"
                )
        return refs

    def start_drain(self, server_id: str, *, allow_degraded: bool) -> None:
        """Begin handing ``server_id``'s shares off (in the background; see :meth:`continue_drain`)."""
        self._degrade[server_id] = allow_degraded
        self._spawn(self.continue_drain(server_id), f"drain-{server_id}")

    async def continue_drain(self, server_id: str) -> int:
        """Hand each share of a draining server that is not being handed off yet to a ready server
        with room (it loads it while the draining server serves on; :meth:`on_heartbeat` moves it
        once loaded), or, where the drain allows it and no server has room, to a survivor that
        serves it on demand at once. Called again as servers become ready. Returns the handoffs begun."""
        begun = 0
        allow_degraded = self._degrade.get(server_id, False)
        for name in sorted(self._datasets):
            info = self._datasets.get(name)
            if info is None or not any(s.server_id == server_id and not s.handoff_to for s in info.shares):
                continue
            async with self._lock(name):
                for share in info.shares:
                    if share.server_id != server_id or share.handoff_to:
                        continue
                    for target, on_demand in self._targets(info, share, copy_only=not allow_degraded):
                        if not await self._give(info, share, target, on_demand, handoff=not on_demand):
                            continue
                        if on_demand:  # nothing to load: it serves from the backend at once
                            share.server_id, share.on_demand = target.id, True
                            self._changed(info)
                            self.handoffs += 1
                            log.warning(
                                "dataset %s: drain of %s: no server has room for samples %d..%d; %s serves them on "
                                "demand (degraded)",
                                name,
                                server_id,
                                share.first_id,
                                share.end_id - 1,
                                target.id,
                            )
                            self._spawn(self._release_share(info, server_id, share.first_id), f"release-{name}")
                        else:
                            share.handoff_to = target.id
                            self._changed(info)
                            log.info(
                                "dataset %s: drain of %s: %s takes over samples %d..%d (loading while %s serves them)",
                                name,
                                server_id,
                                target.id,
                                share.first_id,
                                share.end_id - 1,
                                server_id,
                            )
                        begun += 1
                        break
        return begun

    def _complete_handoff(self, status: kspeed_pb2.ShareStatus, server_id: str) -> None:
        """Move a share to the server taking it over once that server reports it loaded; the old
        holder is then told to drop it, which ends its feeds there (their clients follow the share)."""
        info = self._datasets.get(status.dataset)
        share = next((s for s in info.shares if s.first_id == status.first_id), None) if info else None
        if info is None or share is None or share.handoff_to != server_id or not _loaded(status, share):
            return
        old = share.server_id
        share.server_id, share.handoff_to = server_id, ""
        self._share_status.pop((info.spec.name, old, share.first_id), None)
        self._changed(info)
        self.handoffs += 1
        log.warning(
            "dataset %s: samples %d..%d handed off from %s to %s",
            info.spec.name,
            share.first_id,
            share.end_id - 1,
            old,
            server_id,
        )
        self._spawn(self._release_share(info, old, share.first_id), f"release-{info.spec.name}")

    async def _release_share(self, info: kspeed_pb2.DatasetInfo, server_id: str, first: int) -> None:
        """Tell ``server_id`` to drop one share of ``info`` that is held elsewhere now (its next
        heartbeat would say so too)."""
        record = next((r for r in self._membership.snapshot() if r.id == server_id), None)
        if record is None or record.state not in SERVING:
            return
        request = kspeed_pb2.DatasetRequest(name=info.spec.name, first_id=first)
        try:
            await self._calls.call(record.address, record.id, "DropDataset", request)
        except KSpeedError as exc:
            log.warning("dataset %s: %s could not drop share %d..: %s", info.spec.name, server_id, first, exc)
