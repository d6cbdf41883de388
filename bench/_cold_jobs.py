"""The cold-start benchmark's child processes, each a fresh Python process started by ``cold_start.py``.

Run as ``python bench/_cold_jobs.py ROLE CONFIG_JSON``; each prints JSON lines on stdout (the last
line its result) and times only the calls it names, after its own imports:

- ``listing``: ``DatasetFolder(root, loader, extensions)`` over a tree;
- ``job``: the first training job: per run, ``client.dataset()`` (register), ``ds.preload()`` and
  the first batch, with this process's and the servers' memory around them in the first run; in
  the last run, after its first batch, it prints ``{"hold": NAME}`` and waits for a line on stdin
  while other jobs attach; then, cold (page cache dropped), register to the first batch, and register plus a full
  preload;
- ``attach``: a second job's ``client.dataset()`` of a dataset the first one holds;
- ``manifest``: register a manifest (``policy="stream"``) and iterate to the first batch of a
  sampler over its first IDs (the only keys whose files exist).

Memory is read from ``/proc/<pid>/status``: ``RssAnon`` (the process's own heap, where per-sample
state lives), ``RssFile`` and ``RssShmem`` (mapped files and shared memory: a server's pool), for a
process and, for a server, every process under it (its feeders).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

__all__ = ["descendants", "memory_snapshot", "process_memory"]

STATUS_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
FREE_TIMEOUT = 120.0  # seconds a removed dataset's memory may take to come back to the servers


def process_memory(pid: int) -> dict[str, int]:
    """``rss``, ``anon``, ``file`` and ``shmem`` bytes of process ``pid`` (zeros once it is gone)."""
    out = dict.fromkeys(STATUS_FIELDS.values(), 0)
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in STATUS_FIELDS:
                    out[STATUS_FIELDS[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, their children, ...), from ``/proc/*/stat``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return sorted(found)


def tree_memory(pid: int) -> dict:
    """A process's memory (``self``), the sum of its descendants' (``children``) and both (``total``)."""
    own = process_memory(pid)
    kids = [process_memory(p) for p in descendants(pid)]
    children = {k: sum(m[k] for m in kids) for k in own}
    return {"pid": pid, "self": own, "children": children, "processes": 1 + len(kids),
            "total": {k: own[k] + children[k] for k in own}}  # fmt: skip


def memory_snapshot(server_pids: list[int]) -> dict:
    """This process's memory and each server's (with its descendants)."""
    return {"client": process_memory(os.getpid()), "servers": [tree_memory(p) for p in server_pids]}


def emit(doc: dict) -> None:
    print(json.dumps(doc), flush=True)


def failure(part: str, exc: BaseException) -> dict:
    return {"part": part, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=6)[-2000:]}


def client_for(cfg: dict, job: str):
    from kspeed import KSpeedClient
    from kspeed.config import ClientConfig, load_config

    overrides = {"manager": cfg["address"], "security.auth": "none", "job": job}
    return KSpeedClient(config=load_config(ClientConfig, environ={}, overrides=overrides))


def spec_for(cfg: dict, name: str):
    from kspeed import DatasetSpec

    return DatasetSpec(name=name, uri=cfg["uri"], labels=cfg.get("labels", ""), kind=cfg.get("kind", "auto"),
                       policy=cfg.get("policy", "auto"))  # fmt: skip


def remove(client, name: str) -> None:
    """Remove ``name`` (if closing its last lease has not already) and wait until the servers hold
    none of its memory (the production window's regions stay reserved)."""
    from kspeed.cli.cluster import wait_for
    from kspeed.errors import NotFoundError

    with contextlib.suppress(NotFoundError):
        client.manager.remove_dataset(name, force=True)
    wait_for(
        lambda: all(
            r.inventory.regions_free + r.inventory.regions_window == r.inventory.regions_total
            for r in client.manager.servers()
        ),
        FREE_TIMEOUT,
        f"the servers to free the memory of {name}",
    )


def evict(cfg: dict) -> str:
    """Make the tree cold: drop the page cache, or where that is refused evict the tree's files."""
    from _cold_data import drop_page_cache, evict_files

    if cfg.get("evict", "drop_caches") == "drop_caches":
        why = drop_page_cache()
        if why is None:
            return "drop_caches"
    else:
        why = "asked for fadvise"
    evict_files(cfg["uri"])
    return f"fadvise (dentries and inodes stay cached; {why})"


def role_listing(cfg: dict) -> None:
    from torchvision.datasets import DatasetFolder

    started = time.perf_counter()
    folder = DatasetFolder(cfg["uri"], loader=str, extensions=(cfg["extension"],))
    elapsed = time.perf_counter() - started
    emit({"listing_s": elapsed, "samples": len(folder), "classes": len(folder.classes)})


def role_job(cfg: dict) -> None:
    started = time.perf_counter()
    import torch  # noqa: F401  (what a training script has imported before it asks for data)

    imported = time.perf_counter()
    client = client_for(cfg, "cold-start-first")
    calls = time_registrations(client)
    emit({"imports_s": imported - started, "connect_s": time.perf_counter() - imported})
    pids, batch = cfg["server_pids"], cfg["batch_size"]
    runs = []
    try:
        for run in range(cfg["runs"]):
            name = f"{cfg['name']}-w{run}"
            first = run == 0
            memory = {"before": memory_snapshot(pids)} if first else {}
            t0 = time.perf_counter()
            ds = client.dataset(spec_for(cfg, name), batch_size=batch, quiet=True)
            t1 = time.perf_counter()
            if first:
                memory["registered"] = memory_snapshot(pids)
            ds.preload(quiet=True)
            t2 = time.perf_counter()
            if first:
                memory["preloaded"] = memory_snapshot(pids)
            t3 = time.perf_counter()
            got = next(iter(ds))
            t4 = time.perf_counter()
            if first:
                memory["first_batch"] = memory_snapshot(pids)
            got.release()
            if run == cfg["runs"] - 1 and cfg.get("hold"):  # after the memory is read: a second job costs some
                emit({"hold": name})
                sys.stdin.readline()
            samples = ds.num_samples
            ds.close()
            remove(client, name)
            runs.append(
                {
                    "register_s": calls[-1],
                    "dataset_s": t1 - t0,
                    "preload_s": t2 - t1,
                    "first_batch_s": t4 - t3,
                    "samples": samples,
                }
            )
            if first:
                emit({"memory": memory})
        emit({"warm": runs})
    except Exception as exc:
        emit({"warm": runs, **failure("warm", exc)})
    if cfg.get("cold"):
        try:
            emit({"cold": cold_runs(client, cfg)})
        except Exception as exc:
            emit({"cold": None, **failure("cold", exc)})
    client.close()


def cold_runs(client, cfg: dict) -> dict:
    """Cold tree, fresh names: register and iterate to the first batch; then register and preload."""
    batch = cfg["batch_size"]
    name = f"{cfg['name']}-c"
    how = evict(cfg)
    t0 = time.perf_counter()
    ds = client.dataset(spec_for(cfg, f"{name}0"), batch_size=batch, quiet=True)
    t1 = time.perf_counter()
    got = next(iter(ds))
    t2 = time.perf_counter()
    got.release()
    ds.close()
    remove(client, f"{name}0")
    how_again = evict(cfg)
    t3 = time.perf_counter()
    ds = client.dataset(spec_for(cfg, f"{name}1"), batch_size=batch, quiet=True)
    t4 = time.perf_counter()
    ds.preload(quiet=True)
    t5 = time.perf_counter()
    ds.close()
    remove(client, f"{name}1")
    return {
        "evicted_by": how if how == how_again else f"{how}; then {how_again}",
        "first_batch_s": t2 - t0,
        "first_batch_register_s": t1 - t0,
        "first_batch_after_register_s": t2 - t1,
        "register_preload_s": t5 - t3,
        "preload_register_s": t4 - t3,
        "preload_after_register_s": t5 - t4,
    }


def time_registrations(client) -> list[float]:
    """Seconds of each of ``client``'s calls that register or attach a dataset at the manager (its
    ``CreateDataset``: the servers list, allocate and hold, or check an attach), appended as made.
    The rest of ``client.dataset()`` is the job's own setup (its receive ring, its connections)."""
    seconds: list[float] = []
    create = client.manager.create_dataset

    def timed(*args, **kwargs):
        begun = time.perf_counter()
        try:
            return create(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - begun)

    client.manager.create_dataset = timed
    return seconds


def role_attach(cfg: dict) -> None:
    started = time.perf_counter()
    import torch  # noqa: F401

    imported = time.perf_counter()
    client = client_for(cfg, "cold-start-second")
    calls = time_registrations(client)
    connected = time.perf_counter()
    ds = client.dataset(spec_for(cfg, cfg["name"]), batch_size=cfg["batch_size"], quiet=True)
    attached = time.perf_counter()
    ds.close()
    client.close()
    emit(
        {
            "imports_s": imported - started,
            "connect_s": connected - imported,
            "attach_s": attached - connected,
            "attach_call_s": calls[-1],
        }
    )


def role_manifest(cfg: dict) -> None:
    from torch.utils.data import SequentialSampler

    client = client_for(cfg, "cold-start-manifest")
    pids = cfg["server_pids"]
    memory = {"before": memory_snapshot(pids)}
    sampler = SequentialSampler(range(cfg["sampler_ids"]))
    t0 = time.perf_counter()
    ds = client.dataset(spec_for(cfg, cfg["name"]), batch_size=cfg["batch_size"], sampler=sampler, quiet=True)
    t1 = time.perf_counter()
    memory["registered"] = memory_snapshot(pids)
    t2 = time.perf_counter()
    got = next(iter(ds))
    t3 = time.perf_counter()
    memory["first_batch"] = memory_snapshot(pids)
    got.release()
    emit({"register_s": t1 - t0, "first_batch_s": t3 - t2, "samples": ds.num_samples, "memory": memory})
    ds.close()
    client.close()


ROLES = {"listing": role_listing, "job": role_job, "attach": role_attach, "manifest": role_manifest}

if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
