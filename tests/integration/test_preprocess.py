"""Server-side preprocessing against real daemons: a sample comes out the same wherever its stages
run, ``wrap`` sends a torchvision folder's transforms to the servers, and every failure names its
sample and stage.

The servers run under ``ATEN_CPU_CAPABILITY=default`` while this process keeps its own CPU
capability, so a kernel that depended on it would show as a difference between placements (the
servers pass it to their sandboxed workers with ``--preprocess-env``). Their ``PYTHONPATH`` holds
this checkout, so they can import :mod:`tests.integration.prep_functions` where their
``--preprocess-allow`` admits it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler
from torchvision.datasets import ImageFolder
from torchvision.transforms import (
    CenterCrop,
    Compose,
    Grayscale,
    Normalize,
    PILToTensor,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
)

import kspeed.client.client as client_module
import kspeed.client.prepared as prepared_module
from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import LocalCluster, wait_for
from kspeed.errors import AccessDeniedError, CapacityError, ConfigError, DatasetError, NotFoundError, StateError
from kspeed.preprocess import Output, Pipeline, Stage, jpeg_region
from kspeed.preprocess.runner import Runner
from tests.client.test_wrap import alive, assert_same_batches
from tests.conftest import FAST_MANAGER
from tests.helpers import http_get
from tests.integration.test_client import config_for
from tests.integration.test_production import metric
from tests.preprocess.photos import sample_photographs

REPO = Path(__file__).resolve().parents[2]
SERVER_CPU = "default"  # the servers' ATEN_CPU_CAPABILITY; this process keeps its own
CLASSES = ("china", "flower")  # one class directory per sample picture of scikit-learn
PER_CLASS = 24
VICTIM = 29  # flower/05.jpg, the only photograph VICTIM_HEIGHT pixels tall (the others are taller)
VICTIM_HEIGHT = 333
BATCH = 8
SEED = 7
SIDE = 64
RING = 8 << 20
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
USER = "tests.integration.prep_functions"
PREPROCESSED = "kspeed_server_preprocessed_samples_total"
RESTARTS = "kspeed_server_preprocess_worker_restarts_total"


@dataclasses.dataclass(frozen=True)
class Photos:
    """A class-per-directory tree of JPEG photographs; sample ``i`` is ``keys[i]``."""

    root: Path
    keys: list[str]

    def data(self, sample: int) -> bytes:
        return (self.root / self.keys[sample]).read_bytes()

    def label(self, sample: int) -> int:
        return CLASSES.index(self.keys[sample].split("/")[0])


def make_photos(root: Path) -> Photos:
    """48 crops of 300-500 px of the two photographs, JPEG quality 90, the victim's height unique."""
    rng = np.random.default_rng(0)
    keys = []
    for c, (name, picture) in enumerate(zip(CLASSES, sample_photographs())):
        (root / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            height = VICTIM_HEIGHT if c * PER_CLASS + i == VICTIM else int(rng.integers(VICTIM_HEIGHT + 1, 421))
            width = int(rng.integers(300, 501))
            top = int(rng.integers(0, picture.shape[0] - height + 1))
            left = int(rng.integers(0, picture.shape[1] - width + 1))
            keys.append(f"{name}/{i:02d}.jpg")
            Image.fromarray(picture[top : top + height, left : left + width]).save(root / keys[-1], quality=90)
    return Photos(root, keys)


def expected(pipeline: Pipeline, photos: Photos, order: list[int], epoch: int, seed: int = SEED) -> list[list]:
    """The batches of ``order``: every stage run here, in this process, as ``[samples, labels]``."""
    runner = Runner(pipeline)
    batches = []
    for start in range(0, len(order), BATCH):
        ids = order[start : start + BATCH]
        samples = [runner.run(photos.data(i), seed=seed, epoch=epoch, sample=i) for i in ids]
        batches.append([torch.from_numpy(np.stack(samples)), torch.tensor([photos.label(i) for i in ids])])
    return batches


def shuffled(n: int, epoch: int) -> list[int]:
    """The built-in sampler's order of an epoch (a DistributedSampler of one rank seeded SEED)."""
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def crop_pipeline(*middle: Stage) -> Pipeline:
    """Decode, ``middle``, center-crop and CHW, all on the servers."""
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            *middle,
            Stage("center_crop", {"size": SIDE}),
            Stage("to_chw", output=Output(shape=(3, SIDE, SIDE), dtype="uint8")),
        ]
    )


