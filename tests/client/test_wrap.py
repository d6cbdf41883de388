"""The folder-dataset wrapper without daemons: real JPEGs fed by in-process fake servers, real worker processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import re
import threading

import numpy as np
import pytest
import simplejpeg
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler
from torchvision.datasets import ImageFolder

from kspeed.client import client as client_module
from kspeed.client.client import KSpeedClient
from kspeed.client.folders import folder_spec
from kspeed.client.options import FeedOptions
from kspeed.client.prep.workers import check_loader, check_picklable, pil_file_loader, resolve_loader
from kspeed.client.prepared import PreparedDataset, worker_count
from kspeed.errors import ConfigError, DatasetError, UnavailableError
from tests.client.fakes import FakeServer, client_config, fake_info, open_dataset

CLASSES = ("ant", "bee", "cat")
PER_CLASS = 10
SIDE = 12


# -- a torchvision-style folder dataset (module level: the worker processes import these) ---------


def jpeg_loader(source):
    """Decode a JPEG given as a path or a binary file object (as PIL.Image.open accepts both)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return simplejpeg.decode_jpeg(f.read())
    return simplejpeg.decode_jpeg(source.read())


def to_normalized_tensor(image):
    """HWC uint8 -> CHW float, normalized."""
    return (torch.from_numpy(image).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.25


def jitter(image):
    """A random transform of the user's, drawing from torch's, Python's and numpy's global generators."""
    tensor = to_normalized_tensor(image) + torch.rand(3, SIDE, SIDE) + float(np.random.rand())
    return tensor.flip(-1) if random.random() < 0.5 else tensor


def path_only_loader(path):
    with open(path, "rb") as f:
        return simplejpeg.decode_jpeg(f.read())


def plus_hundred(target):
    return target + 100


def targets_only(items):
    return [target for _, target in items]


class FailOn:
    """A loader failing on the file whose bytes hash to ``digest``."""

    def __init__(self, digest):
        self.digest = digest

    def __call__(self, file):
        data = file.read()
        if hashlib.sha256(data).hexdigest() == self.digest:
            raise ValueError("corrupt image")
        return simplejpeg.decode_jpeg(data)


def _refuse_outside(pid):
    if os.getpid() != pid:
        raise ModuleNotFoundError("No module named 'only_here'")
    return jpeg_loader


class LoadsOnlyHere:
    """A loader that unpickles in this process only (as one from a module the workers cannot import)."""

    def __call__(self, file):
        return jpeg_loader(file)

    def __reduce__(self):
        return _refuse_outside, (os.getpid(),)


class PathRecorder:
    """A loader that opens a path (like cv2.imread or np.load) and records what it was given."""

    def __init__(self, seen):
        self.seen = seen

    def __call__(self, path):
        assert isinstance(path, str), f"a path loader got {type(path).__name__}"
        self.seen.append(path)
        with open(path, "rb") as f:
            return simplejpeg.decode_jpeg(f.read())


def make_jpegs(root, classes=CLASSES, per_class=PER_CLASS, seed=0):
    """Class folders of small random JPEGs; returns the root."""
    rng = np.random.default_rng(seed)
    for cls in classes:
        os.makedirs(root / cls, exist_ok=True)
        for i in range(per_class):
            image = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
            (root / cls / f"{i:03d}.jpg").write_bytes(simplejpeg.encode_jpeg(image, quality=90))
    return root


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for (images, targets), (ref_images, ref_targets) in zip(got, want):
        assert torch.equal(images, ref_images)
        assert torch.equal(targets, ref_targets)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path):
    return ImageFolder(str(make_jpegs(tmp_path / "imgs")), transform=to_normalized_tensor, loader=jpeg_loader)


