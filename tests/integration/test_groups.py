"""Shared preparation against real daemons: jobs that name one group share the servers' work on
each sample of an epoch (``client.dataset(..., group=...)``), and each still receives its own
epochs exactly once, in its own sampler's order, at its own batch size.

Every job here is a :class:`KSpeedClient` of its own (``job=`` in its config: its member name) with
``offload=1.0``: every sample goes through the servers' stages, randomly cropped and flipped from
``(SEED, epoch, sample, stage)``, so every job of a group receives the same bytes for a sample in an
epoch: those the :class:`Runner` makes of it in this process. Each test checks every job's batches,
images and labels, against those, for every epoch it read (or the part read before the job was
closed or killed).
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import LocalCluster, wait_for
from kspeed.errors import ConfigError, ConflictError
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.preprocess.runner import Runner
from tests.conftest import FAST_MANAGER
from tests.helpers import http_get
from tests.integration.test_client import config_for
from tests.integration.test_preprocess import PREPROCESSED, Photos, make_photos, shuffled, total
from tests.integration.test_production import metric

REPO = Path(__file__).resolve().parents[2]
SEED = 7  # every job's seed (random stages and the built-in sampler's order)
OTHER_ORDER = 11  # the seed of a job's own sampler: another order of the same samples
SIDE = 64
SAMPLE_BYTES = 3 * SIDE * SIDE
RING = 4 << 20
USER = "tests.integration.prep_functions"
LOCKSTEP_KEPT = 16  # outputs a group may keep while its jobs read in step (each sample taken by all soon)
SERVER_ARGS = ["--memory", "32MiB", "--region-size", "1MiB", "--preprocess-workers", "1"]

pytestmark = pytest.mark.timeout(90)


def pipeline(gate: str | None = None) -> Pipeline:
    """Decode, (with a ``gate``: wait for that file,) a random crop and a random flip (drawn from
    the seed, epoch, sample and stage), CHW; all on the servers."""
    held = [Stage(f"{USER}:hold", {"gate": gate})] if gate else []
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            *held,
            Stage("random_resized_crop", {"size": [SIDE, SIDE]}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, SIDE, SIDE), dtype="uint8")),
        ]
    )


def spec_of(photos: Photos, name: str, *, uri: str | None = None, gate: str | None = None) -> DatasetSpec:
    return DatasetSpec(name=name, uri=uri or str(photos.root), labels="dirname", pipeline=pipeline(gate))


def open_feed(client: KSpeedClient, spec: DatasetSpec, batch: int, group: str | None, **options):
    """``spec``'s feed for ``client``'s job in ``group``, every sample prepared on the servers."""
    options.setdefault("seed", SEED)
    return client.dataset(spec, batch, offload=1.0, num_workers=0, ring_bytes=RING, quiet=True, group=group, **options)


# -- what each job must receive ----------------------------------------------------------------------


@functools.cache
def _made(root: Path, keys: tuple[str, ...], epoch: int, gate: str | None) -> tuple[np.ndarray, ...]:
    photos, runner = Photos(root, list(keys)), Runner(pipeline(gate))
    return tuple(runner.run(photos.data(i), seed=SEED, epoch=epoch, sample=i) for i in range(len(keys)))


def made(photos: Photos, epoch: int, gate: str | None = None) -> tuple[np.ndarray, ...]:
    """Every sample of ``epoch`` after every stage, run here (once per epoch)."""
    return _made(photos.root, tuple(photos.keys), epoch, gate)


def other_sampler(n: int) -> DistributedSampler:
    return DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=OTHER_ORDER)


def other_order(n: int, epoch: int) -> list[int]:
    """The order of :func:`other_sampler` in ``epoch``."""
    sampler = other_sampler(n)
    sampler.set_epoch(epoch)
    return list(sampler)


def expected(
    photos: Photos, order: list[int], batch: int, epoch: int, drop_last: bool = False, gate: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``order`` in ``batch`` es, as ``(images, labels)``."""
    samples = made(photos, epoch, gate)
    out = []
    for start in range(0, len(order), batch):
        ids = order[start : start + batch]
        if drop_last and len(ids) < batch:
            break
        out.append(
            (torch.from_numpy(np.stack([samples[i] for i in ids])), torch.tensor([photos.label(i) for i in ids]))
        )
    return out