def opened(client: KSpeedClient, spec: DatasetSpec, offload: float | None = None, *, num_workers: int = 0, **options):
    """``spec``'s feed in batches of ``BATCH``, in ID order unless ``shuffle=True``, with a ring of ``RING`` bytes."""
    options.setdefault("shuffle", False)
    return client.dataset(spec, BATCH, offload=offload, num_workers=num_workers, ring_bytes=RING, quiet=True, **options)


def total(cluster, name: str) -> float:
    """A counter summed over the cluster's servers."""
    return sum(metric(http_get(server.ready["http"], "/metrics")[1], name) for server in cluster.servers)


def hosted(cluster, dataset: str) -> bool:
    """Whether some server holds a share of ``dataset``."""
    return any(f'dataset="{dataset}"' in http_get(s.ready["http"], "/metrics")[1] for s in cluster.servers)


def server_stages_ran(cluster, stage: str) -> bool:
    """Whether some server timed ``stage`` (``"<index>:<op>"``)."""
    texts = [http_get(server.ready["http"], "/metrics")[1] for server in cluster.servers]
    return any(
        line.startswith("kspeed_server_preprocess_stage_seconds_total{") and f'stage="{stage}"' in line
        for text in texts
        for line in text.splitlines()
    )


def environ(pid: int) -> dict[str, str]:
    """A process's environment, as it started."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in raw if b"=" in entry)


def parent(pid: int) -> int:
    """A process's parent."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def gates(tmp_path_factory) -> Path:
    """The one directory the servers' sandboxed workers may write (gates of :func:`prep_functions.hold`)."""
    path = tmp_path_factory.mktemp("gates")
    os.chmod(path, 0o777)  # (the workers run as nobody when the tests run as root)
    return path


@pytest.fixture(scope="module")
def start(tmp_path_factory, gates):
    """``start(servers=1, allow=()) -> (cluster, client, photos)``: a cluster of ``servers`` servers
    with one preprocessing worker each, under ``ATEN_CPU_CAPABILITY=default``, importing ``allow``
    beside torchvision's transforms, and a client of it.

    Started on first use of those settings and shared by the module's tests (a cluster and its
    workers take seconds to start); every client is closed and every daemon stopped at the end,
    however the tests went. The photographs are shared too: a test that spoils one copies them.
    """
    base = tmp_path_factory.getbasetemp()
    photos = make_photos(tmp_path_factory.mktemp("photos"))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    clusters: dict[tuple[int, tuple[str, ...]], LocalCluster] = {}
    clients: dict[tuple[int, tuple[str, ...]], KSpeedClient] = {}

    def make(servers: int = 1, allow: tuple[str, ...] = ()) -> tuple[LocalCluster, KSpeedClient, Photos]:
        key = (servers, allow)
        if key not in clusters:
            clusters[key] = LocalCluster(
                str(tmp_path_factory.mktemp("cluster")),
                servers=servers,
                manager_args=FAST_MANAGER,
                server_args=[
                    "--backend-allow",
                    str(base),
                    "--memory",
                    "32MiB",
                    "--region-size",
                    "1MiB",
                    "--preprocess-workers",
                    "1",
                    "--preprocess-allow",
                    ",".join(["torchvision.transforms", *allow]),
                    "--preprocess-env",
                    "ATEN_CPU_CAPABILITY",
                    "--preprocess-write-paths",
                    str(gates),
                ],
                env={"ATEN_CPU_CAPABILITY": SERVER_CPU, "PYTHONPATH": path},
            )
            clusters[key].start()
            clients[key] = KSpeedClient(config=config_for(clusters[key]))
        return clusters[key], clients[key], photos

    try:
        yield make
    finally:
        for client in clients.values():
            client.close()
        with ThreadPoolExecutor(max(len(clusters), 1)) as pool:  # each stop waits seconds for its daemons
            list(pool.map(LocalCluster.stop, clusters.values()))


# -- placement -------------------------------------------------------------------------------------


def placed_pipeline() -> Pipeline:
    """Decode and augment on the servers, cast on the client, normalize on the training device."""
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("random_resized_crop", {"size": [SIDE, SIDE]}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, SIDE, SIDE), dtype="uint8")),
            Stage("cast", {"dtype": "float32"}, place="client"),
            Stage("normalize", {"mean": MEAN, "std": STD}, place="gpu"),
        ]
    )


