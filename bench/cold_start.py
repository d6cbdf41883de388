"""Cold start: how long a training job waits for its data before the first step, and what it costs in memory.

For each tree size ``--files N`` (an ImageNet-like tree of N files of 200-600 random bytes in class
folders, made once and kept under ``--data-dir``; ``bench/_cold_data.py``), one run measures, every
timed call in a fresh Python process after its imports (``bench/_cold_jobs.py``):

- **listing**: ``torchvision.datasets.DatasetFolder(root, loader, extensions=(".bin",))`` on a warm
  page cache (one untimed run first), the median of ``--runs``: the reference;
- **register**: ``client.dataset(DatasetSpec(name, uri=tree, labels="dirname"), batch_size=64)``
  against a local cluster (``--servers``, fresh for each size) on a warm cache, each run under a
  fresh name (the dataset is removed after each run); **preload**: ``ds.preload(quiet=True)`` after
  it; the first batch after that;
- **attach**: while the first job holds the dataset (its last run, preloaded), ``--runs`` fresh
  processes of a second job each time ``client.dataset(same spec)``: nothing changed;
- **cold**: page cache dropped (``/proc/sys/vm/drop_caches``, or where refused each file evicted by
  ``posix_fadvise``), register and iterate, not preloaded: time from ``client.dataset()`` to the
  first batch; then, dropped again, register plus a full preload;
- **memory**: ``RssAnon``/``VmRSS`` of the client and of each server with its feeders, before
  register, after it, after the preload and after the first batch (first run, fresh servers); per
  sample, the growth divided by N.

Then, once per invocation:

- **manifest**: a ``key size`` manifest of ``--manifest-keys`` keys (10M by default; only the first
  ``--manifest-files`` files exist) registered with ``policy="stream"`` and a ``SequentialSampler``
  over the existing IDs: register, first batch, memory per key;
- **first run**: a new user's first run, the README's ``client.wrap(ImageFolder(root, transform=
  RandomResizedCrop(32) + ToTensor()), batch_size=64, num_workers=0)`` in a fresh process against a
  warm cluster (up, and past the first wrap, which starts its servers' preprocessing workers and is
  reported apart), each run on its own copy of the photographs, to the first batch (imports
  included), against a plain ``DataLoader`` in a fresh process.

Targets are in ``bench/_cold_report.py``. A section that fails records its error and the others
still run. Writes JSON (after every section) and a PNG::

    python bench/cold_start.py --files 40000 --files 1280000 --json bench/results/cold_start.json \\
        --png bench/results/cold_start.png
    python bench/cold_start.py --quick     # 2,000 files, 100k keys: checks the script in about a minute
    python bench/cold_start.py --skip trees --skip manifest   # the first run only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _cold_data import SpaceError, make_manifest, make_tree
from _cold_report import TARGETS, chart, first_run_verdict, median, memory_slope, per_sample, summary, verdicts
from _common import GIB, MIB, machine_info, write_json

from kspeed.cli.cluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "_cold_jobs.py"
DEFAULT_FILES = (40_000, 1_280_000)
QUICK = {"files": [2_000], "manifest_keys": 100_000, "runs": 1, "photos": 32, "first_runs": 1}
SECTIONS = ("trees", "listing", "attach", "cold", "manifest", "first-run")  # --skip: "trees" is every --files size
REGION = 128 * MIB  # the servers' default region size: pools are sized in whole regions
POOL_FLOOR = GIB  # the servers' default --memory
POOL_PER_BYTE = 1.5  # pool bytes per byte of the tree, beyond the window and the region rounding
POOL_SLACK = 256 * MIB
WARM_SECTIONS = ("register", "preload", "first_batch_warm", "memory", "attach")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def child_timeout(files: int) -> float:
    """Seconds a child may run: a few minutes, plus time for a cold read of ``files`` files."""
    return 300.0 + files / 500


class ChildError(Exception):
    """A child process failed (the message has its stderr's tail)."""


def _docs(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_child(role: str, cfg: dict, timeout: float) -> dict:
    """Run one role of ``_cold_jobs.py`` and merge the JSON lines it printed."""
    done = subprocess.run(
        [sys.executable, str(JOBS), role, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if done.returncode != 0:
        raise ChildError(f"{role} exited with status {done.returncode}: {done.stderr.strip()[-1500:]}")
    merged: dict = {}
    for doc in _docs(done.stdout):
        merged.update(doc)
    return merged


def guarded(owner: dict, key: str, fn, *args) -> None:
    """``owner[key] = fn(*args)``, or the error it raised: one failing section never stops the others."""
    try:
        owner[key] = fn(*args)
    except Exception as exc:  # recorded in the JSON; the run goes on
        owner[key] = {"error": f"{type(exc).__name__}: {exc}"}
        say(f"  {key}: {owner[key]['error']}")


class BenchCluster:
    """A fresh local cluster (``servers`` servers, pools sized for ``data_bytes``) for one section.

    Its state lives in a temporary directory and its pools in one under ``/dev/shm`` when that has
    room; both go when it stops.
    """

    def __init__(self, allow: str, data_bytes: int, servers: int) -> None:
        memory = max(POOL_FLOOR, int(POOL_PER_BYTE * data_bytes / servers) + POOL_SLACK)
        self.memory = -(-memory // REGION) * REGION
        self.servers = servers
        self.state = tempfile.mkdtemp(prefix="kspeed-cold-cluster-")
        shm = "/dev/shm"
        room = shutil.disk_usage(shm).free if os.path.isdir(shm) else 0
        self.pools = tempfile.mkdtemp(
            prefix="kspeed-cold-pool-", dir=shm if room > servers * self.memory + GIB else None
        )
        self.cluster = LocalCluster(
            self.state,
            servers=servers,
            pool_root=self.pools,
            server_args=["--backend-allow", allow, "--memory", str(self.memory), "--keep-pool-on-exit", "false"],
        )
        self.start_s = 0.0

    def __enter__(self) -> BenchCluster:
        started = time.perf_counter()
        try:
            self.cluster.start(timeout=60)
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [server.process.pid for server in self.cluster.servers]

    def describe(self) -> dict:
        return {"servers": self.servers, "memory_bytes": self.memory, "pool_dir": self.pools, "start_s": self.start_s}

    def close(self) -> None:
        try:
            self.cluster.stop()
        finally:
            shutil.rmtree(self.pools, ignore_errors=True)
            shutil.rmtree(self.state, ignore_errors=True)


def listing(tree, runs: int) -> dict:
    """DatasetFolder over the tree in fresh processes, the median of ``runs``, after a walk here
    that brings the tree's directories into the cache."""
    started = time.perf_counter()
    seen = sum(len(names) for _, _, names in os.walk(tree.root))
    walked = time.perf_counter() - started
    cfg = {"uri": tree.root, "extension": tree.extension}
    timed = [run_child("listing", cfg, child_timeout(tree.files)) for _ in range(runs)]
    if seen != tree.files or timed[0]["samples"] != tree.files:
        raise ChildError(f"the tree has {tree.files} files; found {seen} walking it, {timed[0]['samples']} listing it")
    return {"median_s": median([r["listing_s"] for r in timed]), "warmup_walk_s": walked, "runs": timed}


def first_job(tree, args: argparse.Namespace, allow: str) -> dict:
    """One fresh cluster; the first job's warm runs (holding the last for the attaches), its cold runs."""
    parts: dict = {}
    with BenchCluster(allow, tree.bytes, args.servers) as bench:
        parts["cluster"] = bench.describe()
        say(f"  cluster up in {bench.start_s:.1f}s ({args.servers} server(s), {bench.memory / GIB:.2f} GiB each)")
        cfg = {
            "address": bench.cluster.address,
            "server_pids": bench.pids,
            "uri": tree.root,
            "labels": "dirname",
            "name": f"cold-{tree.files}",
            "batch_size": args.batch_size,
            "runs": args.runs,
            "hold": "attach" not in args.skip,
            "cold": "cold" not in args.skip,
            "evict": "fadvise" if args.no_drop_caches else "drop_caches",
        }
        docs, attaches = _hold_and_attach(cfg, args, child_timeout(tree.files))
    merged: dict = {}
    for doc in docs:
        merged.update({k: v for k, v in doc.items() if k not in ("part", "error", "trace")})
        if "error" in doc:
            parts.setdefault("errors", []).append({k: doc[k] for k in ("part", "error", "trace")})
    warm = merged.get("warm") or []
    parts["job"] = {k: merged.get(k) for k in ("imports_s", "connect_s")}
    for key, field in (
        ("register", "register_s"),
        ("dataset", "dataset_s"),
        ("preload", "preload_s"),
        ("first_batch_warm", "first_batch_s"),
    ):
        values = [run[field] for run in warm]
        parts[key] = {"median_s": median(values), "runs": values}
    if "memory" in merged:
        parts["memory"] = {"per_sample": per_sample(merged["memory"], tree.files), "snapshots": merged["memory"]}
    if cfg["hold"]:
        times = [a["attach_s"] for a in attaches if "attach_s" in a]
        parts["attach"] = {
            "median_s": median(times),
            "call_median_s": median([a["attach_call_s"] for a in attaches if "attach_call_s" in a]),
            "connect_median_s": median([a["connect_s"] for a in attaches if "connect_s" in a]),
            "runs": attaches,
        }
        if attaches and not times:
            parts["attach"]["error"] = attaches[0].get("error", "no attach timed")
    if cfg["cold"]:
        parts["cold"] = merged.get("cold") or {}
    warm_sections = [k for k in WARM_SECTIONS if k != "attach" or cfg["hold"]]
    feeds = {"warm": warm_sections, "cold": ["cold"] if cfg["cold"] else []}
    for error in parts.get("errors", []):  # a part that failed marks each section it feeds (the job: all)
        for key in feeds.get(error["part"], warm_sections + feeds["cold"]):
            parts[key] = {**parts.get(key, {}), "error": error["error"]}
    return parts


def _hold_and_attach(cfg: dict, args: argparse.Namespace, timeout: float) -> tuple[list[dict], list[dict]]:
    """Run the first job; when it holds its dataset, run the second jobs' attaches, then let it go on."""
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            [sys.executable, str(JOBS), "job", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        docs, attaches, status = [], [], None
        try:
            for line in proc.stdout:
                if not line.startswith("{"):
                    continue
                doc = json.loads(line)
                docs.append(doc)
                if "hold" in doc:
                    attaches = _attaches(cfg, doc["hold"], args.runs, timeout)
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
            status = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if status != 0:
            errors.seek(0)
            tail = errors.read().strip()[-1500:]
            docs.append({"part": "job", "error": f"the first job exited with status {status}: {tail}", "trace": ""})
    return docs, attaches


def _attaches(cfg: dict, name: str, runs: int, timeout: float) -> list[dict]:
    second = {k: cfg[k] for k in ("address", "uri", "labels", "batch_size")}
    out = []
    for _ in range(runs):
        try:
            out.append(run_child("attach", {**second, "name": name}, timeout))
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


def one_size(files: int, args: argparse.Namespace, data_dir: Path, allow: str) -> dict:
    """Every section of one tree size."""
    entry: dict = {"files": files}
    say(f"{files:,} files")
    started = time.perf_counter()
    try:
        tree, reused = make_tree(data_dir, files, say=say)
    except (SpaceError, OSError) as exc:
        entry["tree"] = {"error": f"{type(exc).__name__}: {exc}"}
        say(f"  tree: {entry['tree']['error']}")
        return entry
    entry["tree"] = {
        **dataclasses.asdict(tree),
        "reused": reused,
        "made_s": None if reused else time.perf_counter() - started,
    }
    if "listing" not in args.skip:
        guarded(entry, "listing", listing, tree, args.runs)
    try:
        entry.update(first_job(tree, args, allow))
    except Exception as exc:
        entry["register"] = {"error": f"{type(exc).__name__}: {exc}"}
        say(f"  register: {entry['register']['error']}")
    entry["verdicts"] = verdicts(entry)
    return entry


def manifest_section(args: argparse.Namespace, data_dir: Path, allow: str) -> dict:
    """Register a manifest of many keys (most without a file) and take the first batch of its first IDs."""
    manifest, reused = make_manifest(data_dir, args.manifest_keys, args.manifest_files, say=say)
    with open(manifest.path, "rb") as fh:  # warm, as the trees are
        while fh.read(16 * MIB):
            pass
    # The pool holds the window only (policy "stream"), not the keys' bytes: size it for the files that exist.
    with BenchCluster(allow, manifest.files * 600, args.servers) as bench:
        cfg = {
            "address": bench.cluster.address,
            "server_pids": bench.pids,
            "uri": manifest.path,
            "kind": "manifest",
            "policy": "stream",
            "name": f"manifest-{manifest.keys}",
            "batch_size": args.batch_size,
            "sampler_ids": manifest.files,
        }
        got = run_child("manifest", cfg, child_timeout(manifest.keys // 10))
    return {
        "keys": manifest.keys,
        "files": manifest.files,
        "reused": reused,
        "register_s": got["register_s"],
        "first_batch_s": got["first_batch_s"],
        "per_sample": per_sample(got["memory"], manifest.keys),
        "snapshots": got["memory"],
    }


COMMON = r"""
import json, sys, time
t0 = time.monotonic()
import torch
from torchvision import transforms
from torchvision.datasets import ImageFolder
from kspeed import KSpeedClient
t1 = time.monotonic()
tf = transforms.Compose([transforms.RandomResizedCrop(32), transforms.ToTensor()])
folder = ImageFolder(sys.argv[1], transform=tf)
"""
KSPEED = (
    COMMON
    + r"""
client = KSpeedClient()
loader = client.wrap(folder, batch_size=64, num_workers=0)
t2 = time.monotonic()
"""
)
BASELINE = (
    COMMON
    + r"""
loader = torch.utils.data.DataLoader(folder, batch_size=64, shuffle=True, num_workers=0)
t2 = time.monotonic()
"""
)
ITERATE = r"""
batches = iter(loader)
next(batches)
t3 = time.monotonic()
for _ in batches:
    pass
t4 = time.monotonic()
print(json.dumps({"imports_s": t1 - t0, "wrap_s": t2 - t1, "first_batch_s": t3 - t2, "to_first_batch_s": t3 - t0,
                  "epoch_s": t4 - t2}))
"""


def run_script(code: str, root: Path, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise ChildError(f"child failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    return {key: round(median([r[key] for r in runs]), 3) for key in runs[0]}


def first_run(args: argparse.Namespace) -> dict:
    """The README's wrap in a fresh process, and a plain DataLoader's run, on one cluster.

    The first wrap on the just-started cluster is reported apart (``fresh_cluster``): its servers
    start their preprocessing workers for the first pipeline they see. The timed runs then find a
    warm cluster, each on its own copy of the photographs (a new dataset: registered and preloaded,
    never attached to one cached already)."""
    from preprocess import write_photos

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()  # one untimed process first: the imports' files in the page cache
    subprocess.run([sys.executable, "-c", "import torch, torchvision, kspeed"], env=env, check=True, timeout=600)
    warmup = time.perf_counter() - started
    kspeed, baseline = [], []
    with tempfile.TemporaryDirectory(prefix="kspeed-cold-photos-") as tmp:
        roots = [Path(tmp) / f"photos-{run}" for run in range(args.first_runs + 1)]
        total = 0
        for root in roots:
            total = write_photos(root, args.photos)
        with BenchCluster(tmp, total * len(roots), 1) as bench:
            cluster_env = {**env, "KSPEED_MANAGER": bench.cluster.address}
            fresh = run_script(KSPEED + ITERATE, roots[0], cluster_env)
            say(f"  first wrap on a fresh cluster: {fresh}")
            for run, root in enumerate(roots[1:]):
                kspeed.append(run_script(KSPEED + ITERATE, root, cluster_env))
                baseline.append(run_script(BASELINE + ITERATE, root, env))
                say(f"  first run {run}: kspeed {kspeed[-1]}, dataloader {baseline[-1]}")
    out = {
        "import_warmup_s": warmup,
        "photos": args.photos,
        "photo_bytes": total,
        "fresh_cluster": fresh,
        "kspeed": {"median": medians(kspeed), "runs": kspeed},
        "dataloader": {"median": medians(baseline), "runs": baseline},
    }
    out["verdict"] = first_run_verdict(out)
    return out


def file_counts(values: list[str] | None) -> list[int]:
    """``--files`` values, each a count or a comma-separated list of counts (``40000,1.28e6`` too)."""
    if not values:
        return list(DEFAULT_FILES)
    counts = [int(float(v)) for value in values for v in value.split(",") if v.strip()]
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"--files: counts must be positive, got {counts}")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--files", action="append", help="tree sizes (repeatable or comma-separated; default 40000,1280000)"
    )
    parser.add_argument("--manifest-keys", type=int, default=10_000_000, help="keys in the manifest (0: no manifest)")
    parser.add_argument("--manifest-files", type=int, default=4096, help="the manifest's first keys whose files exist")
    parser.add_argument("--servers", type=int, default=1, help="servers in each cluster")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of the listing, register and attach")
    parser.add_argument("--first-runs", type=int, default=3, help="first runs (fresh clusters) and baselines to time")
    parser.add_argument("--photos", type=int, default=256, help="JPEGs in the first run's folder")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data-dir", default="/var/tmp/kspeed-cold-start", help="where the trees are made and kept")
    parser.add_argument("--skip", action="append", default=[], choices=SECTIONS, help="leave a section out")
    parser.add_argument("--no-drop-caches", action="store_true", help="evict the tree by fadvise, not drop_caches")
    parser.add_argument("--quick", action="store_true", help="2,000 files, 100k keys, 1 run each: checks the script")
    parser.add_argument("--json", help="write the results here (stdout when omitted)")
    parser.add_argument("--png", help="write the chart here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    else:
        args.files = file_counts(args.files)
    if args.runs < 1 or args.servers < 1:
        parser.error("--runs and --servers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    allow = str(data_dir)
    doc: dict = {
        "bench": "cold_start",
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
        "targets": TARGETS,
        "sizes": [],
    }

    def save() -> None:
        if args.json:
            write_json(args.json, doc)

    if "first-run" not in args.skip:  # first: the sizes' cold runs drop the page cache, imports included
        say("first run")
        guarded(doc, "first_run", first_run, args)
        save()
    for files in args.files if "trees" not in args.skip else ():
        doc["sizes"].append(one_size(files, args, data_dir, allow))
        save()
    if args.manifest_keys and "manifest" not in args.skip:
        say(f"manifest of {args.manifest_keys:,} keys")
        guarded(doc, "manifest", manifest_section, args, data_dir, allow)
    doc["memory_slope"] = memory_slope(doc)
    write_json(args.json, doc)
    for line in summary(doc):
        say(line)
    if args.png:
        try:
            chart(args.png, doc)
        except Exception as exc:  # the JSON is written already
            say(f"chart: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
