"""An in-process server double that speaks docs/feeding.md through the real rails.

:class:`FakeServer` answers the client's control-plane calls (lookup, OpenFeed, CommitPlan,
CloseFeed) from an in-memory dataset and serves grants from a thread with a real rail writer:
HELLO, one write per owned sample with the grant's tag on the last one, ERROR for a grant it
cannot serve. Knobs make it misbehave on purpose (stay silent, send a stale-generation completion
first, refuse a batch).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kspeed import grants
from kspeed.client.dataset import KSpeedDataset
from kspeed.client.feeding.builder import build_feed
from kspeed.client.feeding.links import ServerPlan
from kspeed.config import ClientConfig, load_config
from kspeed.errors import KSpeedError, NotFoundError, NotHeldError, ProtocolError
from kspeed.layout import batch_starts
from kspeed.proto import kspeed_pb2
from kspeed.rdma.base import RegionKey
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail
from kspeed.server.positions import Positions


def make_samples(n: int, seed: int = 0, max_size: int = 3000) -> list[bytes]:
    """``n`` random samples of varied sizes (zero-length and odd sizes included)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, max_size, n)
    sizes[0] = 0
    return [rng.integers(0, 256, int(s), dtype=np.uint8).tobytes() for s in sizes]


@dataclass
class _Plan:
    starts: np.ndarray
    positions: np.ndarray
    offsets: np.ndarray
    ids: np.ndarray