def test_batches_are_the_same_wherever_the_server_stages_run(start):
    cluster, client, photos = start(servers=2)
    assert all(environ(s.process.pid)["ATEN_CPU_CAPABILITY"] == SERVER_CPU for s in cluster.servers)
    assert os.environ.get("ATEN_CPU_CAPABILITY") != SERVER_CPU  # this process and its workers differ
    pipeline = placed_pipeline()
    spec = DatasetSpec(name="photos", uri=str(photos.root), labels="dirname", pipeline=pipeline)
    n = len(photos.keys)
    got, done = {}, {}
    # None first: nothing on the servers is still running for it. The client's stages run in this
    # process, but for the split, whose received and raw samples go through a spawned worker (each
    # worker takes seconds to start).
    for offload, workers in ((0.0, 0), (0.5, 1), (1.0, 0)):
        before = total(cluster, PREPROCESSED)
        with opened(client, spec, offload, num_workers=workers, shuffle=True, seed=SEED) as ds:
            got[offload] = []
            for epoch in range(2):
                ds.set_epoch(epoch)
                got[offload].append(list(ds))
        done[offload] = total(cluster, PREPROCESSED) - before

    for epoch in range(2):
        want = expected(pipeline, photos, shuffled(n, epoch), epoch)
        for offload, epochs in got.items():
            # Placement changes nothing: the same code ran on the same bytes, wherever it ran.
            assert_same_batches(epochs[epoch], got[0.0][epoch])
            for (images, labels), (ref_images, ref_labels) in zip(epochs[epoch], want, strict=True):
                assert images.dtype == torch.float32 and images.shape == (BATCH, 3, SIDE, SIDE), offload
                assert torch.equal(labels, ref_labels), offload
                # normalize promises 1 ulp between its torch (gpu place) and numpy versions.
                np.testing.assert_array_max_ulp(images.numpy(), ref_images.numpy(), maxulp=1)

    # The servers preprocessed their share of every planned sample: none, half, all. The next
    # epoch's plan is committed ahead, so up to one more epoch's share may have been started as
    # well, and may still finish while the next placement runs.
    planned = 2 * n
    assert done[0.0] == 0
    assert planned / 2 <= done[0.5] <= planned * 3 / 4
    assert planned <= done[1.0] and done[0.5] + done[1.0] <= (planned / 2 + planned) * 3 / 2

    # A wrapped folder whose transforms are sent as a pipeline keeps it at offload=0: the client
    # runs every stage of it, seeded alike, and the bytes are those the servers make.
    augment = Compose([RandomResizedCrop(SIDE), RandomHorizontalFlip(), PILToTensor()])
    folder = ImageFolder(str(photos.root), transform=augment)
    wrapped = {}
    for offload in (1.0, 0.0):
        with client.wrap(folder, BATCH, num_workers=0, ring_bytes=RING, quiet=True, offload=offload, seed=SEED) as ds:
            assert ds.kspeed_dataset.pipeline is not None
            wrapped[offload] = []
            for epoch in range(2):
                ds.set_epoch(epoch)
                wrapped[offload].append(list(ds))
            ran_here = set(ds.stats()["client_stage_seconds"])
        if offload == 0.0:
            assert ds.kspeed_dataset.prep is None  # no sample marked for the servers
            assert {"0:decode_image", "1:torchvision.transforms:RandomResizedCrop"} <= ran_here
    for epoch in range(2):
        assert_same_batches(wrapped[0.0][epoch], wrapped[1.0][epoch])
    assert not torch.equal(wrapped[0.0][0][0][0], wrapped[0.0][1][0][0])  # (another epoch, other crops)


