"""Fencing, stale generations, server errors, silence, misuse: each a clear error or a counted no-op."""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest
from torch.utils.data import DataLoader

from kspeed import grants
from kspeed.cli.cluster import wait_for
from kspeed.client.feeding.rail_choice import ServerPlace, choose_rail, needs_pacing
from kspeed.client.options import FeedOptions
from kspeed.errors import (
    ConfigError,
    DatasetError,
    PeerLostError,
    RailUnavailableError,
    StateError,
    TransportError,
    UnavailableError,
)
from kspeed.rdma.base import Completions
from kspeed.rdma.rails import available_rails, capabilities
from tests.client.conftest import N_SAMPLES
from tests.client.fakes import FakeServer, client_config, open_dataset


def test_stale_generation_completions_are_ignored(make_ds, samples):
    ds, fakes = make_ds()
    fakes[0].stale_first = True  # each real completion is preceded by one of the previous generation
    batches = list(ds)
    assert len(batches) == len(ds)
    for batch in batches:
        for i, sid in enumerate(batch.ids.tolist()):
            assert batch.numpy(i).tobytes() == samples[sid]
    stats = ds.stats()
    owed_by_s0 = int(ds._pump._current.owed[0].sum())
    assert stats["stale_completions"] >= owed_by_s0 and stats["completions"] >= len(ds)


def test_fence_quarantines_and_ignores_the_old_generation(make_ds):
    ds, fakes = make_ds(ring_bytes=1 << 20)
    fakes[1].silent = True  # grants to s1 stay outstanding
    it = iter(ds)
    feed = ds._feed
    feed.poll(0.2)
    path = feed.paths[1]
    old_generation, conn = path.generation, path.conn
    outstanding = [tag for tag, entry in feed.outstanding.items() if entry.path == 1]
    assert outstanding and all(grants.tag_generation(t) == old_generation for t in outstanding)
    fenced = {
        (slot.offset, slot.offset + feed.allocator.footprint(int(slot.plan.layout.batch_bytes[slot.batch])))
        for slot in (feed.outstanding[t].slot for t in outstanding)
    }

    assert ds.fence("s1", "declared failed in a test") == len(outstanding)
    assert path.generation == old_generation + 1
    deadline = time.monotonic() + 5  # paced, the pacing thread (the receiver's only user) cuts it within a tick
    while conn in feed.receiver.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn not in feed.receiver.connections
    quarantined = feed.allocator.quarantined
    assert quarantined > 0
    # A completion of the old generation that arrives late changes nothing.
    # Under the feed's lock, so s0's completions, which keep arriving, are not counted in between.
    with feed.lock:
        before = feed.stats()
        feed.accept(Completions(np.array([outstanding[0]], np.uint32), np.array([conn], np.uint32)))
        after = feed.stats()
    assert after["stale_completions"] == before["stale_completions"] + 1
    assert after["completions"] == before["completions"]
    # The quarantined ranges are never handed out again.
    taken = []
    while (offset := feed.allocator.reserve(4096)) is not None:
        taken.append(offset)
    assert taken
    assert not [o for o in taken for lo, hi in fenced if o < hi and lo < o + 4096]
    assert feed.allocator.quarantined == quarantined
    with pytest.raises(PeerLostError, match=r"s1 .*declared failed in a test"):
        next(it)


def test_server_error_names_batch_and_reason(make_ds):
    ds, fakes = make_ds()
    fakes[0].refuse = {2}
    it = iter(ds)
    next(it)
    next(it)
    with pytest.raises(DatasetError, match=r"batch 2 of epoch 0 failed on server s0 .*batch 2 refused by s0"):
        next(it)


def test_silent_server_is_named_not_a_hang(make_ds):
    ds, fakes = make_ds(config=client_config(completion_timeout="0.5s"))
    fakes[1].silent = True
    with pytest.raises(TransportError, match=r"server s1 at 127.0.0.1:1 sent no completion for batch 0 of epoch 0"):
        next(iter(ds))


def test_a_server_that_closes_the_feed_on_purpose_is_a_lost_path_not_a_long_silence(make_ds):
    ds, fakes = make_ds(config=client_config(completion_timeout="60s"))
    fakes[1].silent = True  # grants to s1 stay outstanding ...
    closing = threading.Timer(0.5, fakes[1]._close_writer)  # ... until it says bye (its share moved)
    closing.start()
    started = time.monotonic()
    try:
        with pytest.raises(PeerLostError, match=r"server s1 at 127\.0\.0\.1:1"):
            next(iter(ds))
    finally:
        closing.join()
    assert time.monotonic() - started < 30  # noticed at once, not after completion_timeout
    assert ds._feed.paths[1].lost.startswith("its server closed the feed")