@pytest.fixture
def make_wrapped(folder):
    """``make_wrapped(folder=folder, **kwargs) -> PreparedDataset`` over two fake servers; closed at teardown."""
    made = []

    def make(ds=folder, *, batch_size=8, sampler=None, seed=0, drop_last=False, **kwargs):
        data = []
        for path, _ in ds.samples:
            with open(path, "rb") as f:
                data.append(f.read())
        half = len(data) // 2
        fakes = [FakeServer("s0", data, 0, half), FakeServer("s1", data, half, len(data))]
        info = fake_info(data, [("s0", 0, half), ("s1", half, len(data))], labels="")
        options = FeedOptions(
            batch_size=batch_size, sampler=sampler, seed=seed, drop_last=drop_last, rail="shm", ring_bytes=1 << 20
        )
        inner = open_dataset(info, fakes, config=client_config(), options=options)
        kwargs.setdefault("num_workers", 2)
        try:
            wrapped = PreparedDataset(
                inner,
                paths=[p for p, _ in ds.samples],
                targets=[t for _, t in ds.samples],
                loader=ds.loader,
                transform=ds.transform,
                target_transform=ds.target_transform,
                **kwargs,
            )
        except BaseException:
            inner.close()
            for fake in fakes:
                fake.close()
            raise
        made.append((wrapped, fakes))
        return wrapped

    yield make
    for wrapped, fakes in made:
        wrapped.close()
        for fake in fakes:
            fake.close()


# -- delivery -------------------------------------------------------------------------------------


def test_same_items_as_dataloader(folder, make_wrapped):
    folder.target_transform = plus_hundred
    wrapped = make_wrapped(sampler=SequentialSampler(folder))
    want = list(DataLoader(folder, batch_size=8, sampler=SequentialSampler(folder)))
    got = list(wrapped)
    assert len(wrapped) == len(want) == 4  # 30 samples: three batches of 8 and one of 6
    assert_same_batches(got, want)
    assert got[0][1].tolist() == [100] * 8
    assert wrapped.state_dict()["batches"] == len(want)