class FakeServer:
    """Owns samples ``[lo, hi)`` of ``samples``; labels are ``id % 7``.

    Attributes:
        silent: ignore grants (the client must time out naming this server).
        moved: answer lookups as a server the manager took the share from does (``NotHeldError``).
        stale_first: before each real completion, send one whose tag carries an older generation.
        refuse: batch numbers answered with ERROR.
        grant_log: ``(epoch, batch)`` of every grant received, in order.
    """

    def __init__(self, server_id: str, samples: list[bytes], lo: int, hi: int, *, dataset: str = "fake") -> None:
        self.server_id = server_id
        self.first_id = lo
        self.end_id = hi
        self.address = "127.0.0.1:1"
        self.name = f"server {server_id} at {self.address}"
        self.dataset = dataset
        self.samples = samples
        self.lo, self.hi = lo, hi
        self.silent = False
        self.moved = False
        self.kept = Positions()  # live positions (kspeed/server/positions.py)
        self.stale_first = False
        self.refuse: set[int] = set()
        self.grant_log: list[tuple[int, int]] = []
        self.plans: dict[int, _Plan] = {}
        self.generation = 0
        self._writer = None
        self._key: RegionKey | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed_feeds = 0
        self.looked_up = 0  # IDs asked about in lookups

    # -- control plane ---------------------------------------------------------------------------

    def lookup(self, dataset: str, ids: np.ndarray):
        if dataset != self.dataset:
            raise NotFoundError(f"dataset {dataset!r} is not hosted on {self.server_id}")
        if self.moved:
            raise NotHeldError(
                f"{self.name}: dataset {dataset!r}: this server holds no share starting at sample {self.lo}"
            )
        self.looked_up += len(ids)
        mask = (ids >= self.lo) & (ids < self.hi)
        owned = ids[mask]
        lengths = np.array([len(self.samples[i]) for i in owned.tolist()], dtype=np.int64)
        return np.flatnonzero(mask).astype(np.int64), lengths, (owned % 7).astype(np.int64)

    def open_feed(self, request: kspeed_pb2.OpenFeedRequest) -> kspeed_pb2.OpenFeedReply:
        self._close_writer()
        self.generation = request.generation
        self._key = RegionKey.from_bytes(request.ring_key)
        self._writer = get_rail(request.rail).connect(request.material, RailOptions(io_timeout=5.0))
        self._writer.send(grants.encode_hello(grants.Hello(request.feed_id, self.server_id, request.generation)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(self._writer, self._stop), daemon=True)
        self._thread.start()
        return kspeed_pb2.OpenFeedReply(server_id=self.server_id)

    def commit_plan(self, feed_id: str, plan: ServerPlan):
        if plan.split is not None:
            raise ProtocolError(f"{self.server_id}: this fake server runs no pipeline stages")
        if ((plan.ids < self.lo) | (plan.ids >= self.hi)).any():
            raise ProtocolError(f"{self.server_id}: a plan names samples outside [{self.lo}, {self.hi})")
        starts = batch_starts(plan.count, plan.batch_size)
        self.plans[plan.feed_epoch] = _Plan(starts, plan.positions.copy(), plan.offsets.copy(), plan.ids.copy())
        return kspeed_pb2.PlanReply(owned=len(plan.ids))

    def prep_figures(self, job: str = "") -> kspeed_pb2.PrepFigures | None:
        return None  # runs no pipeline stages

    def production_figures(self, dataset: str) -> kspeed_pb2.ProductionFigures | None:
        return None  # like a server that predates them

    def close_feed(self, feed_id: str) -> None:
        self.closed_feeds += 1
        self._close_writer()

    def keep_position(self, position: kspeed_pb2.Position) -> Callable[[], None]:
        self.kept.keep(position)  # (the server's own store)
        return lambda: None

    def positions(self, dataset: str, job: str) -> list[kspeed_pb2.Position]:
        return self.kept.of(dataset, job)

    def close(self) -> None:
        self._close_writer()

    def _close_writer(self) -> None:
        """Stop the serving thread; it closes its writer (never closed under a write in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=0.5)
            if self._thread.is_alive() and self._writer is not None:
                self._writer.interrupt()  # blocked on a client that stopped reading
            self._thread.join(timeout=10)
            assert not self._thread.is_alive(), f"fake {self.server_id}: serving thread did not stop"
        self._thread = None
        self._writer = None

    # -- data plane ------------------------------------------------------------------------------

    def _serve(self, writer, stop: threading.Event) -> None:
        try:
            with contextlib.suppress(KSpeedError):
                while not stop.is_set():
                    message = writer.recv(0.05)
                    if message is None:
                        continue
                    decoded = grants.decode(message)
                    if isinstance(decoded, grants.DropPlan):
                        self.plans.pop(decoded.epoch, None)
                    if not isinstance(decoded, np.ndarray):
                        continue
                    for grant in decoded:
                        self._answer(writer, grant)
        finally:
            with contextlib.suppress(KSpeedError):
                writer.close()

    def _answer(self, writer, grant) -> None:
        epoch, batch, tag = int(grant["epoch"]), int(grant["batch"]), int(grant["tag"])
        if self.silent:
            return
        if epoch == grants.PROBE_EPOCH:  # pacing's latency probe: filler, one completion
            writer.write(self._key, bytes(int(grant["end"])), int(grant["ring_offset"]), imm=tag)
            return
        self.grant_log.append((epoch, batch))
        plan = self.plans.get(epoch)
        if plan is None or batch in self.refuse:
            refusal = grants.GrantError(epoch, batch, tag, f"batch {batch} refused by {self.server_id}")
            writer.send(grants.encode_error(refusal))
            return
        base = int(grant["ring_offset"])
        lo = int(plan.starts[batch]) + int(grant["first"])
        hi = min(int(plan.starts[batch]) + int(grant["end"]), int(plan.starts[batch + 1]))
        i, j = np.searchsorted(plan.positions, (lo, hi))
        ops = [(self.samples[int(plan.ids[k])], base + int(plan.offsets[k]), None) for k in range(i, j)]
        if self.stale_first:
            stale = grants.make_tag((self.generation - 2) % 255 + 1, tag & 0xFFFFFF)  # the previous generation
            writer.write(self._key, b"", base, imm=stale)
        if ops:
            ops[-1] = (ops[-1][0], ops[-1][1], tag)
            writer.write_many(self._key, ops)
        else:
            writer.write(self._key, b"", base, imm=tag)


def fake_info(
    samples: list[bytes], shares: list[tuple[str, int, int]], *, name: str = "fake", labels: str = "dirname"
) -> kspeed_pb2.DatasetInfo:
    """A DatasetInfo as the manager would describe the fake dataset."""
    info = kspeed_pb2.DatasetInfo(
        spec=kspeed_pb2.DatasetSpec(name=name, uri="/fake", labels=labels),
        fingerprint=kspeed_pb2.Fingerprint(count=len(samples), total_bytes=sum(map(len, samples))),
    )
    for sid, lo, hi in shares:
        info.shares.add(server_id=sid, first_id=lo, end_id=hi)
        info.server_addresses[sid] = "127.0.0.1:1"
    return info


def client_config(**overrides) -> ClientConfig:
    """A client configuration without auth, with ``overrides`` applied."""
    return load_config(ClientConfig, environ={}, overrides={"security.auth": "none", **overrides})


def open_dataset(info: kspeed_pb2.DatasetInfo, links: list, *, config: ClientConfig, options) -> KSpeedDataset:
    """A KSpeedDataset fed by ``links`` (fakes), as ``KSpeedClient.dataset`` builds one."""
    return KSpeedDataset(info, build_feed(info, links, config=config, options=options), options=options)