def test_a_server_that_no_longer_holds_the_share_is_a_lost_path(make_ds):
    # The manager moved s1's share (a spare took over what a survivor served on demand) before the
    # feed there was closed: the next plan's lookup is what finds out. A lost path (carried over
    # with failover), not a dataset error.
    ds, fakes = make_ds()
    fakes[1].moved = True
    with pytest.raises(
        PeerLostError, match=r"server s1 at 127\.0\.0\.1:1: .*holds no share starting at sample 101"
    ) as lost:
        next(iter(ds))
    assert (lost.value.server_id, lost.value.first_id) == ("s1", fakes[1].lo)


def test_batch_size_and_ring_size_are_checked(make_ds):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
            make_ds(batch_size=bad)
    with pytest.raises(ConfigError, match="ring_bytes"):
        make_ds(ring_bytes=-5)


def test_iteration_after_close(make_ds):
    ds, fakes = make_ds()
    it = iter(ds)
    next(it)
    ds.close()
    assert all(f.closed_feeds == 1 for f in fakes)
    with pytest.raises(StateError, match="closed"):
        next(it)
    with pytest.raises(StateError, match="closed"):
        iter(ds)


def test_worker_processes_are_refused_with_the_reason(make_ds):
    ds, _ = make_ds()
    with pytest.raises(StateError, match=r"num_workers > 0.*do not survive fork"):
        pickle.dumps(ds)
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(StateError, match="num_workers"):
        next(iter(loader))
    forked = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(StateError, match="num_workers"):
        next(iter(forked))
    assert len(list(DataLoader(ds, batch_size=None))) == len(ds)  # in-process use works


def test_a_new_iteration_supersedes_the_old_one(make_ds):
    ds, _ = make_ds()
    first = iter(ds)
    next(first)
    second = iter(ds)
    with pytest.raises(StateError, match="superseded"):
        next(first)
    assert len(list(second)) == len(ds)


class NoFailover:
    """Stands in for a failover that replaced no path (the pump's re-grant alone is tested)."""

    def recommit(self, plan, replaced, first_batch=0) -> None:
        assert replaced == []


def test_the_next_epochs_plan_made_before_a_failover_is_let_go_and_made_again(make_ds, samples):
    # After a failover the plans in use are committed again; the next epoch's, made early by the
    # planner thread with the old servers, is made again. The servers that took it must let it
    # go: a share held under a memory policy follows its plans in order, and one never granted
    # held back every plan after it (the survivor of a kill stopped producing at the next epoch).
    ds, fakes = make_ds(ring_bytes=128 << 10)  # a few batches: the early plan stays a future until its epoch
    ds.set_epoch(0)
    it = iter(ds)
    got = [next(it).ids.tolist()]
    pump = ds._pump
    early = pump._future.result(timeout=10)  # the next epoch's plan, committed everywhere
    assert all(early.feed_epoch in fake.plans for fake in fakes)
    pump.failover = NoFailover()
    pump._grant_again([])  # as after a failover
    pump.failover = None
    wait_for(lambda: all(early.feed_epoch not in fake.plans for fake in fakes), 10, "the early plan let go")
    got += [batch.ids.tolist() for batch in it]
    ds.set_epoch(1)
    again = [batch.ids.tolist() for batch in ds]
    assert sorted(i for ids in got for i in ids) == sorted(i for ids in again for i in ids) == list(range(len(samples)))
    assert pump._plans[1].feed_epoch > early.feed_epoch  # (made again, with the servers of now)


def test_a_plan_committed_to_some_servers_only_is_let_go_there(make_ds, monkeypatch):
    # A server lost while a plan is committed: the others took it and would follow it, never
    # granted, ahead of the plans that are; the planner tells them to let it go.
    ds, fakes = make_ds(ring_bytes=128 << 10)
    next(iter(ds))
    ds._pump._future.result(timeout=10)  # (the next epoch's plan, made early)
    committed = []
    take = fakes[0].commit_plan

    def recorded(feed_id, plan):
        committed.append(plan.feed_epoch)
        return take(feed_id, plan)

    def lost(feed_id, plan):
        raise UnavailableError(f"{fakes[1].name} is gone")

    monkeypatch.setattr(fakes[0], "commit_plan", recorded)
    monkeypatch.setattr(fakes[1], "commit_plan", lost)
    with pytest.raises(PeerLostError, match="is gone"):
        ds._pump._plan_epoch(3)
    assert len(committed) == 1
    wait_for(lambda: committed[0] not in fakes[0].plans, 10, "the pass let go on the server that took it")


class Unanswering(FakeServer):
    """A server that took a share over and never answers a lookup: the call ends only when the
    link is closed, as closing a gRPC channel ends the calls in flight on it."""

    def __init__(self, like: FakeServer) -> None:
        super().__init__(like.server_id, like.samples, like.lo, like.hi)
        self.asked, self.closed = threading.Event(), threading.Event()

    def lookup(self, dataset, ids):
        self.asked.set()
        self.closed.wait(60)
        raise UnavailableError(f"{self.name}: the call was cancelled, its channel closed")

    def close(self) -> None:
        self.closed.set()
        super().close()