def check(got: list, want: list[tuple], what: str, *, whole: bool = True) -> None:
    """``got`` (batches of ``[images, labels]``) are ``want`` (all of it when ``whole``, else its
    first batches): the same images, bit for bit, and the same labels, batch by batch."""
    if whole:
        assert len(got) == len(want), f"{what}: {len(got)} batches where {len(want)} are due"
    assert len(got) <= len(want), f"{what}: {len(got)} batches where {len(want)} are due"
    for k, (batch, (images, labels)) in enumerate(zip(got, want)):
        assert len(batch) == 2, f"{what}: batch {k} is not (images, labels)"
        assert batch[0].shape == images.shape, f"{what}: batch {k} is {tuple(batch[0].shape)}"
        assert torch.equal(batch[1], labels), f"{what}: batch {k}'s labels {batch[1].tolist()} != {labels.tolist()}"
        if not torch.equal(batch[0], images):
            wrong = [i for i in range(len(images)) if not torch.equal(batch[0][i], images[i])]
            raise AssertionError(f"{what}: batch {k}: the samples at {wrong} are not what the pipeline makes of them")


def round_robin(iterators: dict[str, Iterator], into: dict[str, list], stop: Callable[[], bool] | None = None) -> None:
    """Take one batch of each job in turn into ``into[name]`` until every iterator is exhausted or
    ``stop()`` holds (asked after each batch). Nothing waits for another job, so one whose batch
    never comes holds the test until its timeout."""
    live = dict(iterators)
    while live:
        for name, it in list(live.items()):
            batch = next(it, None)
            if batch is None:
                del live[name]
                continue
            into[name].append(batch)
            if stop is not None and stop():
                return


def window_used(cluster: LocalCluster) -> float:
    """Window bytes in use, summed over the cluster's running servers."""
    return sum(
        metric(http_get(s.ready["http"], "/metrics")[1], "kspeed_server_window_bytes", '{kind="used"}')
        for s in cluster.servers
        if s.running
    )


def assert_window_empties(cluster: LocalCluster) -> None:
    """Every job closed: the servers' windows hold nothing (no shared output is left behind)."""
    wait_for(lambda: window_used(cluster) == 0 or None, 15, "the production windows to empty")


def server_log(cluster: LocalCluster) -> str:
    """The last lines of every server's log (for a failure's message)."""
    return "\n".join(f"{s.name}: {s.log_tail(15)}" for s in cluster.servers)


# -- the cluster ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(cluster, photos, gates)``: one server with one preprocessing worker (a window of a
    quarter of its 32 MiB) that may import :mod:`tests.integration.prep_functions`, whose
    :func:`hold` gates live in ``gates``. Shared by the module's tests, each of which closes what
    it opened and names its own dataset and group; stopped at the end, however the tests went."""
    photos = make_photos(tmp_path_factory.mktemp("photos"))
    gates = tmp_path_factory.mktemp("gates")
    os.chmod(gates, 0o777)  # (the sandboxed workers run as nobody when the tests run as root)
    cluster = LocalCluster(
        str(tmp_path_factory.mktemp("cluster")),
        servers=1,
        manager_args=FAST_MANAGER,
        server_args=[
            "--backend-allow",
            str(photos.root.parent),
            *SERVER_ARGS,
            "--preprocess-allow",
            "tests",
            "--preprocess-write-paths",
            str(gates),
        ],
        env={"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)},
    )
    try:
        cluster.start()
        yield cluster, photos, gates
    finally:
        cluster.stop()


@pytest.fixture
def jobs(served):
    """``job(name, cluster=None, **config) -> KSpeedClient``: a client of job ``name`` (its member
    name in a group), of the module's cluster unless another is given; all closed at the end."""
    clients: list[KSpeedClient] = []

    def job(name: str, cluster: LocalCluster | None = None, **config) -> KSpeedClient:
        clients.append(KSpeedClient(config=config_for(cluster or served[0], job=name, **config)))
        return clients[-1]

    yield job
    for client in clients:
        client.close()


