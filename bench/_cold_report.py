"""The cold-start benchmark's targets, its memory per sample, its summary lines and its chart.

Targets (issue "Cold start at listing speed"), each against a figure of the same run:

- register (the manager's ``CreateDataset`` that ``client.dataset()`` makes for a new dataset: the
  servers list, allocate and hold it; on a warm page cache) at most 2x ``DatasetFolder``'s listing.
  ``client.dataset()`` as a whole adds the job's own setup (its receive ring, its connections),
  reported beside it;
- a second job's attach, nothing changed, ``client.dataset()`` as a whole, at most 0.2 s + 1x the
  listing, and under 0.5 s at 1.28M files;
- on a cold page cache, register to the first batch under 25% of register plus a full preload;
- memory per sample (``RssAnon`` grown since before register, the largest growth read after
  register, after the preload and after the first batch): under 100 B on each server (with its
  feeders), under 50 B in the client;
- a new user's first run (the README's ``wrap``): first batch within 1 s of a plain ``DataLoader``'s.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["TARGETS", "chart", "first_run_verdict", "median", "memory_slope", "per_sample", "summary", "verdicts"]

TARGETS = {
    "register_per_listing": 2.0,
    "attach_base_s": 0.2,
    "attach_per_listing": 1.0,
    "attach_at_imagenet_s": 0.5,
    "imagenet_files": 1_280_000,
    "cold_first_batch_share": 0.25,
    "server_bytes_per_sample": 100.0,
    "client_bytes_per_sample": 50.0,
    "first_run_extra_s": 1.0,
}
STAGES = ("registered", "preloaded", "first_batch")
MEMORY_STAGE = "largest"  # the memory targets hold at every stage read
TARGET_STYLE = {"color": "black", "linestyle": "--", "marker": "_", "markersize": 16}


def median(values: list[float]) -> float | None:
    """The median of ``values``, or None when there are none."""
    return statistics.median(values) if values else None


def per_sample(memory: dict, samples: int) -> dict:
    """Bytes per sample each process grew by since ``memory["before"]``, at each later stage.

    Returns, per stage, ``client`` (``RssAnon`` and ``VmRSS`` growth of the client, per sample) and
    ``servers`` (the same for each server with its descendants), plus ``server_max``: the largest
    server's ``RssAnon`` growth; and ``largest``: the largest ``RssAnon`` growth of any stage, of the
    client and of a server (registering may take more for a while than it keeps), which the
    targets are checked against.
    """
    before = memory["before"]
    out = {}
    for stage in STAGES:
        if stage not in memory:
            continue
        now = memory[stage]
        servers = [
            {k: (a["total"][k] - b["total"][k]) / samples for k in ("anon", "rss")}
            for b, a in zip(before["servers"], now["servers"], strict=True)
        ]
        out[stage] = {
            "client": {k: (now["client"][k] - before["client"][k]) / samples for k in ("anon", "rss")},
            "servers": servers,
            "server_max": max((s["anon"] for s in servers), default=None),
        }
    if out:
        out["largest"] = {
            "client": {"anon": max(v["client"]["anon"] for v in out.values())},
            "server_max": max(v["server_max"] for v in out.values() if v["server_max"] is not None),
        }
    return out


def memory_slope(doc: dict) -> dict | None:
    """Bytes per extra sample between the smallest and the largest tree (fixed costs cancel out):
    the growth of ``RssAnon`` to the first batch, server (largest) and client."""
    points = []
    for entry in doc["sizes"]:
        per = entry.get("memory", {}).get("per_sample", {}).get(MEMORY_STAGE)
        if per and per.get("server_max") is not None:
            n = entry["files"]
            points.append((n, per["server_max"] * n, per["client"]["anon"] * n))
    if len(points) < 2 or points[0][0] == points[-1][0]:
        return None
    (n0, s0, c0), (n1, s1, c1) = min(points), max(points)
    return {"from_files": n0, "to_files": n1, "server": (s1 - s0) / (n1 - n0), "client": (c1 - c0) / (n1 - n0)}


def _check(value: float | None, limit: float, below: bool = False) -> dict | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return {"value": value, "limit": limit, "met": value < limit if below else value <= limit}


def verdicts(entry: dict, targets: dict = TARGETS) -> dict:
    """Each target that ``entry`` (one tree size's results) has the figures for: value, limit, met."""
    listing = entry.get("listing", {}).get("median_s")
    register = entry.get("register", {}).get("median_s")
    attach = entry.get("attach", {}).get("median_s")
    cold = entry.get("cold", {})
    memory = entry.get("memory", {}).get("per_sample", {}).get(MEMORY_STAGE, {})
    out = {}
    if listing is not None:
        out["register"] = _check(register, targets["register_per_listing"] * listing)
        out["attach"] = _check(attach, targets["attach_base_s"] + targets["attach_per_listing"] * listing)
    if entry.get("files", 0) >= targets["imagenet_files"]:
        out["attach_imagenet"] = _check(attach, targets["attach_at_imagenet_s"], below=True)
    if cold.get("register_preload_s"):
        out["cold_first_batch"] = _check(
            cold.get("first_batch_s"), targets["cold_first_batch_share"] * cold["register_preload_s"], below=True
        )
    out["server_memory"] = _check(memory.get("server_max"), targets["server_bytes_per_sample"], below=True)
    out["client_memory"] = _check(memory.get("client", {}).get("anon"), targets["client_bytes_per_sample"], below=True)
    return {k: v for k, v in out.items() if v is not None}


def first_run_verdict(first_run: dict, targets: dict = TARGETS) -> dict | None:
    """The first-run target: KSpeed's time to the first batch (imports, wrap, first batch) within
    ``first_run_extra_s`` of the plain DataLoader's (imports, DataLoader, first batch)."""
    try:
        kspeed = first_run["kspeed"]["median"]["to_first_batch_s"]
        plain = first_run["dataloader"]["median"]["to_first_batch_s"]
    except (KeyError, TypeError):
        return None
    extra = kspeed - plain
    return {"value": extra, "limit": targets["first_run_extra_s"], "met": extra <= targets["first_run_extra_s"]}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def summary(doc: dict) -> list[str]:
    """One line per tree size, then the manifest and the first run, for stderr."""
    lines = []
    for entry in doc["sizes"]:
        mem = entry.get("memory", {}).get("per_sample", {}).get(MEMORY_STAGE, {})
        cold = entry.get("cold", {})
        met = entry.get("verdicts", {})
        missed = [k for k, v in met.items() if not v["met"]]
        lines.append(
            f"{entry['files']:>9,} files: listing {_s(entry.get('listing', {}).get('median_s'))}, "
            f"register {_s(entry.get('register', {}).get('median_s'))} "
            f"(client.dataset() {_s(entry.get('dataset', {}).get('median_s'))}), "
            f"preload {_s(entry.get('preload', {}).get('median_s'))}, "
            f"attach {_s(entry.get('attach', {}).get('median_s'))}, cold first batch "
            f"{_s(cold.get('first_batch_s'))} vs register+preload {_s(cold.get('register_preload_s'))}, "
            f"B/sample server {_b(mem.get('server_max'))} client {_b(mem.get('client', {}).get('anon'))}; "
            f"targets met {len(met) - len(missed)}/{len(met)}" + (f" (missed: {', '.join(missed)})" if missed else "")
        )
    manifest = doc.get("manifest") or {}
    if "register_s" in manifest:
        mem = manifest.get("per_sample", {}).get(MEMORY_STAGE, {})
        lines.append(
            f"manifest {manifest['keys']:,} keys: register {_s(manifest['register_s'])}, first batch "
            f"{_s(manifest['first_batch_s'])}, B/sample server {_b(mem.get('server_max'))} client "
            f"{_b(mem.get('client', {}).get('anon'))}"
        )
    slope = doc.get("memory_slope")
    if slope:
        lines.append(
            f"memory per extra sample ({slope['from_files']:,} to {slope['to_files']:,} files): server "
            f"{_b(slope['server'])} B, client {_b(slope['client'])} B"
        )
    first = doc.get("first_run") or {}
    if first.get("verdict"):
        lines.append(
            f"first run: kspeed {_s(first['kspeed']['median']['to_first_batch_s'])} to the first batch, "
            f"DataLoader {_s(first['dataloader']['median']['to_first_batch_s'])} "
            f"(target: within {TARGETS['first_run_extra_s']:g}s; met: {first['verdict']['met']})"
        )
    for where, error in _errors(doc):
        lines.append(f"error in {where}: {error}")
    return lines


def _b(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _errors(doc: dict) -> list[tuple[str, str]]:
    found = []
    for entry in doc["sizes"]:
        for key, value in entry.items():
            if isinstance(value, dict) and "error" in value:
                found.append((f"{entry['files']:,} files / {key}", value["error"]))
    for key in ("manifest", "first_run"):
        if isinstance(doc.get(key), dict) and "error" in doc[key]:
            found.append((key, doc[key]["error"]))
    return found


def _series(doc: dict, get) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for entry in doc["sizes"]:
        try:
            value = get(entry)
        except (KeyError, TypeError, AttributeError):
            continue
        if value is not None:
            xs.append(entry["files"])
            ys.append(value)
    return xs, ys


def chart(path: str, doc: dict) -> None:
    """Four panels against the tree's file count (log x): register and listing, attach, the cold
    first batch, memory per sample; each target drawn dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = TARGETS
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0][0]
    xs, listing = _series(doc, lambda e: e["listing"]["median_s"])
    ax.plot(xs, listing, "o-", label="DatasetFolder listing (fresh process, warm cache)")
    ax.plot(*_series(doc, lambda e: e["register"]["median_s"]), "s-", label="KSpeed register (CreateDataset)")
    ax.plot(*_series(doc, lambda e: e["dataset"]["median_s"]), "^--", label="client.dataset(): register + job setup")
    ax.plot(xs, [t["register_per_listing"] * v for v in listing], **TARGET_STYLE, label="target: 2x listing")
    manifest = doc.get("manifest") or {}
    if "register_s" in manifest:
        ax.plot([manifest["keys"]], [manifest["register_s"]], "s", mfc="none", ms=9, label="KSpeed register, manifest")
        ax.set_xlabel("files in the tree (manifest: keys)")
    _style(ax, "register vs listing", "seconds", xlabel=ax.get_xlabel() or None)
    ax = axes[0][1]
    ax.plot(*_series(doc, lambda e: e["attach"]["median_s"]), "s-", label="second job's client.dataset()")
    ax.plot(*_series(doc, lambda e: e["attach"]["call_median_s"]), "^--", label="its attach check (CreateDataset)")
    ax.plot(xs, [t["attach_base_s"] + t["attach_per_listing"] * v for v in listing], **TARGET_STYLE,
            label="target: 0.2 s + 1x listing")  # fmt: skip
    ax.plot([t["imagenet_files"]], [t["attach_at_imagenet_s"]], "rv", label="target: < 0.5 s at 1.28M")
    _style(ax, "attach by a second job, nothing changed", "seconds")
    ax = axes[1][0]
    ax.plot(*_series(doc, lambda e: e["cold"]["first_batch_s"]), "o-", label="register to first batch")
    xs2, full = _series(doc, lambda e: e["cold"]["register_preload_s"])
    ax.plot(xs2, full, "s-", label="register + full preload")
    ax.plot(xs2, [t["cold_first_batch_share"] * v for v in full], **TARGET_STYLE,
            label="target: 25% of register + preload")  # fmt: skip
    _style(ax, "cold page cache, not preloaded", "seconds")
    ax = axes[1][1]
    stage = ("memory", "per_sample", MEMORY_STAGE)
    ax.plot(*_series(doc, lambda e: _dig(e, stage)["server_max"]), "o-", label="server (+feeders), RssAnon")
    ax.plot(*_series(doc, lambda e: _dig(e, stage)["client"]["anon"]), "s-", label="client, RssAnon")
    mem = manifest.get("per_sample", {}).get(MEMORY_STAGE)
    if mem:
        ax.plot([manifest["keys"]], [mem["server_max"]], "o", mfc="none", ms=9, label="server, manifest")
        ax.plot([manifest["keys"]], [mem["client"]["anon"]], "s", mfc="none", ms=9, label="client, manifest")
    ax.axhline(t["server_bytes_per_sample"], color="C0", ls="--", label="target: server < 100 B")
    ax.axhline(t["client_bytes_per_sample"], color="C1", ls="--", label="target: client < 50 B")
    _style(ax, "memory grown per sample since before register (largest read)", "bytes per sample")
    ax.set_xlabel("files in the tree (manifest: keys)")
    top = max([e["files"] for e in doc["sizes"]] + [t["imagenet_files"], manifest.get("keys", 0)])
    for ax in axes.flat:
        ax.set_xlim(min([e["files"] for e in doc["sizes"]], default=1000) / 2, top * 2)
    first = doc.get("first_run") or {}
    title = "KSpeed cold start"
    if first.get("verdict"):
        title += (
            f"; first run (README wrap, fresh process, imports included): first batch after "
            f"{first['kspeed']['median']['to_first_batch_s']:.2f}"
            f" s vs DataLoader {first['dataloader']['median']['to_first_batch_s']:.2f} s"
        )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _dig(entry: dict, keys: tuple[str, ...]):
    for key in keys:
        entry = entry[key]
    return entry


def _style(ax, title: str, ylabel: str, xlabel: str | None = None) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel or "files in the tree")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
