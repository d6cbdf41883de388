"""End to end against in-process fake servers over real rails: order, bytes, labels, resume, lifetime."""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from kspeed.errors import CapacityError, ConfigError, StateError
from kspeed.rdma.rails import available_rails
from tests.client.conftest import N_SAMPLES


def check_batch(batch, samples):
    for i, sid in enumerate(batch.ids.tolist()):
        assert batch.numpy(i).tobytes() == samples[sid], f"sample {sid} at position {i} of batch {batch.index}"
        assert int(batch.labels[i]) == sid % 7


def loader_batches(sampler, batch_size, drop_last):
    return [
        b.tolist() for b in DataLoader(range(N_SAMPLES), sampler=sampler, batch_size=batch_size, drop_last=drop_last)
    ]


@pytest.mark.parametrize("rail", available_rails())
@pytest.mark.parametrize(("world", "shuffle", "drop_last"), [(1, True, False), (2, True, True), (2, False, False)])
def test_epochs_match_the_dataloader_byte_for_byte(make_ds, samples, rail, world, shuffle, drop_last):
    for rank in range(world):
        ds, _ = make_ds(rail=rail, rank=rank, world_size=world, shuffle=shuffle, drop_last=drop_last, seed=11)
        assert ds.rail == rail
        reference = DistributedSampler(range(N_SAMPLES), num_replicas=world, rank=rank, shuffle=shuffle, seed=11)
        for epoch in range(3):
            ds.set_epoch(epoch)
            reference.set_epoch(epoch)
            got = []
            for batch in ds:
                check_batch(batch, samples)
                got.append(batch.ids.tolist())
            assert got == loader_batches(reference, 16, drop_last)
            assert len(got) == len(ds)
        assert ds.stats()["stale_completions"] == 0


def test_user_sampler_with_duplicates_in_one_batch(make_ds, samples):
    order = [3, 3, 150, 3, 0, 0, 202]  # duplicates, a zero-length sample, both servers
    ds, _ = make_ds(sampler=order, batch_size=4)
    batches = list(ds)
    assert [b.ids.tolist() for b in batches] == [[3, 3, 150, 3], [0, 0, 202]]
    for batch in batches:
        check_batch(batch, samples)
    first = batches[0]
    assert first.samples[0].data_ptr() != first.samples[1].data_ptr()  # each position has its own bytes


def test_each_server_hears_only_its_own_samples(make_ds, samples):
    # The lookup asks a server only about the IDs of its share, and the plan it is handed holds
    # only its samples: its cost of a boundary is its share of the order, not the whole order.
    ds, fakes = make_ds(servers=3, rank=0, world_size=2, seed=3)
    ds.set_epoch(0)
    batches = [b.ids.tolist() for b in ds]
    order = [i for b in batches for i in b]
    # epoch 1 is planned ahead on a helper thread: count once it is done (with a core kept busy its
    # lookups could be in while its commits were not)
    future = ds._pump._future
    if future is not None:
        future.result(timeout=30)
    passes = len(fakes[0].plans)  # epoch 0, and epoch 1 planned ahead
    assert sum(f.looked_up for f in fakes) == passes * len(order) == passes * ds.samples_per_epoch
    for fake in fakes:
        plan = fake.plans[1]  # the first pass: epoch 0
        assert all(fake.lo <= i < fake.hi for i in plan.ids.tolist())
        assert plan.positions.tolist() == [p for p, i in enumerate(order) if fake.lo <= i < fake.hi]


def test_next_epoch_is_granted_before_the_current_one_ends(make_ds):
    ds, fakes = make_ds(ring_bytes=4 << 20)
    ds.set_epoch(0)
    it = iter(ds)
    next(it)
    # The next epoch is planned on a helper thread while this one is consumed; an epoch of a handful
    # of batches can end before that finishes on a loaded machine, so let the planner finish first.
    future = ds._pump._future  # None once the plan was already taken up
    if future is not None:
        future.result(timeout=30)
    assert future is not None or 1 in ds._pump._plans
    for _ in range(len(ds) - 1):
        next(it)
    # The last batch of epoch 0 is delivered and the ring already holds grants of epoch 1 ...
    assert any(slot.plan.epoch == 1 for slot in ds._pump._queue)
    # ... which the servers receive without the training loop asking (paced: the pacing thread
    # sends them within its window, so they arrive a little later).
    deadline = time.monotonic() + 30
    while len({epoch for fake in fakes for epoch, _ in fake.grant_log}) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len({epoch for fake in fakes for epoch, _ in fake.grant_log}) == 2  # pass 2 (epoch 1) is being written
    ds.set_epoch(1)
    assert len(list(ds)) == len(ds)