# -- three jobs at once ----------------------------------------------------------------------------------


def test_three_jobs_interleaved_share_each_sample_once_per_epoch(served, jobs):
    """Three jobs at batch sizes 8, 12 (in an order of its own) and 5 (dropping the last batch),
    read batch by batch in turn for two epochs: each gets its own epochs exactly, and the server
    makes each sample of an epoch about once, not once per job."""
    cluster, photos, _ = served
    n = len(photos.keys)
    spec = spec_of(photos, "photos-three")
    setups = {
        "a": (8, lambda e: shuffled(n, e), {}),
        "b": (12, lambda e: other_order(n, e), {"sampler": other_sampler(n)}),
        "c": (5, lambda e: shuffled(n, e), {"drop_last": True}),
    }
    feeds = {name: open_feed(jobs(name), spec, batch, "three", **opts) for name, (batch, _, opts) in setups.items()}
    before = total(cluster, PREPROCESSED)
    epochs, per_epoch = 2, []
    for epoch in range(epochs):
        got: dict[str, list] = {name: [] for name in feeds}
        for ds in feeds.values():
            ds.set_epoch(epoch)
        round_robin({name: iter(ds) for name, ds in feeds.items()}, got)
        for name, (batch, order, opts) in setups.items():
            want = expected(photos, order(epoch), batch, epoch, opts.get("drop_last", False))
            check(got[name], want, f"job {name} epoch {epoch}")
        per_epoch.append(total(cluster, PREPROCESSED) - before - sum(per_epoch))
    figures = {name: ds.group_figures() for name, ds in feeds.items()}
    for ds in feeds.values():
        ds.close()

    a = figures["a"]
    assert a is not None and a["group"] == "three" and a["members"] == 3, a
    assert {f["member"] for f in figures.values()} == {"a", "b", "c"}, figures
    # Positions served an output made for another job's plan: two of every three, near enough.
    assert a["shared"] >= epochs * n, a
    for kind in ("produced", "shared", "alone"):  # each job's own counts add up to the group's
        assert sum(f["mine"][kind] for f in figures.values()) == a[kind], figures
    # Each sample made about once per epoch, as the group counts it and as the server's workers
    # ran it. Each job's next epoch is planned (and made) ahead, so up to one more epoch's worth
    # may have been made; three jobs alone make 3 x 2 x 48 = 288 and more.
    bound = 1.2 * epochs * n + n
    preprocessed = sum(per_epoch)
    summary = f"preprocessed per epoch {per_epoch}, figures {figures}"
    assert a["produced"] + a["alone"] <= bound, summary
    assert epochs * n <= preprocessed <= bound, summary
    # In step, no job lags: the window keeps (next to nothing: c's dropped samples) for a job that
    # will not take it.
    assert a["kept_bytes"] < LOCKSTEP_KEPT * SAMPLE_BYTES, summary
    assert_window_empties(cluster)


# -- members that come and go ------------------------------------------------------------------------