def test_a_closed_dataset_leaves_no_planning_thread_behind(make_ds):
    # A plan made ahead on the server that took a share over (a failover's link, not one the
    # dataset opened with) that never answers: closing the dataset closes every link it uses,
    # which ends the call, and waits for the planner thread. Left running, a non-daemon thread
    # held the interpreter's exit until the call's deadline, or for good.
    ds, fakes = make_ds(ring_bytes=128 << 10)
    next(iter(ds))
    pump = ds._pump
    pump._future.result(timeout=10)  # (the next epoch's plan, made early)
    stuck = Unanswering(fakes[0])
    ds._parts.planner.replace_link(0, stuck, ds._parts.feed.paths[0].feed_id)
    pump._prefetch(2)  # planned ahead, on the planner thread
    try:
        assert stuck.asked.wait(10)
        planners = list(pump._planner._threads)
        ds.close()
        assert stuck.closed.is_set()
        assert not [t.name for t in planners if t.is_alive()]
    finally:
        stuck.close()


def test_rail_choice_and_forced_rails():
    local = {"a": ServerPlace("127.0.0.1:7071"), "b": ServerPlace("10.9.9.9:7071", "elsewhere")}
    choice = choose_rail(local)
    assert choice.rail == "tcp"
    assert "remote" in choice.reasons["b"] and "one ring has one rail" in choice.reasons["a"]
    assert choose_rail({"a": local["a"]}).rail == "shm"
    with pytest.raises(RailUnavailableError, match=r"cannot reach server b at 10.9.9.9:7071.*on this host.*available"):
        choose_rail(local, "shm")
    with pytest.raises(RailUnavailableError, match=r"rail 'verbs' is unavailable: no RDMA device.*offers"):
        choose_rail(local, "verbs")
    # A server that offers only tcp is fed over tcp even on this host; one that offers no usable rail is refused.
    assert choose_rail({"a": ServerPlace("127.0.0.1:7071", rails=("tcp",))}).rail == "tcp"
    with pytest.raises(RailUnavailableError, match=r"no rail usable on this host reaches every server"):
        choose_rail({"a": ServerPlace("127.0.0.1:7071", rails=("verbs",))})


def test_rails_are_chosen_and_paced_by_capabilities_not_names():
    local, remote = ServerPlace("127.0.0.1:1"), ServerPlace("10.9.9.9:1", "elsewhere")
    host_local = [name for name in available_rails() if capabilities(name).host_local]
    network = [name for name in available_rails() if not capabilities(name).host_local]
    assert host_local and network
    assert choose_rail({"a": local}).rail == host_local[0]
    assert choose_rail({"a": local, "b": remote}).rail == network[0]
    assert not needs_pacing(host_local[0], {"a": local})
    assert not needs_pacing(network[0], {"a": local})  # loopback crosses no link
    assert needs_pacing(network[0], {"a": local, "b": remote}) == capabilities(network[0]).needs_pacing


def test_unknown_rail_is_refused_before_anything_opens(samples):
    from tests.client.fakes import FakeServer, fake_info

    fake = FakeServer("s0", samples, 0, len(samples))
    with pytest.raises(RailUnavailableError, match="carrier-pigeon"):
        open_dataset(
            fake_info(samples, [("s0", 0, len(samples))]),
            [fake],
            config=client_config(),
            options=FeedOptions(batch_size=4, rail="carrier-pigeon"),
        )
    assert fake.generation == 0  # no OpenFeed was sent


def test_a_failing_pacing_thread_is_named_not_a_hang(make_ds):
    ds, _ = make_ds()
    pacer = getattr(ds._feed.granting, "pacer", None)
    if pacer is None:
        pytest.skip("unpaced feeds have no pacing thread")

    def broken(now=None):
        raise RuntimeError("model exploded")

    pacer.release = broken
    with pytest.raises(TransportError, match=r"pacing thread failed: RuntimeError.*model exploded"):
        next(iter(ds))


def test_drop_last_with_a_batch_larger_than_the_epoch_is_refused(make_ds):
    # DataLoader yields no batch at all here; a training loop would run empty epochs silently.
    with pytest.raises(ConfigError, match=r"drop_last=True with batch_size=500 would drop every sample") as info:
        make_ds(batch_size=500, drop_last=True)
    assert f"this rank gets {N_SAMPLES} per epoch" in str(info.value)
    with pytest.raises(ConfigError, match=r"\(203 samples over 2 ranks\)"):
        make_ds(batch_size=103, drop_last=True, rank=0, world_size=2)  # 102 each (DistributedSampler pads)


def test_a_batch_larger_than_the_epoch_needs_only_the_epochs_ring_space(make_ds, samples):
    # batch_size=10**6 of 203 samples: one batch of all of them, in an explicit 1 MiB ring, as DataLoader gives.
    config = client_config(ring_max_bytes=64 << 20)
    ds, _ = make_ds(batch_size=10**6, ring_bytes=1 << 20, config=config, shuffle=False)
    batches = [[bytes(s.numpy()) for s in batch.samples] for batch in ds]
    assert len(ds) == 1 and batches == [samples]