def test_a_transform_worker_killed_during_split_batches_is_named_and_nothing_is_left(start):
    """A split (``offload=0.5``) sends each batch's client samples to a worker process: one killed
    while batches are in flight is a DatasetError that says so, the next epoch runs on a new worker,
    and closing leaves no process."""
    _, client, photos = start(servers=2)
    spec = DatasetSpec(name="photos-killed", uri=str(photos.root), labels="dirname", pipeline=placed_pipeline())
    with opened(client, spec, 0.5, num_workers=1, shuffle=True, seed=SEED) as ds:
        batches = iter(ds)
        next(batches)  # the worker has prepared its part of the first batch
        pids = ds._workers.pids()
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(DatasetError, match="a transform worker process died during"):
            for epoch in range(1, 3):  # whatever was prepared before the kill, the next epoch needs it
                list(batches)
                ds.set_epoch(epoch)
                batches = iter(ds)
        # The next epoch starts a new worker and delivers what it would have delivered anyway.
        ds.set_epoch(3)
        want = expected(ds.kspeed_dataset.pipeline, photos, shuffled(len(photos.keys), 3), 3)
        for (images, labels), (ref_images, ref_labels) in zip(ds, want, strict=True):
            assert torch.equal(labels, ref_labels)
            np.testing.assert_array_max_ulp(images.numpy(), ref_images.numpy(), maxulp=1)
        assert ds._workers.pids() != pids
    assert not alive(pids[0])
    assert multiprocessing.active_children() == []


def test_a_prepared_dataset_is_fed_in_host_memory_and_moves_its_batches_to_the_device(start, monkeypatch):
    """``device="cuda"`` on a prepared dataset: the client's stages read the delivered bytes on the
    CPU, so its feed delivers into host memory, and the collated samples then move to the device
    (labels stay in host memory, as every KSpeed batch's do). PyTorch's ``meta`` device stands in
    for the GPU here; ``test_gpu_stages_run_on_the_gpu_the_batches_are_delivered_to`` is the same on one."""
    _, client, photos = start(servers=2)
    meta = torch.device("meta")
    monkeypatch.setattr(client_module, "parse_device", lambda device: meta)
    monkeypatch.setattr(prepared_module, "parse_device", lambda device: meta)
    spec = DatasetSpec(name="photos-meta", uri=str(photos.root), labels="dirname", pipeline=placed_pipeline())
    with opened(client, spec, 1.0, device="cuda") as ds:
        assert ds.kspeed_dataset.device == torch.device("cpu")
        with pytest.raises(StateError, match=r"opened from a spec.*len\(\.sampler\).*\.kspeed_dataset"):
            _ = ds.dataset  # (no dataset object of the caller's: what to read instead is named)
        images, labels = next(iter(ds))
        assert images.device == meta and images.dtype == torch.float32 and images.shape == (BATCH, 3, SIDE, SIDE)
        assert labels.device == torch.device("cpu") and len(labels) == BATCH


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_gpu_stages_run_on_the_gpu_the_batches_are_delivered_to(start):
    """``device="cuda"``: the servers' and the client's stages arrive in GPU memory, the ``gpu``
    stage runs there, and the batches equal every stage run here on the CPU (normalize within
    1 ulp), whether the servers or the client ran the CPU stages."""
    _, client, photos = start(servers=2)
    pipeline = placed_pipeline()
    spec = DatasetSpec(name="photos-cuda", uri=str(photos.root), labels="dirname", pipeline=pipeline)
    n = len(photos.keys)
    for offload in (1.0, 0.0):
        with opened(client, spec, offload, shuffle=True, seed=SEED, device="cuda") as ds:
            for epoch in range(2):
                ds.set_epoch(epoch)
                want = expected(pipeline, photos, shuffled(n, epoch), epoch)
                for (images, labels), (ref_images, ref_labels) in zip(ds, want, strict=True):
                    assert images.is_cuda and images.dtype == torch.float32, offload
                    assert images.shape == (BATCH, 3, SIDE, SIDE), offload
                    assert torch.equal(labels.cpu(), ref_labels), offload
                    np.testing.assert_array_max_ulp(images.cpu().numpy(), ref_images.numpy(), maxulp=1)


def test_a_batch_split_between_the_servers_and_the_client_is_the_whole_pipelines_batch(start):
    # every stage on the servers: the servers' samples of a batch are collated in this process
    # from the ring, the others run in a worker, and the two parts are interleaved in order
    _, client, photos = start(servers=2)
    pipeline = Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("random_resized_crop", {"size": [SIDE, SIDE]}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, SIDE, SIDE), dtype="uint8")),
        ]
    )
    spec = DatasetSpec(name="split", uri=str(photos.root), labels="dirname", pipeline=pipeline)
    epoch = 1
    want = expected(pipeline, photos, shuffled(len(photos.keys), epoch), epoch)
    for offload, workers in ((0.5, 1), (0.25, 0)):
        with opened(client, spec, offload, num_workers=workers, shuffle=True, seed=SEED) as ds:
            ds.set_epoch(epoch)
            got = list(ds)
            stats = ds.stats()
        assert_same_batches(got, want)
        # both parts ran: samples decoded here, and samples received preprocessed
        assert {"0:decode_image", "receive"} <= set(stats["client_stage_seconds"]), stats


