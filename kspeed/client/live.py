"""A rank's position kept by the servers as the epoch goes, and a live resume from it (docs/resume.md).

With ``resume="live"`` every batch a rank is handed sends its position (the dataset's
``state_dict()``) to :data:`REPLICAS` of the dataset's servers before the batch is returned, and
a job that opens the dataset again under the same job name (a torchrun restart keeps its run ID)
continues each rank's epoch from where the job's ranks had got: the newest pass any rank
reported, each rank at its own last position (a rank that reported none of that pass at none of
it). What the training loop was handed counts as consumed; nothing else needs saving.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kspeed.client.feeding.links import Link
from kspeed.errors import KSpeedError
from kspeed.proto import kspeed_pb2

__all__ = ["REPLICAS", "LivePositions", "newest_state"]

log = logging.getLogger(__name__)

REPLICAS = 2  # servers that keep each rank's position: one may be lost without losing it
DOWN_S = 10.0  # seconds a server that did not keep a position is passed over (the others keep it)


class LivePositions:
    """Sends a rank's positions to the servers, and reads a job's back.

    Args:
        dataset: the dataset's name.
        job: the job's name, shared by its ranks and across its restarts.
        links: the dataset's servers now (a failover replaces some).
    """

    def __init__(self, dataset: str, job: str, links: Callable[[], list[Link]]) -> None:
        self.dataset, self.job = dataset, job
        self._links = links
        self._down: dict[str, float] = {}  # server ID -> until when it is passed over
        self.kept = 0
        self.missed = 0

    def keep(self, state: Mapping[str, Any]) -> None:
        """Have :data:`REPLICAS` servers keep ``state`` (``rank`` of ``world_size``) before it returns;
        a position no server took is logged (a live resume would then repeat the batches since the
        last one kept), never raised: training goes on."""
        rank, world = int(state["rank"]), int(state["world_size"])
        position = kspeed_pb2.Position(
            dataset=self.dataset,
            job=self.job,
            world_size=world,
            rank=rank,
            state=json.dumps(state, separators=(",", ":")).encode(),
        )
        now = time.monotonic()
        up = sorted((k for k in self._links() if self._down.get(k.server_id, 0.0) <= now), key=lambda k: k.server_id)
        chosen = [up[(rank + k) % len(up)] for k in range(min(REPLICAS, len(up)))]
        took, failure = 0, ""
        calls = []
        for link in chosen:  # (sent to every one before waiting for any)
            try:
                calls.append((link, link.keep_position(position)))
            except KSpeedError as exc:
                failure = self._failed(link, exc, now)
        for link, answered in calls:
            try:
                answered()
                took += 1
            except KSpeedError as exc:
                failure = self._failed(link, exc, now)
        if took:
            self.kept += 1
            return
        self.missed += 1
        if self.missed in (1, 10, 100) or self.missed % 1000 == 0:
            log.warning(
                "dataset %s: no server kept rank %d's position (%d missed; %s): a live resume would repeat "
                "the batches since the last one kept",
                self.dataset,
                rank,
                self.missed,
                failure or "no server",
            )

    def _failed(self, link: Link, exc: KSpeedError, now: float) -> str:
        """``link`` did not keep a position: it is passed over for :data:`DOWN_S` (a server that
        hangs would otherwise hold every batch for the call's timeout until its failover)."""
        self._down[link.server_id] = now + DOWN_S
        return f"{link.name}: {exc}"

    def load(self) -> dict[str, Any] | None:
        """The job's state to resume from (:func:`newest_state`), or None where no server keeps any."""
        found: list[kspeed_pb2.Position] = []
        for link in self._links():
            try:
                found += link.positions(self.dataset, self.job)
            except KSpeedError as exc:
                log.info("dataset %s: no positions from %s: %s", self.dataset, link.name, exc)
        return newest_state(found)


def newest_state(positions: Iterable[kspeed_pb2.Position]) -> dict[str, Any] | None:
    """One state for the job from its ranks' kept positions: of the newest pass any rank reported
    (the latest epoch, then the most passes over it), each rank at the furthest position it
    reported of that pass (0 where it reported none); malformed states are skipped. None: none."""
    parsed: list[tuple[tuple[int, int], str, dict[str, Any]]] = []
    for p in positions:
        try:
            state = json.loads(p.state)
            passes = state["passes"]
            parsed.append(((int(state["epoch"]), len(passes)), json.dumps(passes[:-1]), state))
        except (ValueError, TypeError, KeyError, IndexError):
            continue
    if not parsed:
        return None
    top = max(when for when, _, _ in parsed)
    newest = [(earlier, state) for when, earlier, state in parsed if when == top]
    earlier, base = max(newest, key=lambda found: sum(found[1]["passes"][-1][1]))
    world = int(base["passes"][-1][0])
    reached = [0] * world
    for other, state in newest:
        last = state["passes"][-1]
        if other != earlier or int(last[0]) != world:
            continue  # (another split of the same epoch: not this pass's ranks)
        rank = int(state["rank"])
        if 0 <= rank < world:
            reached[rank] = max(reached[rank], int(last[1][rank]))
    return {**base, "passes": [*base["passes"][:-1], [world, reached]]}