def test_random_sampler_state_is_consumed_only_at_epoch_start(make_ds, samples):
    ours = RandomSampler(range(N_SAMPLES), generator=torch.Generator().manual_seed(9))
    theirs = RandomSampler(range(N_SAMPLES), generator=torch.Generator().manual_seed(9))
    ds, _ = make_ds(sampler=ours)
    for _ in range(2):
        expected = loader_batches(theirs, 16, False)
        got = [b.ids.tolist() for b in ds]
        assert got == expected
        assert torch.equal(ours.generator.get_state(), theirs.generator.get_state())


def test_a_batch_reads_int64_and_holds_no_view_of_its_plan(make_ds, samples):
    # The plan keeps narrow arrays; a batch gets int64 copies, so it reads as before and, kept
    # past its epoch, does not keep that epoch's whole plan alive.
    ds, _ = make_ds()
    batch = next(iter(ds))
    plan = ds._pump._current
    assert plan.ids.dtype == np.int32 and plan.lengths.dtype == np.uint32
    assert batch.ids.dtype == torch.int64 and batch.labels.dtype == torch.int64
    assert batch.lengths.dtype == np.int64 and batch._meta.offsets.dtype == np.int64
    for got, whole in ((batch.lengths, plan.lengths), (batch._meta.offsets, plan.layout.offsets)):
        assert not np.shares_memory(got, whole)
    check_batch(batch, samples)


def test_a_plan_given_up_part_way_goes_once_its_granted_batches_settle(make_ds):
    ds, fakes = make_ds()
    for fake in fakes:  # the servers are slow with pass 1 (epoch 0): its grants are still out at the boundary
        answer = fake._answer

        def slow(writer, grant, answer=answer):
            if int(grant["epoch"]) == 1:
                time.sleep(0.02)
            answer(writer, grant)

        fake._answer = slow
    it = iter(ds)
    next(it)  # epoch 0 given up after one batch: the rest of it is granted, then discarded
    given_up = weakref.ref(ds._pump._current)
    del it
    ds.set_epoch(1)
    assert len(list(ds)) == len(ds)  # during epoch 1, not at the next iter()
    gc.collect()
    assert given_up() is None
    assert 0 not in ds._pump._plans


class Uncopyable:
    """A sampler of the user's that cannot be copied (it holds a lock), so its orders cannot be predicted."""

    def __init__(self, n, seed):
        self.n, self.lock = n, threading.Lock()
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        with self.lock:
            return iter(torch.randperm(self.n, generator=self.generator).tolist())

    def __len__(self):
        return self.n


def test_an_unpredictable_samplers_plan_is_let_go_before_the_next_one_is_made(make_ds, caplog):
    ds, _ = make_ds(sampler=Uncopyable(N_SAMPLES, 2))
    assert len(list(ds)) == len(ds)
    previous = weakref.ref(ds._pump._current)
    alive = []
    foresight = ds._pump.foresight
    plan_epoch = foresight._plan_epoch

    def watched(epoch):
        gc.collect()
        alive.append(previous() is not None)
        return plan_epoch(epoch)

    foresight._plan_epoch = watched
    ds.set_epoch(1)
    assert len(list(ds)) == len(ds)
    assert alive == [False]  # two plans of a sampler's orders are never held at once (nothing planned ahead)
    assert ds.stats()["orders_predicted"] == 0
    told = [r.getMessage() for r in caplog.records if "could not be predicted" in r.getMessage()]
    assert len(told) == 1 and "Uncopyable cannot be copied (TypeError" in told[0]  # once, with why