# -- wrap ------------------------------------------------------------------------------------------


def test_wrap_runs_a_folders_uint8_transforms_on_the_servers(start):
    cluster, client, photos = start()
    folder = ImageFolder(str(photos.root), transform=Compose([Resize(80), CenterCrop(SIDE), PILToTensor()]))
    sampler = SequentialSampler(folder)
    want = list(DataLoader(folder, batch_size=BATCH, sampler=sampler))
    before = total(cluster, PREPROCESSED)
    with client.wrap(folder, BATCH, sampler=sampler, num_workers=0, ring_bytes=RING, quiet=True) as wrapped:
        pipeline = wrapped.kspeed_dataset.pipeline
        assert pipeline is not None
        assert [(s.op.rsplit(":", 1)[-1], s.place) for s in pipeline.stages] == [
            ("decode_image", "server"),
            ("Resize", "server"),
            ("CenterCrop", "server"),
            ("PILToTensor", "server"),
        ]
        for epoch in range(2):
            wrapped.set_epoch(epoch)
            assert_same_batches(list(wrapped), want)
        # This client only received and collated; the servers decoded and transformed every sample,
        # and say so through the manager.
        assert set(wrapped.stats()["client_stage_seconds"]) == {"receive", "collate"}
        servers = [f"{k}:{s.op}" for k, s in enumerate(pipeline.stages)]
        wait_for(lambda: set(wrapped.stats()["server_stage_seconds"]) == set(servers), 10, "server stage times")
        # (a dataset's stage times go with it: asked while the job holds it)
        assert server_stages_ran(cluster, "3:torchvision.transforms:PILToTensor")
    assert total(cluster, PREPROCESSED) - before >= 2 * len(folder)


@pytest.mark.skipif(not jpeg_region.available(), reason="this install has no region decoder")
def test_wrap_with_region_decode_crops_alike_wherever_the_crop_runs(start):
    # The opt-in fast path: one stage decodes only each crop's region; the servers (under another
    # CPU capability) and this client give the same bytes, those of the stages run in this process.
    cluster, client, photos = start()
    folder = ImageFolder(str(photos.root), transform=Compose([RandomResizedCrop(SIDE), PILToTensor()]))
    sampler = SequentialSampler(folder)
    got = {}
    for offload in (1.0, 0.0):
        with client.wrap(
            folder,
            BATCH,
            sampler=sampler,
            num_workers=0,
            ring_bytes=RING,
            quiet=True,
            offload=offload,
            seed=SEED,
            region_decode=True,
        ) as wrapped:
            pipeline = wrapped.kspeed_dataset.pipeline
            assert pipeline is not None and pipeline.stages[0].op == "decode_random_resized_crop"
            wrapped.set_epoch(1)
            got[offload] = list(wrapped)
            ran_here = set(wrapped.stats()["client_stage_seconds"])
            if offload == 1.0:  # (a dataset's stage times go with it: asked while the job holds it)
                assert server_stages_ran(cluster, "0:decode_random_resized_crop")
        assert ("0:decode_random_resized_crop" in ran_here) == (offload == 0.0)
    assert_same_batches(got[0.0], got[1.0])
    runner = Runner(pipeline)
    for k, (images, labels) in enumerate(got[1.0]):
        ids = range(k * BATCH, (k + 1) * BATCH)
        want = [runner.run(photos.data(i), seed=SEED, epoch=1, sample=i) for i in ids]
        assert torch.equal(images, torch.stack(want)) and labels.tolist() == [photos.label(i) for i in ids]


