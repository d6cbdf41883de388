"""A server holding several shares of one dataset (after a failover), a share held on demand, and
assignments whose backend listing takes long."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from kspeed.errors import DatasetError, NotFoundError, NotHeldError, ProtocolError
from kspeed.proto import kspeed_pb2
from kspeed.server.backend.sources import open_source
from kspeed.server.hosting import datasets, records
from kspeed.server.hosting.datasets import DatasetHost, fingerprint_pb
from kspeed.server.hosting.records import ASSIGNMENTS_FILE
from kspeed.server.memory import statefile
from kspeed.server.memory.pool import MemoryPool, RegionState
from kspeed.server.memory.statefile import write_atomic as real_write_atomic
from tests.server.datasets import REGION, write_tree

SIZES = [300_000] * 12  # three samples a region: shares of 6 samples take 2 regions each


@pytest.fixture
def tree(tmp_path):
    return write_tree(tmp_path / "ds", SIZES)


def request(backend, tmp_path, first: int, end: int, *, on_demand: bool = False) -> kspeed_pb2.AssignShareRequest:
    spec = kspeed_pb2.DatasetSpec(name="ds", uri=str(tmp_path / "ds"))
    source = open_source(backend, "ds", spec.uri)
    share = kspeed_pb2.Share(
        server_id="s",
        first_id=first,
        end_id=end,
        first_region=first // 3,
        num_regions=(end - first) // 3,
        on_demand=on_demand,
    )
    return kspeed_pb2.AssignShareRequest(spec=spec, fingerprint=fingerprint_pb(source), region_size=REGION, share=share)


def held(pool: MemoryPool) -> list[int]:
    return sorted(r.vindex for r in pool.regions("ds"))


def test_two_shares_of_one_dataset_are_held_apart_and_dropped_apart(tmp_path, backend, pool, tree):
    host = DatasetHost(pool, backend, str(tmp_path))
    keys = sorted(tree)
    host.assign(request(backend, tmp_path, 0, 6))
    host.assign(request(backend, tmp_path, 6, 12))
    assert host.keys() == [("ds", 0), ("ds", 6)] and host.names() == ["ds"]
    assert held(pool) == [0, 1, 2, 3]
    for first in (0, 6):
        host.start_preload("ds", first)
        host.get("ds", first).preloader.wait()
    assert all(r.state is RegionState.SEALED for r in pool.regions("ds"))

    ids = np.arange(12, dtype=np.int64)
    only = host.lookup("ds", ids, 6)
    assert np.frombuffer(only.positions, np.uint32).tolist() == list(range(6, 12))
    both = host.lookup("ds", ids)  # no share named: what this server owns
    assert np.frombuffer(both.positions, np.uint32).tolist() == list(range(12))
    reply = host.read("ds", np.array([11, 0, 7], dtype=np.int64))  # across both shares, in the order asked
    assert reply.data == tree[keys[11]] + tree[keys[0]] + tree[keys[7]]
    assert [s.first_id for s in host.statuses()] == [0, 6]
    with pytest.raises(ProtocolError, match="holds 2 shares"):
        host.get("ds")
    with pytest.raises(NotHeldError, match=r"no share starting at sample 3 \(holds 0\.\.5, 6\.\.11\)"):
        host.get("ds", 3)

    dropped = []
    host.on_drop = lambda name, first, reason: dropped.append((name, first, reason))
    host.drop("ds", final=False, first=0)
    assert dropped == [("ds", 0, "")]
    assert host.keys() == [("ds", 6)] and held(pool) == [2, 3]  # the other share keeps its copy
    assert host.get("ds").store.read(7) == tree[keys[7]]
    assert host.status("ds").progress.samples_loaded == 6
    with pytest.raises(NotHeldError, match=r"no share starting at sample 0 \(holds 6\.\.11\)"):
        host.get("ds", 0)  # moved elsewhere: what a client asking about it hears (and follows)
    host.drop("ds", final=False, first=6)
    with pytest.raises(NotHeldError, match="holds nothing of it: its share is served elsewhere now"):
        host.lookup("ds", ids, 6)
    with pytest.raises(NotFoundError, match="not hosted on this server") as raised:
        host.get("ds")
    assert not isinstance(raised.value, NotHeldError)
    with pytest.raises(ProtocolError):
        host.get("no such name!", 0)


def test_restart_readopts_every_share_of_a_dataset(tmp_path, backend, tree):
    pool = MemoryPool.create(tmp_path / "pool", 8 * REGION, region_size=REGION)
    host = DatasetHost(pool, backend, str(tmp_path))
    for first in (0, 6):
        host.assign(request(backend, tmp_path, first, first + 6))
        host.start_preload("ds", first)
        host.get("ds", first).preloader.wait()
    host.close()
    pool.close()

    again = MemoryPool.adopt(tmp_path / "pool", region_size=REGION)
    try:
        restarted = DatasetHost(again, backend, str(tmp_path))
        restarted.restore()
        assert restarted.keys() == [("ds", 0), ("ds", 6)]
        assert held(again) == [0, 1, 2, 3]
        for first in (0, 6):  # nothing to read again: both shares' sealed regions were kept
            assert restarted.status("ds", first).progress.samples_loaded == 6
    finally:
        again.destroy()


def test_a_share_held_on_demand_takes_no_region_and_reads_from_the_backend(tmp_path, backend, pool, tree):
    host = DatasetHost(pool, backend, str(tmp_path))
    keys = sorted(tree)
    host.assign(request(backend, tmp_path, 6, 12))
    host.assign(request(backend, tmp_path, 0, 6, on_demand=True))
    assert held(pool) == [2, 3]  # only the share with a copy
    status = host.start_preload("ds", 0)  # loads nothing: there is no home to load into
    assert not status.progress.running and status.progress.samples_loaded == 0
    assert host.get("ds", 0).on_demand and not host.get("ds", 6).on_demand
    assert host.read("ds", np.array([2], dtype=np.int64)).data == tree[keys[2]]
    with pytest.raises(Exception, match="held on demand"):
        host.get("ds", 0).preloader.home(np.array([2]))
    host.drop("ds", final=False, first=0)
    assert held(pool) == [2, 3] and host.keys() == [("ds", 6)]


def test_registration_drops_what_the_manager_moved_but_keeps_what_it_assigned_meanwhile(tmp_path, backend, pool, tree):
    host = DatasetHost(pool, backend, str(tmp_path))
    host.assign(request(backend, tmp_path, 0, 6))  # held before the server registers again
    mark = host.assignments  # the registration is sent ...
    host.assign(request(backend, tmp_path, 6, 12))  # ... and the manager assigns a share before it answers
    host.reconcile([], before=mark)  # the reply lists neither
    assert host.keys() == [("ds", 6)]
    host.reconcile([])  # without a mark, the reply is the whole truth
    assert host.keys() == []


class BlockedListing:
    """Stands in for :func:`open_source` in :mod:`kspeed.server.hosting.datasets`: each listing says it
    started, then waits until the test lets it go (as a backend that takes minutes to list)."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.go = threading.Event()
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.started.release()
        assert self.go.wait(60), "the test never let the listing go"
        return open_source(*args, **kwargs)