def test_a_job_joining_and_one_leaving_mid_epoch(served, jobs):
    """Jobs a and b read half an epoch; c opens its feed and starts its epoch 0; b is closed
    before its last batch. Each of them gets exactly its epochs (b the part it read), the group goes
    on with a and c for two more epochs, and once all are closed the window holds nothing."""
    cluster, photos, _ = served
    n = len(photos.keys)
    spec = spec_of(photos, "photos-join")
    a = open_feed(jobs("a"), spec, 8, "join")
    b = open_feed(jobs("b"), spec, 12, "join", sampler=other_sampler(n))
    got: dict[str, list] = {"a": [], "b": [], "c": []}
    its = {"a": iter(a), "b": iter(b)}
    round_robin(its, got, stop=lambda: len(got["a"]) == 3)  # half of a's epoch, two of b's four batches

    c = open_feed(jobs("c"), spec, 6, "join")
    its["c"] = iter(c)
    round_robin(its, got, stop=lambda: len(got["b"]) == 3)
    b.close()  # leaves mid-epoch, its iterator abandoned
    del its["b"]
    check(got["b"], expected(photos, other_order(n, 0), 12, 0), "job b epoch 0 (closed)", whole=False)
    assert len(got["b"]) == 3
    round_robin(its, got)
    check(got["a"], expected(photos, shuffled(n, 0), 8, 0), "job a epoch 0")
    check(got["c"], expected(photos, shuffled(n, 0), 6, 0), "job c epoch 0 (joined mid-epoch)")
    joined = wait_for(lambda: ((f := a.group_figures())["members"] == 2 and f) or None, 15, "b to leave the group")

    for epoch in (1, 2):
        got = {"a": [], "c": []}
        for ds in (a, c):
            ds.set_epoch(epoch)
        round_robin({"a": iter(a), "c": iter(c)}, got)
        check(got["a"], expected(photos, shuffled(n, epoch), 8, epoch), f"job a epoch {epoch}")
        check(got["c"], expected(photos, shuffled(n, epoch), 6, epoch), f"job c epoch {epoch}")
    figures = {"a": a.group_figures(), "c": c.group_figures()}
    # a and c shared their later epochs: one made each sample for both.
    assert figures["a"]["members"] == 2 and figures["a"]["shared"] > joined["shared"], (joined, figures)
    # In step, neither lags: the window keeps (next to nothing) for a member that will not take it.
    assert figures["a"]["kept_bytes"] < LOCKSTEP_KEPT * SAMPLE_BYTES, (joined, figures)
    a.close()
    wait_for(lambda: c.group_figures()["members"] == 1 or None, 15, "a to leave the group")
    c.close()
    assert_window_empties(cluster)


# -- a job killed --------------------------------------------------------------------------------------

# A job of one process: reads epoch 0 whole, says so, waits for a line on stdin, starts epoch 1
# (which plans epoch 2 ahead: its outputs are made for the group), reads one batch, says so and
# waits to be killed. What it read goes to files, to be checked by the test.
VICTIM = """
import sys, time, torch
from kspeed import KSpeedClient
from kspeed.config import ClientConfig, load_config
from tests.integration.test_groups import open_feed, spec_of
from tests.integration.test_preprocess import Photos

manager, root, keys, gate, out = sys.argv[1:6]
photos = Photos(__import__("pathlib").Path(root), keys.split(","))
config = load_config(ClientConfig, environ={}, overrides={"manager": manager, "security.auth": "none", "job": "victim"})
client = KSpeedClient(config=config)
ds = open_feed(client, spec_of(photos, "photos-killed", gate=gate), 6, "killed")
torch.save([[x.clone() for x in b] for b in ds], out + ".0")
print("epoch 0 read", flush=True)
sys.stdin.readline()
ds.set_epoch(1)
batches = iter(ds)
torch.save([[x.clone() for x in next(batches)]], out + ".1")
print("epoch 1 begun", flush=True)
time.sleep(600)
"""


def idle(cluster: LocalCluster) -> None:
    """Wait until the servers' workers preprocessed nothing for half a second."""
    seen = [total(cluster, PREPROCESSED)]

    def still() -> bool | None:
        time.sleep(0.5)
        seen.append(total(cluster, PREPROCESSED))
        return seen[-1] == seen[-2] or None

    wait_for(still, 20, "the preprocessing workers to be idle")