def test_wrap_keeps_float_transforms_on_the_client(start):
    cluster, client, photos = start()
    transform = Compose([Resize(80), CenterCrop(SIDE), ToTensor(), Normalize(MEAN, STD)])
    folder = ImageFolder(str(photos.root), transform=transform)
    sampler = SequentialSampler(folder)
    with client.wrap(folder, BATCH, sampler=sampler, num_workers=0, ring_bytes=RING, quiet=True) as wrapped:
        pipeline = wrapped.kspeed_dataset.pipeline
        assert pipeline is not None
        # Cut after the last uint8 transform: the servers send 64x64x3 bytes, not four times as many as floats.
        assert [s.place for s in pipeline.stages] == ["server", "server", "server", "client", "client"]
        assert pipeline.stages[2].output == Output(shape=(SIDE, SIDE, 3), dtype="uint8", kind="pil")
        # ToTensor and Normalize run here on the pixels DataLoader's would see: equal, not merely close.
        assert_same_batches(list(wrapped), list(DataLoader(folder, batch_size=BATCH, sampler=sampler)))
        ran_here = set(wrapped.stats()["client_stage_seconds"])
        assert server_stages_ran(cluster, "2:torchvision.transforms:CenterCrop")
    assert {"receive", "3:torchvision.transforms:ToTensor", "4:torchvision.transforms:Normalize"} <= ran_here
    assert not any(name.startswith(("0:", "1:", "2:")) for name in ran_here)


def test_wrap_runs_a_transform_it_cannot_send_in_client_workers(start):
    _, client, photos = start()
    transform = Compose([Resize(80), CenterCrop(SIDE), Grayscale(), PILToTensor()])  # Grayscale is not sendable
    folder = ImageFolder(str(photos.root), transform=transform)
    sampler = SequentialSampler(folder)
    with client.wrap(folder, BATCH, sampler=sampler, num_workers=1, ring_bytes=RING, quiet=True) as wrapped:
        assert (
            wrapped.kspeed_dataset.pipeline is None and wrapped.kspeed_dataset.prep is None
        )  # the servers only serve bytes
        assert_same_batches(list(wrapped), list(DataLoader(folder, batch_size=BATCH, sampler=sampler)))
        assert len(wrapped.worker_pids()) == 1
    assert multiprocessing.active_children() == []


# -- refusals and bad input -------------------------------------------------------------------------


def test_a_user_function_runs_only_where_its_module_is_allowed(start):
    pipeline = crop_pipeline(Stage(f"{USER}:fail_on_height", {"height": 1}))  # no photograph is 1 px tall
    cluster, client, photos = start()
    spec = DatasetSpec(name="user-fn", uri=str(photos.root), labels="dirname", pipeline=pipeline)
    refusal = f"module '{USER}' is not on this server's preprocess allow-list"
    with pytest.raises(AccessDeniedError, match=re.escape(refusal)):
        client.dataset(spec, BATCH, quiet=True)
    # Refused before anything was made: the manager knows no such dataset, no server holds any of it.
    with pytest.raises(NotFoundError):
        client.manager.dataset(spec.name)
    assert not hosted(cluster, spec.name)

    allowing, client, _ = start(allow=("tests",))
    with opened(client, spec) as ds:
        assert_same_batches(list(ds), expected(pipeline, photos, list(range(len(photos.keys))), 0))
        assert server_stages_ran(allowing, f"1:{USER}:fail_on_height")


@pytest.mark.parametrize(
    "offload",
    [
        pytest.param(1.0, id="servers"),
        pytest.param(0.0, id="client"),
    ],
)
def test_an_output_unlike_its_declaration_names_the_sample_and_the_stage(start, offload):
    _, client, photos = start(allow=("tests",))
    square = Stage(
        f"{USER}:square_crop",
        {"side": SIDE, "short_height": VICTIM_HEIGHT},
        output=Output(shape=(SIDE, SIDE, 3), dtype="uint8"),
    )
    spec = DatasetSpec(name="misshapen", uri=str(photos.root), pipeline=Pipeline([Stage("decode_image"), square]))
    with opened(client, spec, offload) as ds, pytest.raises(DatasetError) as caught:
        list(ds)
    message = str(caught.value)
    assert f"sample {VICTIM}:" in message and f"stage 1 ({USER}:square_crop)" in message
    assert f"shape ({SIDE}, {SIDE - 1}, 3) where ({SIDE}, {SIDE}, 3) is declared" in message