def in_thread(call) -> tuple[threading.Thread, list]:
    """Run ``call`` on a thread; returns it and the list its result (or error) lands in."""
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # handed to the test through ``out``
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_slow_listing_leaves_heartbeats_and_status_calls_answered(tmp_path, backend, pool, tree, monkeypatch):
    host = DatasetHost(pool, backend, str(tmp_path))
    host.assign(request(backend, tmp_path, 0, 6))
    host.start_preload("ds", 0)
    host.get("ds", 0).preloader.wait()
    second = request(backend, tmp_path, 6, 12)
    listing = BlockedListing()
    monkeypatch.setattr(datasets, "open_source", listing)

    assigning, assigned = in_thread(lambda: host.assign(second))
    assert listing.started.acquire(timeout=30)
    # What a heartbeat, a status call and a client's read need, while the backend is still being listed.
    asking, answers = in_thread(
        lambda: (host.statuses(), host.status("ds", 0), host.memory_used(), host.read("ds", np.array([1])))
    )
    asking.join(30)
    still_listing = not listing.go.is_set() and assigning.is_alive()
    listing.go.set()
    assigning.join(30)
    assert still_listing and answers, "a status call waited for the listing of another share"
    statuses, status, used, read = answers[0]
    assert [s.first_id for s in statuses] == [0] and status.progress.samples_loaded == 6
    assert used == 2 * REGION and read.data == tree[sorted(tree)[1]]
    assert assigned and assigned[0].first_id == 6 and host.keys() == [("ds", 0), ("ds", 6)]
    assert held(pool) == [0, 1, 2, 3]


class BlockedWrite:
    """Stands in for the durable write of the state file ``only``, held until the test lets it go (a
    sync on a busy disk); other state files are written at once."""

    def __init__(self, only) -> None:
        self.only = str(only)
        self.started, self.go = threading.Event(), threading.Event()
        self.paths: list[str] = []

    def __call__(self, path, data) -> None:
        if str(path) != self.only:
            real_write_atomic(path, data)
            return
        self.paths.append(str(path))
        self.started.set()
        assert self.go.wait(60), "the test never let the write go"
        real_write_atomic(path, data)