def said(process: subprocess.Popen, timeout: float) -> str:
    """The next line ``process`` writes, within ``timeout`` seconds."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"the victim job said nothing in {timeout} s"
    line = process.stdout.readline()
    assert line, f"the victim job ended: {process.wait(5)}"
    return line.strip()


@pytest.mark.timeout(120)
def test_a_job_killed_while_the_group_waits_on_its_outputs(served, jobs, tmp_path):
    """A job of the group is SIGKILLed while outputs it had made for the group (the others' next
    epoch) are still being made: the other job reads every epoch exactly, in bounded time."""
    cluster, photos, gates = served
    n = len(photos.keys)
    gate = gates / "killed"
    gate.touch()  # open: the pipeline's hold stage passes
    spec = spec_of(photos, "photos-killed", gate=str(gate))
    # (a batch whose server stays silent counts as lost after 10 s, not the default 60 s: a wait
    # for outputs that never come shows, and ends, sooner)
    a = open_feed(jobs("a", completion_timeout="10s"), spec, 8, "killed")
    got_a = [[], [], []]
    it = iter(a)
    got_a[0] += [next(it), next(it)]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    out = str(tmp_path / "victim")
    args = [cluster.address, str(photos.root), ",".join(photos.keys), str(gate), out]
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert said(victim, 60) == "epoch 0 read"
        idle(cluster)  # the epoch 1 both planned ahead is made
        gate.unlink()  # closed: what the victim makes for epoch 2 waits in the worker
        before = a.group_figures()
        victim.stdin.write("go\n")
        victim.stdin.flush()
        assert said(victim, 30) == "epoch 1 begun"
        # Beginning epoch 1, the victim planned epoch 2 ahead, which a (still at epoch 0) will
        # need: outputs made for the group, held in the worker.
        wait_for(
            lambda: a.group_figures()["produced"] > before["produced"] or None,
            10,
            "the victim's epoch 2 to be made for the group",
        )
        # a finishes epoch 0 and begins epoch 1, planning epoch 2 ahead: its positions of epoch 2
        # are placed at the outputs the victim's plan is having made.
        shared_before = a.group_figures()["mine"]["shared"]
        got_a[0] += list(it)
        a.set_epoch(1)
        it = iter(a)
        got_a[1].append(next(it))
        wait_for(
            lambda: a.group_figures()["mine"]["shared"] > shared_before or None,
            10,
            "a's epoch 2 to be placed at outputs made for the group",
        )
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
        victim.stdin.close()
        victim.stdout.close()
        gate.touch()
    wait_for(lambda: a.group_figures()["members"] == 1 or None, 15, "the killed job to leave the group")

    started = time.monotonic()
    got_a[1] += list(it)
    a.set_epoch(2)
    got_a[2] = list(a)
    took = time.monotonic() - started
    for epoch, batches in enumerate(got_a):
        check(batches, expected(photos, shuffled(n, epoch), 8, epoch, gate=str(gate)), f"job a epoch {epoch}")
    stats = {k: v for k, v in a.stats().items() if k in ("grants", "completions", "fenced_grants", "replaced_servers")}
    waited = f"job a took {took:.1f} s for an epoch and a half after the kill; {stats}\n{server_log(cluster)}"
    # Nothing waited for the dead job: its live server was never taken for lost.
    assert stats["fenced_grants"] == 0 and stats["replaced_servers"] == 0, waited
    assert took < 8, waited
    # What the victim read before it was killed was right too.
    check(torch.load(out + ".0"), expected(photos, shuffled(n, 0), 6, 0, gate=str(gate)), "the victim's epoch 0")
    check(
        torch.load(out + ".1"),
        expected(photos, shuffled(n, 1), 6, 1, gate=str(gate)),
        "the victim's epoch 1",
        whole=False,
    )
    a.close()
    assert_window_empties(cluster)


# -- a server killed -------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_server_killed_mid_epoch_under_a_group(cluster_factory, jobs, tmp_path):
    """Two servers over a backend of 20 ms a file and a spare: the holder of the larger share is
    killed while two jobs of a group read their epoch, its preprocessing held mid-task (a gate), so
    that its part of the epoch is in flight for both jobs; its share moves to the spare and both
    jobs get every epoch exactly once, in order, bytes intact. (Killed after a job's first batch
    instead, the victim had at times written all of both jobs' parts already: nothing to carry over.)"""
    photos = make_photos(tmp_path / "photos")
    n = len(photos.keys)
    gates = tmp_path / "gates"
    gates.mkdir()
    os.chmod(gates, 0o777)  # (the sandboxed workers run as nobody when the tests run as root)
    gate = gates / "failover"
    slow = ["--backend-allow", f"slowfile://{tmp_path}", "--backend-options", '{"slowfile": {"latency": 0.02}}']
    cluster = cluster_factory(
        2,
        server_args=[
            *slow,
            "--preload-threads",
            "2",
            "--production-threads",
            "2",
            *SERVER_ARGS,
            "--preprocess-allow",
            "tests",
            "--preprocess-write-paths",
            str(gates),
        ],
        env={"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)},
    )
    spec = spec_of(photos, "photos-failover", uri=f"slowfile://{photos.root}", gate=str(gate))
    feeds = {
        "a": open_feed(jobs("a", cluster, failover_timeout="60s"), spec, 8, "failover"),
        "b": open_feed(jobs("b", cluster, failover_timeout="60s"), spec, 12, "failover", sampler=other_sampler(n)),
    }
    orders = {"a": (8, lambda e: shuffled(n, e)), "b": (12, lambda e: other_order(n, e))}
    spare = cluster.add_server()  # registered after the dataset: it holds nothing
    shares = jobs("watcher", cluster).manager.dataset(spec.name).shares
    assert len({s.server_id for s in shares}) == 2 and spare.ready["id"] not in {s.server_id for s in shares}
    biggest = max(shares, key=lambda share: share.end_id - share.first_id)
    victim = next(s for s in cluster.servers if s.ready["id"] == biggest.server_id)
    for epoch in range(2):
        got: dict[str, list] = {"a": [], "b": []}
        for ds in feeds.values():
            ds.set_epoch(epoch)
        iterators = {name: iter(ds) for name, ds in feeds.items()}
        if epoch == 0:  # both servers' workers wait at the gate with epoch 0's samples: the victim dies
            wait_for(lambda: len(list(gates.glob("failover.*"))) >= 2, 60, "both servers' workers at the gate")
            victim.signal(signal.SIGKILL)
            wait_for(lambda: not victim.running, 10, "the victim gone")
            gate.touch()
        round_robin(iterators, got)
        for name, (batch, order) in orders.items():
            check(got[name], expected(photos, order(epoch), batch, epoch, gate=str(gate)), f"job {name} epoch {epoch}")
    # Neither job had any of the victim's part when it died: each carried it over once.
    replaced = {name: ds.stats()["replaced_servers"] for name, ds in feeds.items()}
    assert replaced == {"a": 1, "b": 1}, replaced
    figures = feeds["a"].group_figures()  # (the survivor's and the spare's)
    assert figures["members"] == 2 and figures["shared"] > 0, figures
    for ds in feeds.values():
        ds.close()


# -- refusals ------------------------------------------------------------------------------------------


def test_a_job_with_another_seed_is_refused_and_the_group_goes_on(served, jobs):
    cluster, photos, _ = served
    n = len(photos.keys)
    spec = spec_of(photos, "photos-seeds")
    a = open_feed(jobs("a"), spec, 8, "seeds")
    it = iter(a)
    got = [next(it)]
    b = open_feed(jobs("b"), spec, 12, "seeds", seed=SEED + 1)
    with pytest.raises(ConflictError, match=rf"drawn with seed {SEED}; this job's plan draws from seed {SEED + 1}"):
        next(iter(b))
    b.close()
    got += list(it)
    check(got, expected(photos, shuffled(n, 0), 8, 0), "job a epoch 0")
    a.set_epoch(1)
    check(list(a), expected(photos, shuffled(n, 1), 8, 1), "job a epoch 1")
    figures = a.group_figures()
    assert figures["members"] == 1 and figures["mine"]["alone"] == 0, figures  # b never joined
    a.close()

    # share="decoded" shares a dataset's stored decoded form: one not cached preprocessed has none.
    with pytest.raises(ConfigError, match="needs the dataset registered with cache='preprocessed'"):
        open_feed(jobs("d"), spec_of(photos, "photos-decoded"), 8, "decoded", share="decoded")
    assert_window_empties(cluster)


# -- the lag bound ---------------------------------------------------------------------------------------


def test_a_job_lagging_beyond_the_bound_is_served_alone(served, jobs):
    """With ``group_lag=4``, job a reads three epochs while b has read one batch; then b reads its
    three: what a made beyond b's reach (four samples past where b reads) was a's alone, never
    kept for b, and b has those made for it alone, the same bytes."""
    cluster, photos, _ = served
    n = len(photos.keys)
    spec = spec_of(photos, "photos-lag")
    a = open_feed(jobs("a"), spec, 8, "lag", group_lag=4)
    b = open_feed(jobs("b"), spec, 12, "lag", group_lag=4)
    its = {"a": iter(a), "b": iter(b)}
    got = {"a": [[next(its["a"])]], "b": [[next(its["b"])]]}  # both in the group, at epoch 0
    for name, ds, batch in (("a", a, 8), ("b", b, 12)):  # a all the way, then b
        got[name][0] += list(its[name])
        for epoch in (1, 2):
            ds.set_epoch(epoch)
            got[name].append(list(ds))
        if name == "a":
            lead = b.group_figures()
            assert lead["kept_bytes"] <= lead["cap_bytes"] == 4 * SAMPLE_BYTES, lead
        for epoch in range(3):
            check(got[name][epoch], expected(photos, shuffled(n, epoch), batch, epoch), f"job {name} epoch {epoch}")
    figures = b.group_figures()
    assert figures["members"] == 2, figures
    assert a.group_figures()["mine"]["alone"] > 0, figures
    assert figures["mine"]["alone"] >= n - 4, figures  # (epoch 2: what a made for it went, but for 4)
    a.close()
    b.close()
    assert_window_empties(cluster)


def test_a_member_resumes_from_its_state_in_the_group_or_alone(served, jobs):
    """A member's ``state_dict()`` taken mid-epoch resumes it in the group (a new process of the
    same job) or alone (no group): the rest of its epoch exactly, with the bytes the seed gives
    (those of the group's outputs), while the other member reads on; and the next epoch whole."""
    cluster, photos, _ = served
    n = len(photos.keys)
    spec = spec_of(photos, "photos-resume")
    batches = {"a": 8, "b": 6}
    feeds = {name: open_feed(jobs(name), spec, batch, "resume") for name, batch in batches.items()}
    got: dict[str, list] = {name: [] for name in feeds}
    its = {name: iter(ds) for name, ds in feeds.items()}
    for _ in range(3):
        for name in feeds:
            got[name].append(next(its[name]))
    states = {name: ds.state_dict() for name, ds in feeds.items()}
    assert all(state["batches"] == 3 for state in states.values()), states
    for name, ds in feeds.items():
        del its[name]
        ds.close()
    # a comes back in the group (its job's member name again), b alone
    resumed = {
        "a": open_feed(jobs("a"), spec, batches["a"], "resume"),
        "b": open_feed(jobs("b"), spec, batches["b"], None),
    }
    for name, ds in resumed.items():
        ds.load_state_dict(states[name])
    round_robin({name: iter(ds) for name, ds in resumed.items()}, got)
    for name, batch in batches.items():
        check(got[name], expected(photos, shuffled(n, 0), batch, 0), f"job {name} epoch 0, resumed after 3 batches")
    for name, ds in resumed.items():
        ds.set_epoch(1)
        check(list(ds), expected(photos, shuffled(n, 1), batches[name], 1), f"job {name} epoch 1")
    assert resumed["a"].group_figures()["members"] == 1  # (b left the group when it resumed alone)
    assert resumed["b"].group_figures() is None
    for ds in resumed.values():
        ds.close()
    assert_window_empties(cluster)