def test_shuffled_epochs_follow_the_sampler_and_cover_every_sample(folder, make_wrapped):
    wrapped = make_wrapped(seed=7)
    everything = torch.stack([folder[i][0] for i in range(len(folder))])
    orders = []
    for epoch in range(2):
        wrapped.set_epoch(epoch)
        got = list(wrapped)
        sampler = DistributedSampler(folder, num_replicas=1, rank=0, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        assert_same_batches(got, list(DataLoader(folder, batch_size=8, sampler=sampler)))
        images = torch.cat([b[0] for b in got])
        targets = torch.cat([b[1] for b in got])
        # The same set each epoch: every sample exactly once, with its own target.
        rows = [int(torch.nonzero((everything == img).flatten(1).all(1))[0]) for img in images]
        assert sorted(rows) == list(range(len(folder)))
        assert targets.tolist() == [folder.targets[r] for r in rows]
        orders.append(rows)
    assert orders[0] != orders[1]


def test_collate_fn_override_and_delivered_position(folder, make_wrapped):
    wrapped = make_wrapped(sampler=SequentialSampler(folder), collate_fn=targets_only, prefetch=4)
    it = iter(wrapped)
    assert next(it) == folder.targets[:8]
    assert next(it) == folder.targets[8:16]
    # Four batches were handed to the workers; the position counts the two the caller received.
    assert wrapped.state_dict()["batches"] == 2
    it.close()


def test_loader_error_names_the_file_and_stops_the_workers(folder, make_wrapped):
    bad_path = folder.samples[13][0]
    with open(bad_path, "rb") as f:
        folder.loader = FailOn(hashlib.sha256(f.read()).hexdigest())
    wrapped = make_wrapped(sampler=SequentialSampler(folder))
    it = iter(wrapped)
    assert torch.equal(next(it)[1], torch.tensor(folder.targets[:8]))
    pids = wrapped.worker_pids()
    assert pids
    with pytest.raises(DatasetError, match=rf"sample 13 \({re.escape(bad_path)}\).*ValueError: corrupt image"):
        next(it)
    assert wrapped.worker_pids() == []
    assert not any(alive(pid) for pid in pids)


def test_a_random_transform_gives_a_sample_the_same_bytes_whatever_the_workers(folder, make_wrapped):
    # Seeded per sample from (seed, epoch, sample ID): not by worker, nor by the order of arrival.
    folder.transform = jitter
    got = {}
    for workers in (0, 1, 2):
        wrapped = make_wrapped(sampler=SequentialSampler(folder), seed=3, num_workers=workers)
        before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
        got[workers] = []
        for epoch in range(2):
            wrapped.set_epoch(epoch)
            got[workers].append(list(wrapped))
        # in the training process (0 workers) too, the loop's own random streams are left alone
        assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
        assert np.array_equal(np.random.get_state()[1], before[2])
        wrapped.close()
    for workers in (1, 2):
        for epoch in range(2):
            assert_same_batches(got[workers][epoch], got[0][epoch])
    first = [torch.cat([images for images, _ in epoch]) for epoch in got[0]]
    assert not torch.equal(first[0], first[1])  # the same samples in another epoch: other draws
    assert len({float(image.mean()) for image in first[0]}) == len(folder)  # each sample its own draws


def test_no_workers_runs_in_the_training_process(folder, make_wrapped):
    wrapped = make_wrapped(sampler=SequentialSampler(folder), num_workers=0)
    assert_same_batches(list(wrapped), list(DataLoader(folder, batch_size=8, sampler=SequentialSampler(folder))))
    assert wrapped.worker_pids() == [] and multiprocessing.active_children() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_that_opens_a_path_gets_the_bytes_under_the_file_name(folder, make_wrapped, workers, tmp_path):
    manager = multiprocessing.Manager() if workers else None  # (shut down here: no process outlives the test)
    try:
        seen = manager.list() if manager is not None else []
        folder.loader = PathRecorder(seen)
        wrapped = make_wrapped(sampler=SequentialSampler(folder), num_workers=workers)
        reference = ImageFolder(folder.root, transform=to_normalized_tensor, loader=jpeg_loader)
        batches = list(DataLoader(reference, batch_size=8, sampler=SequentialSampler(reference)))
        assert_same_batches(list(wrapped), batches)
        seen = list(seen)
    finally:
        if manager is not None:
            manager.shutdown()
    originals = {p for p, _ in folder.samples}
    loaded = [p for p in seen if p not in (folder.samples[0][0],)]  # the first one was the wrap-time check
    assert loaded and not originals & set(loaded)  # never the original file ...
    names = [os.path.basename(p) for p in loaded]
    assert sorted(set(names)) == sorted({os.path.basename(p) for p in originals})  # ... but under its name
    wrapped.close()
    assert not any(os.path.exists(p) for p in loaded)  # the scratch files are gone with the pool


def test_close_leaves_no_worker_process(folder, make_wrapped):
    wrapped = make_wrapped(sampler=SequentialSampler(folder))
    for _ in zip(range(2), wrapped):  # stop mid-epoch with batches in flight
        pass
    pids = wrapped.worker_pids()
    assert len(pids) == 2
    wrapped.close()
    assert not any(alive(pid) for pid in pids)
    assert multiprocessing.active_children() == []
    assert wrapped.worker_pids() == []


def test_a_loader_the_workers_cannot_unpickle_is_named_and_stops_them(folder, make_wrapped):
    folder.loader = LoadsOnlyHere()
    wrapped = make_wrapped(sampler=SequentialSampler(folder))
    with pytest.raises(DatasetError, match=r"cannot be unpickled in a worker process: ModuleNotFoundError"):
        next(iter(wrapped))
    assert wrapped.worker_pids() == [] and multiprocessing.active_children() == []


# -- registration and checks ----------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["registering", "after registering"])
def test_wrap_starts_the_workers_before_registering_and_closes_them_on_an_error(folder, monkeypatch, failure):
    started, pids, closed = [], [], []
    start_workers = client_module.start_workers

    def start(num_workers, preload):
        started.append(start_workers(num_workers, preload))
        return started[-1]

    class Registered:  # a dataset whose files changed since the folder was listed
        num_samples = len(folder) - 1

        def close(self):
            closed.append(True)

    def register(spec, options, *, host=False):
        assert host, "a wrapped dataset's feed delivers into host memory: its stages read the bytes there"
        assert started, "the workers start before the dataset registers"
        pids.extend(started[0].wait_ready())  # they get ready while it registers
        if failure == "registering":
            raise UnavailableError("the manager went away")
        return Registered()

    monkeypatch.setattr(client_module, "start_workers", start)
    client = KSpeedClient.__new__(KSpeedClient)  # no manager: open() is replaced
    client._closed, client._datasets = False, []
    monkeypatch.setattr(client, "open", register)
    error = UnavailableError if failure == "registering" else DatasetError
    with pytest.raises(error):
        client.wrap(folder, batch_size=8, num_workers=2, offload=0)
    assert len(pids) == 2 and started[0].closed
    assert not any(alive(pid) for pid in pids)
    assert closed == ([True] if failure == "after registering" else [])
    assert multiprocessing.active_children() == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kspeed-pool")]
    assert client._datasets == []


def test_folder_spec_uses_the_tree_when_it_matches_else_a_list(folder, tmp_path):
    paths = [p for p, _ in folder.samples]
    spec = folder_spec(paths)
    assert (spec.kind, spec.uri) == ("dir", str(tmp_path / "imgs"))
    assert folder_spec(paths).name == spec.name  # wrapping the same files again attaches to the same data
    reordered = folder_spec(paths[::-1])
    assert reordered.kind == "list" and reordered.name != spec.name
    assert reordered.uri == str(tmp_path / "imgs" / f".kspeed-{reordered.name}.list")
    with open(reordered.uri) as f:
        assert f.read().splitlines() == paths[::-1]
    # the list beside the class folders is a hidden file: the folder is still the same ImageFolder
    again = ImageFolder(str(tmp_path / "imgs"))
    assert again.classes == folder.classes and again.samples == folder.samples
    subset = folder_spec(paths[:-1])  # a file of the tree is not a sample: the tree would list it
    assert subset.kind == "list"
    listed = folder_spec(paths[:-1], list_dir=str(tmp_path / "lists"), name="mine")
    assert (listed.name, listed.uri) == ("mine", str(tmp_path / "lists" / "mine.list"))


def test_stage_checks(folder, tmp_path):
    path = folder.samples[0][0]
    assert check_loader(jpeg_loader, path) == "file"  # accepts a file object: no file is written per sample
    assert check_loader(path_only_loader, path) == "path"  # opens its argument by name
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    assert check_loader(jpeg_loader, str(broken)) == "file"  # a bad file is not a bad loader: iteration names it
    with pytest.raises(ConfigError, match=r"transform .* cannot be pickled"):
        check_picklable({"loader": jpeg_loader, "transform": lambda x: x})
    with pytest.raises(ConfigError, match="loader must be callable"):
        resolve_loader("not callable")
    assert resolve_loader(jpeg_loader) is jpeg_loader
    pil_loader = type("f", (), {})  # stands in for torchvision.datasets.folder.pil_loader by name
    pil_loader.__module__, pil_loader.__name__ = "torchvision.datasets.folder", "pil_loader"
    assert resolve_loader(pil_loader) is pil_file_loader


def test_bad_arguments_are_named(folder, make_wrapped):
    with pytest.raises(ConfigError, match="num_workers must be a non-negative integer"):
        make_wrapped(num_workers=-1)
    with pytest.raises(ConfigError, match="prefetch must be a positive integer"):
        make_wrapped(prefetch=-1)


def test_default_workers_follow_the_cpus_the_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # taskset -c 0,1
    assert worker_count(None) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    assert worker_count(None) == 4
    assert worker_count(7) == 7  # asked for: as asked


def test_a_prepared_dataset_keeps_the_position_of_what_it_handed_on_not_of_what_it_prepared(folder, make_wrapped):
    from kspeed.client.live import newest_state

    whole = list(make_wrapped(batch_size=4, seed=1))
    wrapped = make_wrapped(batch_size=4, seed=1)  # (two workers prepare batches ahead)
    assert wrapped.resume_live("job") is False
    it = iter(wrapped)
    first = [next(it) for _ in range(2)]
    servers = wrapped.kspeed_dataset._server_links()
    kept = newest_state(p for s in servers for p in s.kept.of(wrapped.name, "job"))
    assert kept is not None and kept["batches"] == 2 and kept["passes"][-1][1] == [8]
    # one position per batch handed on (and one when the epoch began), none for those prepared ahead
    assert wrapped.kspeed_dataset._live is not None and wrapped.kspeed_dataset._live.kept == 3
    again = make_wrapped(batch_size=4, seed=1)
    for fake, earlier in zip(again.kspeed_dataset._server_links(), servers, strict=True):
        fake.kept = earlier.kept  # (the same servers)
    assert again.resume_live("job") is True
    assert_same_batches(first + list(again), whole)