def test_resume_mid_epoch_continues_with_the_rest(make_ds, samples):
    ds, _ = make_ds(rank=1, world_size=2, seed=4)
    ds.set_epoch(2)
    full = []
    state = None
    for i, batch in enumerate(ds):
        full.append(batch.ids.tolist())
        if i == 3:
            state = ds.state_dict()
    assert state["epoch"] == 2 and state["batches"] == 4
    assert len(repr(state)) < 500
    again, _ = make_ds(rank=1, world_size=2, seed=4)
    again.load_state_dict(state)
    again.set_epoch(2)  # the usual loop calls set_epoch on the saved epoch: the position is kept
    rest = [b.ids.tolist() for b in again]
    assert rest == full[4:]
    # Rank 0 given rank 1's state (a checkpoint keeps one rank's copy) continues with its own rest.
    mine, _ = make_ds(rank=0, world_size=2, seed=4)
    mine.set_epoch(2)
    whole = [b.ids.tolist() for b in mine]
    other, _ = make_ds(rank=0, world_size=2, seed=4)
    other.load_state_dict(state)
    other.set_epoch(2)
    assert [b.ids.tolist() for b in other] == whole[4:]


def test_held_batches_keep_their_bytes(make_ds, samples):
    ds, _ = make_ds(ring_bytes=200_000)  # room for a few batches: the ring wraps while three are held
    held = []
    for batch in ds:
        check_batch(batch, samples)
        held.append(batch)
        if len(held) > 3:
            held.pop(0)
        for old in held:
            check_batch(old, samples)
    assert ds.stats()["ring_used"] > 0