@pytest.mark.timeout(60)
def test_a_corrupt_jpeg_is_named_wherever_it_is_decoded(start, tmp_path):
    _, client, photos = start()
    root = shutil.copytree(photos.root, tmp_path / "photos")
    corrupt = root / photos.keys[VICTIM]
    corrupt.write_bytes(corrupt.read_bytes()[:200])  # the header and nothing of the scan
    spec = DatasetSpec(name="corrupt", uri=str(root), pipeline=crop_pipeline())
    for offload in (1.0, 0.5, 0.0):
        with opened(client, spec, offload) as ds, pytest.raises(DatasetError) as caught:
            list(ds)
        message = str(caught.value)
        assert f"sample {VICTIM}" in message, offload
        assert "stage 0 (decode_image) failed: ValueError: cannot decode image" in message, offload
        assert caught.value.sample == VICTIM, offload  # named in the text, and as a field, wherever it failed
    # on_error="skip": the sample is left out of its batch and counted, the others arrive as ever
    for offload in (1.0, 0.5, 0.0):
        with opened(client, spec, offload, on_error="skip") as ds:
            got = list(ds)  # no labels: each batch is the samples' tensor
            assert ds.stats()["skipped"] == 1, offload
        assert sum(len(b) for b in got) == len(photos.keys) - 1, offload
        assert [len(b) for b in got].count(BATCH - 1) == 1, offload


def test_a_user_function_that_raises_is_named_with_its_error(start):
    _, client, photos = start(allow=("tests",))
    pipeline = crop_pipeline(Stage(f"{USER}:fail_on_height", {"height": VICTIM_HEIGHT}))
    spec = DatasetSpec(name="failing", uri=str(photos.root), pipeline=pipeline)
    for offload in (1.0, 0.0):  # on the client in a worker process: the error crosses back
        with opened(client, spec, offload, num_workers=1) as ds, pytest.raises(DatasetError) as caught:
            list(ds)
        message = str(caught.value)
        assert f"sample {VICTIM}" in message, offload
        assert f"stage 1 ({USER}:fail_on_height) failed" in message, offload
        assert f"ValueError: no image may be {VICTIM_HEIGHT} pixels tall" in message, offload
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(90)
def test_a_killed_preprocessing_worker_is_replaced_and_the_epoch_completes(start, gates):
    cluster, client, photos = start(allow=("tests",))
    gate = gates / "gate"
    pipeline = crop_pipeline(Stage(f"{USER}:hold", {"gate": str(gate)}))
    spec = DatasetSpec(name="held", uri=str(photos.root), labels="dirname", pipeline=pipeline)
    restarts = total(cluster, RESTARTS)
    with opened(client, spec) as ds, ThreadPoolExecutor(1) as pool:
        epoch = pool.submit(list, ds)
        try:
            # The worker announces itself from inside its first task, which it cannot finish yet.
            announced = wait_for(lambda: sorted(gates.glob("gate.*")), 30, "a preprocessing worker to hold")
            pid = int(announced[0].suffix[1:])
            assert parent(pid) == cluster.servers[0].process.pid  # a worker of the server daemon
            assert environ(pid)["ATEN_CPU_CAPABILITY"] == SERVER_CPU
            os.kill(pid, signal.SIGKILL)
        finally:
            gate.touch()
        batches = epoch.result(timeout=60)
    assert_same_batches(batches, expected(pipeline, photos, list(range(len(photos.keys))), 0))
    assert total(cluster, RESTARTS) - restarts >= 1


def test_an_output_larger_than_a_window_region_is_refused_at_the_plan(start):
    _, client, photos = start()
    huge = Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("resize", {"size": [700, 700]}),
            Stage("to_chw", output=Output(shape=(3, 700, 700), dtype="uint8")),  # 1.4 MiB > a 1 MiB region
        ]
    )
    spec = DatasetSpec(name="huge", uri=str(photos.root), pipeline=huge)
    room = 64 << 20  # the ring holds such batches: only the window cannot

    def feed(offload: float):
        return client.dataset(spec, BATCH, shuffle=False, offload=offload, num_workers=0, ring_bytes=room, quiet=True)

    with feed(1.0) as ds, pytest.raises(CapacityError) as caught:
        next(iter(ds))
    assert "1470000 bytes after 3 server stage(s) does not fit a production window region" in str(caught.value)
    with feed(0.0) as ds:  # on the client it is only a large sample
        assert next(iter(ds)).shape == (BATCH, 3, 700, 700)


# -- cache="preprocessed" --------------------------------------------------------------------------