def test_a_slow_record_of_an_assignment_leaves_heartbeats_answered(tmp_path, backend, pool, tree, monkeypatch):
    host = DatasetHost(pool, backend, str(tmp_path))
    host.assign(request(backend, tmp_path, 0, 6))
    writing = BlockedWrite(tmp_path / ASSIGNMENTS_FILE)
    monkeypatch.setattr(statefile, "write_atomic", writing)

    assigning, assigned = in_thread(lambda: host.assign(request(backend, tmp_path, 6, 12)))
    assert writing.started.wait(30)
    asking, answers = in_thread(lambda: (host.statuses(), host.keys(), host.memory_used()))
    asking.join(30)
    still_writing = not writing.go.is_set() and assigning.is_alive()
    writing.go.set()
    assigning.join(30)
    assert still_writing and answers, "a heartbeat's calls waited for the assignments file to be written"
    statuses, keys, _ = answers[0]
    assert [s.first_id for s in statuses] == [0] and keys == [("ds", 0)]  # recorded ahead, not held yet
    assert assigned and assigned[0].first_id == 6 and host.keys() == [("ds", 0), ("ds", 6)]
    assert writing.paths == [str(tmp_path / ASSIGNMENTS_FILE)]  # written once, before the share was held
    assert sorted(json.loads((tmp_path / ASSIGNMENTS_FILE).read_text())) == ["ds@0", "ds@6"]


def test_a_record_taken_before_a_newer_one_was_written_is_not_written_over_it(tmp_path):
    recs = records.AssignmentRecords(str(tmp_path))
    share = kspeed_pb2.AssignShareRequest(spec=kspeed_pb2.DatasetSpec(name="ds"), share=kspeed_pb2.Share(first_id=6))
    older = recs.snapshot([])
    newer = recs.snapshot([share])
    recs.write(newer)
    recs.write(older)  # the thread that took it was slower to the file: what it says is out of date
    assert [(r.spec.name, r.share.first_id) for r in recs.load()] == [("ds", 6)]
    recs.write(recs.snapshot([]))
    assert recs.load() == []


def test_two_assignments_of_one_share_at_once_take_it_once(tmp_path, backend, pool, tree, monkeypatch):
    host = DatasetHost(pool, backend, str(tmp_path))
    share = request(backend, tmp_path, 0, 6)
    listing = BlockedListing()
    monkeypatch.setattr(datasets, "open_source", listing)
    first, first_out = in_thread(lambda: host.assign(share))
    assert listing.started.acquire(timeout=30)
    second, second_out = in_thread(lambda: host.assign(share))  # e.g. a retake beside the manager's call
    listing.go.set()
    first.join(30)
    second.join(30)
    assert [out[0].first_id for out in (first_out, second_out)] == [0, 0]
    assert listing.calls == 1  # the second found the share the first took
    assert host.keys() == [("ds", 0)] and held(pool) == [0, 1] and host.assignments == 2


def test_an_assignment_whose_backend_changed_takes_nothing(tmp_path, backend, pool, tree):
    host = DatasetHost(pool, backend, str(tmp_path))
    host.assign(request(backend, tmp_path, 0, 6))
    share = request(backend, tmp_path, 6, 12)
    (tmp_path / "ds" / sorted(tree)[7]).write_bytes(b"changed")
    with pytest.raises(DatasetError, match="the backend changed since registration"):
        host.assign(share)
    assert host.keys() == [("ds", 0)] and held(pool) == [0, 1]


def test_registration_takes_a_share_it_does_not_hold_in_the_background(tmp_path, backend, pool, tree, monkeypatch):
    # The registration reply is taken in on the thread that heartbeats: a share to list and load
    # (a handoff or a move the server missed while away) must not hold it for the listing.
    host = DatasetHost(pool, backend, str(tmp_path))
    kept = request(backend, tmp_path, 0, 6)
    host.assign(kept)
    listing = BlockedListing()
    monkeypatch.setattr(datasets, "open_source", listing)
    new = request(backend, tmp_path, 6, 12)
    replying, _ = in_thread(lambda: host.reconcile([kept, new]))
    replying.join(10)
    returned = not replying.is_alive()
    assert listing.started.acquire(timeout=30)  # the new share is being listed ...
    listing.go.set()
    assert returned, "the registration waited for a listing"  # ... and the reply was taken in meanwhile
    deadline = time.monotonic() + 30
    while host.keys() != [("ds", 0), ("ds", 6)] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host.keys() == [("ds", 0), ("ds", 6)]
    host.close()