def test_views_and_release(make_ds, samples):
    ds, _ = make_ds(sampler=[1, 2, 3, 4], batch_size=4)
    batch = next(iter(ds))
    sid = int(batch.ids[1])
    assert torch.equal(batch.tensor(1), torch.frombuffer(bytearray(samples[sid]), dtype=torch.uint8))
    raw = np.frombuffer(samples[sid][: len(samples[sid]) // 4 * 4], dtype=np.float32)
    if len(samples[sid]) % 4 == 0:
        assert np.array_equal(batch.tensor(1, torch.float32).numpy(), raw, equal_nan=True)
    view = torch.utils.dlpack.from_dlpack(batch.dlpack(1))
    assert view.data_ptr() == batch.samples[1].data_ptr()
    assert batch.numpy(1).ctypes.data == batch.samples[1].data_ptr()  # no copy
    used = ds.stats()["ring_used"]
    del view
    batch.release()
    assert batch.released
    with pytest.raises(StateError, match="released"):
        batch.numpy(0)
    ds._feed.allocator.drain()
    assert ds.stats()["ring_used"] < used


def test_ring_range_is_reclaimed_when_views_are_collected(make_ds):
    ds, _ = make_ds(sampler=list(range(40)), batch_size=40)
    batch = next(iter(ds))
    keep = batch.samples[5]
    used = ds._feed.allocator.used
    del batch
    gc.collect()
    ds._feed.allocator.drain()
    assert ds._feed.allocator.used == used  # one view still alive
    del keep
    gc.collect()
    ds._feed.allocator.drain()
    assert ds._feed.allocator.used < used


def test_equal_length_batches_stack_and_wav(samples):
    from kspeed.client.options import FeedOptions
    from tests.client.fakes import FakeServer, client_config, fake_info, open_dataset

    pcm = np.arange(-50, 50, dtype=np.int16)
    wav = [b"RIFF" + bytes(40) + pcm.tobytes() for _ in range(12)]
    fake = FakeServer("w0", wav, 0, 12)
    ds = open_dataset(
        fake_info(wav, [("w0", 0, 12)]),
        [fake],
        config=client_config(),
        options=FeedOptions(batch_size=6, shuffle=False, ring_bytes=1 << 16, rail="shm"),
    )
    try:
        batch = next(iter(ds))
        assert batch.data.shape == (6, 244)
        assert batch.data[3].data_ptr() == batch.samples[3].data_ptr()
        assert torch.equal(batch.wav(2), torch.from_numpy(pcm))
    finally:
        ds.close()


def test_a_batch_larger_than_the_ring_is_named(make_ds):
    ds, _ = make_ds(ring_bytes=4096, batch_size=16)
    with pytest.raises(CapacityError, match=r"batch \d+ of epoch 0 needs \d+ bytes, more than the receive ring's 4096"):
        iter(ds)


def test_ring_full_of_held_batches_is_an_error_not_a_hang(make_ds):
    ds, _ = make_ds(sampler=list(range(100, 200)), batch_size=10, ring_bytes=3 * 16 * 1024)
    held = []
    with pytest.raises(CapacityError, match=r"full of .* still held"):
        for batch in ds:
            held.append(batch)
    assert len(held) >= 2


def test_a_batch_is_a_pytorch_citizen(make_ds, samples):
    ds, _ = make_ds(batch_size=8, shuffle=False)
    assert len(ds) == -(-N_SAMPLES // 8) and ds.samples_per_epoch == N_SAMPLES  # len() counts batches
    batch = next(iter(ds))
    images, labels = batch  # unpacks as (samples, labels), like (inputs, targets)
    assert images is batch.samples and torch.equal(labels, batch.labels) and len(batch) == 8
    assert batch.to("cpu") is batch and batch.device == torch.device("cpu")
    moved = batch.to("meta")  # a copy on another device: one copy of the range, views of it
    assert moved.device.type == "meta" and [s.numel() for s in moved.samples] == batch.lengths.tolist()
    moved.release()
    assert batch.released  # the copy held the original's range; releasing the copy releases both


def test_dataloader_with_a_batch_size_is_refused_by_name(make_ds):
    ds, _ = make_ds(batch_size=4)
    with pytest.raises(StateError, match=r"DataLoader\(dataset, batch_size=None\).*client.dataset\(.*batch_size"):
        next(iter(DataLoader(ds, batch_size=2)))
    pinned = DataLoader(ds, batch_size=None, pin_memory=True)  # without an accelerator torch skips pinning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sum(len(b) for b in pinned) == N_SAMPLES


def test_a_batch_sampler_is_refused_with_what_to_do(make_ds):
    with pytest.raises(ConfigError, match=r"BatchSampler.*sampler=batch_sampler.sampler"):
        make_ds(sampler=BatchSampler(SequentialSampler(range(N_SAMPLES)), 4, False))

    class Batches:  # a sampler of batches that is not a BatchSampler
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2

    ds, _ = make_ds(sampler=Batches(), batch_size=2)
    with pytest.raises(ConfigError, match="must yield one sample ID at a time"):
        next(iter(ds))


def test_rank_and_world_size_come_from_the_launcher_unless_given(monkeypatch):
    from kspeed.client.planning.sampling import job_rank

    assert job_rank(None, None, {}) == (0, 1, "no process group or launcher (a single process)")
    assert job_rank(None, None, {"RANK": 3, "WORLD_SIZE": 4})[:2] == (3, 4)
    assert job_rank(1, 2, {"RANK": 3, "WORLD_SIZE": 4}) == (1, 2, "given")
    assert job_rank(None, 8, {"RANK": 3, "WORLD_SIZE": 4})[:2] == (3, 8)  # what is given wins, per field


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # torchrun (it sets RANK too; these alone say as much on nodes of equal size)
        ({"GROUP_RANK": 1, "LOCAL_RANK": 2, "LOCAL_WORLD_SIZE": 4, "WORLD_SIZE": 8}, (6, 8)),
        # PyTorch Lightning's NODE_RANK, with LOCAL_WORLD_SIZE from the cluster's environment
        ({"NODE_RANK": 2, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2, "WORLD_SIZE": 6}, (5, 6)),
        ({"LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2, "WORLD_SIZE": 2}, (1, 2)),  # one node
        ({"RANK": 5, "WORLD_SIZE": 6, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2}, (5, 6)),  # RANK first
        ({"SLURM_PROCID": 3, "SLURM_STEP_NUM_TASKS": 8}, (3, 8)),  # a task of an srun step
        ({"SLURM_PROCID": 0}, (0, 1)),  # a batch script, without srun: one process
        # torchrun in an srun step of one task per node: torchrun's ranks
        ({"RANK": 5, "WORLD_SIZE": 16, "SLURM_PROCID": 0, "SLURM_STEP_NUM_TASKS": 2}, (5, 16)),
    ],
)
def test_a_rank_is_worked_out_from_a_launchers_node_and_local_ranks(env, expected):
    from kspeed.client.planning.sampling import job_rank

    assert job_rank(None, None, env)[:2] == expected


@pytest.mark.parametrize(
    "env",
    [
        {"LOCAL_RANK": 1, "NODE_RANK": 0, "WORLD_SIZE": 2},  # PyTorch Lightning's rank 1 before its process group
        {"LOCAL_RANK": 0, "NODE_RANK": 0, "WORLD_SIZE": 2},  # and its rank 0
        {"WORLD_SIZE": 4},
        {"LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2, "WORLD_SIZE": 4},  # which node?
        # Lightning's processes inside one srun task share its SLURM_PROCID: not taken for ranks
        {"LOCAL_RANK": 1, "NODE_RANK": 0, "WORLD_SIZE": 4, "SLURM_PROCID": 0, "SLURM_STEP_NUM_TASKS": 1},
    ],
)
def test_launcher_variables_that_say_several_ranks_but_not_which_are_refused(env):
    from kspeed.client.planning.sampling import job_rank

    with pytest.raises(ConfigError, match="one of several") as caught:
        job_rank(None, None, env)
    assert "WORLD_SIZE=" in str(caught.value) and "train_dataloader()" in str(caught.value)
    assert job_rank(1, 2, env) == (1, 2, "given")  # given, nothing is asked of them


def test_launcher_variables_are_read_from_the_environment():
    from kspeed.config import launcher_environment

    env = {"RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "1", "LOCAL_RANK": "x", "SLURM_NTASKS": "4", "OTHER": "1"}
    env |= {"NODE_RANK": "1", "SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "6"}
    assert launcher_environment(env) == {
        "RANK": 3,
        "WORLD_SIZE": 4,
        "GROUP_RANK": 1,
        "NODE_RANK": 1,
        "SLURM_PROCID": 2,
        "SLURM_STEP_NUM_TASKS": 6,
    }


def test_a_rank_unknown_when_opened_is_asked_again_when_the_epoch_starts(make_ds, monkeypatch):
    from kspeed.config import LAUNCHER_VARIABLES

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # PyTorch Lightning's second process before its process group: several ranks, but not which.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds, _ = make_ds(seed=3)  # (opened: the rank is asked again when it is needed)
    ds.set_epoch(1)
    with pytest.raises(ConfigError, match="one of several"):
        iter(ds)
    monkeypatch.setenv("RANK", "1")  # (what the process group would say)
    assert len(ds.sampler) == 102 and (ds.rank, ds.world_size) == (1, 2)
    got = [i for batch in ds for i in batch.ids.tolist()]
    sampler = DistributedSampler(range(N_SAMPLES), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(1)
    assert got == list(sampler)


def test_a_process_that_knew_of_no_other_rank_takes_the_split_its_process_group_gives(make_ds, monkeypatch):
    from kspeed.config import LAUNCHER_VARIABLES

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # Lightning's first process before its process group: nothing says there are other ranks.
    late, _ = make_ds(seed=3)
    alone, _ = make_ds(seed=3)
    assert [i for batch in alone for i in batch.ids.tolist()] != []  # iterated: one process it stays
    monkeypatch.setenv("RANK", "0")  # (what the process group says once it exists)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert len(late) == 7 and (late.rank, late.world_size) == (0, 2)  # (102 samples in batches of 16)
    late.set_epoch(2)
    got = [i for batch in late for i in batch.ids.tolist()]
    sampler = DistributedSampler(range(N_SAMPLES), num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(2)
    assert got == list(sampler)
    assert (alone.rank, alone.world_size) == (0, 1) and len(alone.sampler) == N_SAMPLES