CACHED_SIDE = 72


def cached_pipeline() -> Pipeline:
    """Decode, resize and center-crop (deterministic: kept by a cache), then a random crop, flip and CHW."""
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("resize", {"size": CACHED_SIDE}),
            Stage("center_crop", {"size": CACHED_SIDE}, output=Output(shape=(CACHED_SIDE, CACHED_SIDE, 3))),
            Stage("random_resized_crop", {"size": [SIDE, SIDE]}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, SIDE, SIDE), dtype="uint8")),
        ]
    )


def test_a_dataset_cached_preprocessed_gives_what_the_whole_pipeline_gives(start):
    cluster, client, photos = start(servers=2)
    pipeline = cached_pipeline()
    spec = DatasetSpec(name="cached", uri=str(photos.root), labels="dirname", pipeline=pipeline, cache="preprocessed")
    assert spec.cached_stages == 3
    n = len(photos.keys)
    for offload, workers in ((1.0, 0), (0.0, 0), (0.5, 1)):
        with opened(client, spec, offload, num_workers=workers, shuffle=True, seed=SEED) as ds:
            # The servers keep each photograph as the 72x72x3 pixels stage 2 declares, not its JPEG.
            assert ds.kspeed_dataset.cached_stages == 3
            assert ds.preload().bytes == n * CACHED_SIDE * CACHED_SIDE * 3
            for epoch in range(2):
                ds.set_epoch(epoch)
                want = expected(pipeline, photos, shuffled(n, epoch), epoch)
                assert_same_batches(list(ds), want)  # uint8 all the way: bit for bit
            ran_here = set(ds.stats()["client_stage_seconds"])
            if offload == 1.0:  # decoded at preload, cropped every epoch: both on the servers
                assert server_stages_ran(cluster, "0:decode_image")
                assert server_stages_ran(cluster, "3:random_resized_crop")
        # Decoding and resizing ran once, on the servers: never on this client, whatever the split.
        assert not any(name.startswith(("0:", "1:", "2:")) for name in ran_here), offload
        if offload == 0.0:
            assert {"receive", "3:random_resized_crop", "4:flip", "5:to_chw"} <= ran_here


def test_wrap_caches_a_folders_deterministic_transforms(start):
    _, client, photos = start()
    folder = ImageFolder(str(photos.root), transform=Compose([Resize(80), CenterCrop(SIDE), PILToTensor()]))
    sampler = SequentialSampler(folder)
    want = list(DataLoader(folder, batch_size=BATCH, sampler=sampler))
    with client.wrap(
        folder, BATCH, sampler=sampler, num_workers=0, ring_bytes=RING, quiet=True, cache="preprocessed"
    ) as wrapped:
        assert wrapped.kspeed_dataset.cached_stages == 4  # every stage: each epoch only receives and collates
        assert wrapped.name.endswith("-preprocessed")
        for epoch in range(2):
            wrapped.set_epoch(epoch)
            assert_same_batches(list(wrapped), want)
        assert set(wrapped.stats()["client_stage_seconds"]) == {"receive", "collate"}
    random_first = ImageFolder(str(photos.root), transform=Compose([RandomResizedCrop(SIDE), PILToTensor()]))
    with pytest.raises(ConfigError, match="needs a leading transform that is not random and gives a fixed size"):
        client.wrap(random_first, BATCH, num_workers=0, cache="preprocessed")


@pytest.mark.timeout(60)
def test_a_corrupt_jpeg_in_a_cached_dataset_is_named_at_preload_and_when_drawn(start, tmp_path):
    _, client, photos = start()
    root = shutil.copytree(photos.root, tmp_path / "photos")
    corrupt = root / photos.keys[VICTIM]
    corrupt.write_bytes(corrupt.read_bytes()[:200])
    spec = DatasetSpec(name="cached-corrupt", uri=str(root), pipeline=cached_pipeline(), cache="preprocessed")
    with opened(client, spec, 1.0) as ds:
        with pytest.raises(DatasetError) as at_preload:
            ds.preload()
        with pytest.raises(DatasetError) as drawn:
            list(ds)
    assert drawn.value.sample == VICTIM
    for caught in (at_preload, drawn):
        assert f"sample {VICTIM}" in str(caught.value)
        assert "stage 0 (decode_image) failed: ValueError: cannot decode image" in str(caught.value)
