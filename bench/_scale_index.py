"""Per-sample metadata against dataset size: a server's index and listing, the manager's sizing, a rank's plan.

Four places hold state per sample, each measured in a fresh worker process (so one's memory never
hides another's) from synthetic ImageNet-like sizes (lognormal, ~110 KB mean):

- ``index``: a server's :class:`~kspeed.server.hosting.index.SampleIndex` for a share of N samples, the
  :class:`~kspeed.server.memory.residency.Residency` beside it, and what the preload, the heartbeat
  status, the scrub and the index save cost per sample;
- ``listing``: :func:`~kspeed.server.backend.sources.open_source` of a ``manifest`` (``key size`` per line,
  written to a temporary directory), which every server holding a share keeps for the WHOLE dataset;
- ``describe``: the ``DescribeDataset`` reply (the lister's region layout, 16 bytes per region)
  against the gRPC limits of the manager's channels, and
  :func:`~kspeed.manager.allocator.allocate_regions` over it;
- ``plan``: a rank's :class:`~kspeed.client.planning.plans.EpochPlan` for its share of an epoch, and
  ``order``: the built-in ``DistributedSampler`` order it is made from.

Memory is what the arrays hold (``nbytes``, exact) next to the worker's resident growth and peak
(``VmRSS``/``VmHWM``, the peak reset per phase through ``/proc/self/clear_refs``). A size whose
estimated peak does not fit the memory budget (half of ``MemAvailable`` by default) is not run:
its row is extrapolated linearly from the largest measured one and says ``"measured": false``.

    python bench/scale.py --json /tmp/index.json --charts /tmp/charts index --quick
    python bench/scale.py index --sizes 1e5,1e6,1e7 --parts index,listing
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import pyplot

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PARTS = ("index", "listing", "describe", "plan", "order")
FULL_SIZES = (10**5, 10**6, 10**7, 10**8)
QUICK_SIZES = (10**5, 3 * 10**5, 10**6)

MIB, GIB = 1 << 20, 1 << 30
CHUNK = 1 << 20  # samples generated or written per step (bounds the generators' own memory)
SIZE_SIGMA = 0.5  # lognormal spread of sample sizes: most of an ImageNet-like set within 2x of the mean
MIN_SIZE, MAX_SIZE = 1 << 10, 4 << 20  # clip of the synthetic sizes (7 decimal digits at most)
SIZE_DIGITS = 7
WNID_BASE, WNID_STEP = 1_440_764, 7_919  # synthetic WordNet IDs: n01440764, ... (8 digits)
RESERVE = 2 * GIB  # MemAvailable left alone whatever the budget
MARGIN = 1.3  # estimated peak = measured bytes per sample x this
WORKER_TIMEOUT_S = 1800
#: A worker's resident size after its imports (torch for the client's parts) and the bytes per
#: sample its peak is assumed to add, before one size of its part was measured (generous on purpose).
PRIOR = {
    "index": (100 * MIB, 150),
    "listing": (100 * MIB, 400),
    "describe": (100 * MIB, 120),
    "plan": (700 * MIB, 60),
    "order": (700 * MIB, 120),
}
#: Where the limits and the per-sample state live (file, text of the line), named as file:line.
SITES = {
    "manager_receive_limit": ("kspeed/control/rpc.py", '("grpc.max_receive_message_length", max_message_bytes)'),
    "channel_default": ("kspeed/control/rpc.py", "def channel_options(max_message_bytes: int = 64 * 1024**2)"),
    "open_channel": ("kspeed/control/rpc.py", "return module.insecure_channel(address, options=channel_options())"),
    "manager_channel": ("kspeed/manager/calls.py", "rpc.open_channel(address, self._security, aio=True)"),
    "manager_describe": ("kspeed/manager/datasets.py", '"DescribeDataset", spec)'),
    "manager_verify_describe": ("kspeed/manager/datasets.py", '"DescribeDataset", info.spec)'),
    "server_send_limit": ("kspeed/control/rpc.py", '("grpc.max_send_message_length", 256 * 1024**2)'),
    "describe_layout": ("proto/kspeed.proto", "bytes region_starts = 5;"),
    "server_describe": ("kspeed/server/hosting/datasets.py", "region_starts=wire.pack_i64(starts),"),
    "listing_per_share": ("kspeed/server/hosting/datasets.py", "source = self._open(request.spec)"),
    "index_offset": (
        "kspeed/server/hosting/index.py",
        "offset = np.zeros(len(sizes), dtype=offset_dtype(region_size))",
    ),
    "index_loaded": ("kspeed/server/hosting/index.py", "self.loaded = Flags(len(self.length))"),
    "residency_state": (
        "kspeed/server/memory/residency.py",
        "self.state = np.full(len(loaded), ABSENT, dtype=np.uint8)",
    ),
    "keys_offsets": (
        "kspeed/server/backend/listing.py",
        "self.blob, self.starts, self.ends = blob, starts.astype(np.int64)",
    ),
    "manifest_blob": ("kspeed/server/backend/listing.py", "keys=Keys(data, starts, ends))"),
    "fingerprint_copy": (
        "kspeed/server/backend/sources.py",
        'h = hashlib.sha256(kind.encode() + b"\\0" + self.sizes.tobytes()',
    ),
    "save_on_seal": ("kspeed/server/hosting/preload.py", "self._save_index()\n                    self.pool.seal"),
    "progress_mask": ("kspeed/server/hosting/preload.py", "done_bytes, total_bytes = self.index.loaded_bytes"),
    "pending_region_list": ("kspeed/server/hosting/preload.py", "self._handed = Flags(len(index.length))"),
    "scrub_list": ("kspeed/server/hosting/integrity.py", "yield from (loaded.positions(start, start + CHUNK)"),
    "plan_arrays": ("kspeed/client/planning/plans.py", "labels = np.full(n, -1, dtype=np.int64)"),
    "layout_offsets": ("kspeed/layout.py", "offsets = cum - cum[starts[:-1]][batch_of] if n else cum"),
    "sampler_order": (
        "kspeed/client/planning/sampling.py",
        "ids = np.fromiter((int(i) for i in sampler), dtype=np.int64)",
    ),
    "plans_kept": ("kspeed/client/feeding/pump.py", "keep = {self._current.epoch, self._current.epoch + 1}"),
}


# ---------------------------------------------------------------------------------------------
# The subcommand


def add_arguments(parser) -> None:
    """The ``index`` subcommand's options."""
    parser.add_argument("--quick", action="store_true", help=f"sizes {', '.join(map(_fmt, QUICK_SIZES))} only")
    parser.add_argument(
        "--sizes", default="", help=f"comma-separated sample counts (default {','.join(map(_fmt, FULL_SIZES))})"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which to measure, of {','.join(PARTS)}")
    parser.add_argument("--servers", type=int, default=8, help="servers sharing the dataset (plans, per-server totals)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks sharing each epoch (a plan holds N/ranks)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per batch of the plans")
    parser.add_argument("--region-size", type=int, default=128 * MIB, help="bytes per region")
    parser.add_argument("--mean-size", type=int, default=110_000, help="mean synthetic sample size in bytes")
    parser.add_argument("--classes", type=int, default=1000, help="classes (manifest directories, labels, names)")
    parser.add_argument(
        "--max-memory", type=float, default=0.0, help="GiB a worker may peak at (default: half of MemAvailable)"
    )
    parser.add_argument(
        "--save-max", type=float, default=1e7, help="largest share whose index save (to disk, fsync) is timed"
    )
    parser.add_argument("--no-grpc-check", action="store_true", help="skip sending the limit-sized reply over gRPC")


def measure(args) -> dict:
    """Run every part at every size (or extrapolate where the budget is short); the figures as a dict."""
    sizes = _sizes_of(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {PARTS}")
    budget = int(args.max_memory * GIB) if args.max_memory > 0 else _mem_available() // 2
    common = {
        "region_size": args.region_size,
        "mean_size": args.mean_size,
        "classes": args.classes,
        "servers": args.servers,
        "ranks": args.ranks,
        "batch_size": args.batch_size,
        "save_max": int(args.save_max),
    }
    result: dict = {
        "settings": {**common, "sizes": sizes, "parts": parts, "budget_bytes": budget},
        "rows": {},
        "notes": [],
    }
    scratch = tempfile.mkdtemp(prefix="kspeed-scale-index-", dir="/tmp")
    try:
        for part in parts:
            rows: list[dict] = []
            for n in sizes:
                print(f"   {part} {_fmt(n)}", flush=True)
                rows.append(_run_part(part, n, rows, budget, common, scratch))
            _extrapolate(rows)
            result["rows"][part] = rows
        result["limits"] = _worker("limit", {**common, "sizes": sizes, "check": not args.no_grpc_check}, timeout=600)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["sites"] = {name: _site(path, text) for name, (path, text) in SITES.items()}
    result["per_sample"] = _per_sample(result["rows"])
    result["per_server"] = _per_server(result, args.servers)
    result["packing"] = _packing(result["per_sample"])
    return result


def _run_part(part: str, n: int, done: list[dict], budget: int, common: dict, scratch: str) -> dict:
    """One part at one size: measured in a worker if its estimated peak fits, else marked for extrapolation.

    The index's transient phases (a preload job's bookkeeping, a scrub, a save) peak above the
    index itself; when only the index fits, they are left out (``light``) and extrapolated.
    """
    room = min(budget, _mem_available() - RESERVE)
    need = _need(part, n, done, common, "process_peak")
    light = False
    if need > room and part == "index":
        need, light = _need(part, n, done, common, "light_peak"), True
    if need > room:
        return _skipped(n, f"estimated peak {need / GIB:.2f} GiB > {room / GIB:.2f} GiB allowed (MemAvailable, budget)")
    if part == "listing":
        manifest = n * _line_bytes(n, common["classes"])
        free = shutil.disk_usage(scratch).free
        if 2 * manifest + GIB > free:
            return _skipped(n, f"a {manifest / GIB:.1f} GiB manifest does not fit the {free / GIB:.1f} GiB free")
    row = _worker(part, {**common, "n": n, "scratch": scratch, "light": light}, timeout=WORKER_TIMEOUT_S)
    row.update(samples=n, measured="error" not in row)
    if light:
        row["light"] = "estimated peak of the transient phases over the budget: they were not run"
    return row


def _need(part: str, n: int, done: list[dict], common: dict, peak: str) -> int:
    """Estimated peak of a worker: its start plus the bytes per sample its last measured size peaked at."""
    measured = [r for r in done if r.get("measured") and peak in r and not (r.get("light") and peak == "process_peak")]
    if measured:
        last = measured[-1]
        slope = max(last[peak] - last["process_start"], 0) / _denominator(part, last) * MARGIN
        base = last["process_start"]
    else:
        base, slope = PRIOR[part]
    return int(base + slope * _denominator(part, {"samples": n, **common}))


def _skipped(n: int, why: str) -> dict:
    return {"samples": n, "measured": False, "skipped": why}


def _denominator(part: str, row: dict) -> int:
    """What a part's per-sample figures divide by: planned samples for a plan, else dataset samples."""
    if part == "plan":
        return row.get("planned") or -(-row["samples"] // row.get("ranks", 1))
    return row["samples"]


def _scaled(key: str) -> bool:
    return key.endswith(("bytes", "seconds")) or key in ("planned", "regions")


def _extrapolate(rows: list[dict]) -> None:
    """Fill what was not measured (whole rows, or phases left out) linearly in samples, from the
    largest measured size that has it; the index's whole-preload save costs are derived after."""
    keys = {k for r in rows if r.get("measured") for k in r if _scaled(k)}
    for row in rows:
        filled = []
        for key in sorted(keys - set(row)):
            ref = [r for r in rows if r.get("measured") and isinstance(r.get(key), (int, float))][-1]
            value = ref[key] * row["samples"] / ref["samples"]
            row[key] = round(value, 4) if key.endswith("seconds") else int(value)
            filled.append(key)
        if filled and row.get("measured"):
            row["extrapolated_keys"] = filled
        elif filled:
            row["extrapolated_from"] = max(r["samples"] for r in rows if r.get("measured"))
    for row in rows:
        if "save_seconds" in row and "regions" in row:
            # Preloader._maybe_seal saves the whole index before sealing each region, so a preload
            # of the share writes it once per region: quadratic in the share.
            row["saves_per_preload"] = row["regions"]
            row["preload_save_seconds"] = round(row["save_seconds"] * row["regions"], 1)
            row["preload_save_written_bytes"] = int(row["save_file_bytes"] * row["regions"])


def _per_sample(rows: dict) -> dict:
    """Bytes (and nanoseconds) per sample of each structure, from its largest measured size."""
    out: dict = {}
    for part, part_rows in rows.items():
        measured = [r for r in part_rows if r.get("measured")]
        if not measured:
            continue
        r = measured[-1]
        d = _denominator(part, r)
        figures = {"from_samples": r["samples"], "per": "planned sample" if part == "plan" else "sample"}
        for key, value in r.items():
            if key.startswith("preload_save"):  # quadratic in the share: per sample means nothing
                continue
            if key.endswith("bytes") and isinstance(value, (int, float)):
                figures[key] = round(value / d, 2)
            elif key.endswith("seconds") or key == "seconds":
                figures[key.replace("seconds", "ns")] = round(value / d * 1e9, 1)
        for key in ("arrays", "kept"):
            if isinstance(r.get(key), dict):
                figures[key] = {name: round(v / d, 2) for name, v in r[key].items()}
        out[part] = figures
    return out


def _per_server(result: dict, servers: int) -> list[dict]:
    """What one server holds per dataset size: the whole listing plus the index of its share (N/servers)."""
    rows = result["rows"]
    out = []
    for n in result["settings"]["sizes"]:
        listing = next((r for r in rows.get("listing", []) if r["samples"] == n), {})
        index = next((r for r in rows.get("index", []) if r["samples"] == n), {})
        if "bytes" not in listing or "bytes" not in index:
            continue
        share = index["bytes"] / servers  # the index scales with the share
        total = listing["bytes"] + share
        out.append(
            {
                "samples": n,
                "servers": servers,
                "listing_bytes": listing["bytes"],
                "index_bytes": int(share),
                "total_bytes": int(total),
                "listing_fraction": round(listing["bytes"] / total, 3),
                "measured": bool(listing.get("measured") and index.get("measured")),
            }
        )
    return out


def _packing(per_sample: dict) -> dict:
    """Where the per-sample bytes could be packed tighter, with what each change would save."""
    ideas = {
        "listing.sizes": ("int64 -> uint32: a sample <= region size < 4 GiB (lengths already travel as uint32)", 4),
        "listing.ends": ("int64 -> derived from starts (key end = separator before the size digits)", 8),
        "listing.whole_dataset": ("keep only the share's keys and sizes after fingerprinting", None),
        "plan.ids": ("int64 -> uint32 while N < 2**32", 4),
        "plan.lengths": ("int64 -> uint32 (as on the wire)", 4),
        "plan.labels": ("int64 -> int32 (int16 below 32768 classes)", 4),
        "plan.offsets": ("int64 -> uint32: an offset inside a batch < ring bytes", 4),
    }
    out = {}
    for name, (how, saves) in ideas.items():
        entry: dict = {"how": how}
        if saves is not None:
            entry["saves_bytes_per_sample"] = saves
        out[name] = entry
    listing = per_sample.get("listing", {}).get("bytes")
    if listing:
        out["listing.whole_dataset"]["saves_bytes_per_sample"] = f"{listing} x (1 - 1/servers) per dataset sample"
    return out


# ---------------------------------------------------------------------------------------------
# Charts


def charts(result: dict, outdir: str, before: dict | None = None) -> list[str]:
    """``index_memory.png`` (bytes against samples, log-log) and ``index_time.png`` (seconds)."""
    plt = pyplot()
    if plt is None:
        return []
    rows = result["rows"]
    memory = [
        ("index", "bytes", "server index + residency (share of N)"),
        ("index", "peak_bytes", "server index build, peak"),
        ("listing", "bytes", "server listing kept (whole dataset)"),
        ("listing", "peak_bytes", "server listing, peak"),
        ("describe", "bytes", "DescribeDataset reply"),
        ("describe", "peak_bytes", "manager parse + allocate, peak"),
        ("plan", "bytes", "client plan (one rank, N/ranks)"),
        ("order", "peak_bytes", "client sampler order, peak"),
    ]
    times = [
        ("index", "seconds", "index build"),
        ("index", "save_seconds", "index save (once per sealed region)"),
        ("index", "preload_save_seconds", "index saves of a whole preload"),
        ("index", "status_seconds", "status (every heartbeat)"),
        ("listing", "seconds", "listing"),
        ("describe", "seconds", "allocate"),
        ("plan", "seconds", "make_plan (fake links)"),
        ("order", "seconds", "sampler order"),
    ]
    paths = []
    for name, series, ylabel in (("index_memory.png", memory, "bytes"), ("index_time.png", times, "seconds")):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for k, (part, key, label) in enumerate(series):
            points = [(r["samples"], r[key], r.get("measured", False)) for r in rows.get(part, []) if r.get(key)]
            if not points:
                continue
            color = f"C{k}"
            xs, ys, ok = zip(*points, strict=True)
            ax.plot(xs, ys, color=color, linestyle="-" if all(ok) else "--", marker="o", label=label)
            extrapolated = [(x, y) for x, y, m in points if not m]
            if extrapolated:
                ax.scatter(*zip(*extrapolated, strict=True), color=color, marker="x", s=60, zorder=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        if ylabel == "bytes":
            for key, label in (
                ("manager_receive_limit", "manager's receive limit"),
                ("server_send_limit", "server's send limit"),
            ):
                value = result.get("limits", {}).get(key)
                if value:
                    ax.axhline(value, color="grey", linestyle=":", linewidth=1)
                    ax.annotate(
                        f"{label}: {value / MIB:.0f} MiB",
                        (0.99, value),
                        xycoords=("axes fraction", "data"),
                        ha="right",
                        va="bottom",
                        fontsize=7,
                        color="grey",
                    )
        ax.set_xlabel("samples in the dataset (x: extrapolated)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_title(f"per-sample metadata against dataset size ({ylabel})")
        fig.tight_layout()
        path = os.path.join(outdir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# Helpers of both sides


def _fmt(n: int) -> str:
    exp = int(math.log10(n)) if n > 0 else 0
    return f"1e{exp}" if n == 10**exp else str(n)


def _sizes_of(args) -> list[int]:
    if args.sizes:
        return sorted({int(float(s)) for s in args.sizes.split(",") if s.strip()})
    return list(QUICK_SIZES if args.quick else FULL_SIZES)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _site(path: str, text: str) -> str:
    """``path:line`` of the first line holding ``text`` (``path:?`` if the text moved)."""
    try:
        source = (REPO / path).read_text()
    except OSError:
        return f"{path}:?"
    at = source.find(text)
    return f"{path}:{source.count(chr(10), 0, at) + 1}" if at >= 0 else f"{path}:?"


def _worker(part: str, params: dict, timeout: float) -> dict:
    """Run ``part`` in a fresh Python process; its JSON line, or the error."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part, json.dumps(params)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"worker {part} ran past {timeout} s (killed)"}
    if done.returncode != 0:
        return {"error": f"worker {part} exited {done.returncode}: {done.stderr.strip()[-1500:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _line_bytes(n: int, classes: int) -> int:
    """Bytes of one manifest line: ``train/nWNID/nWNID_IMG.JPEG SIZE\\n``."""
    return 7 + 8 + 2 + 8 + 1 + _img_digits(n, classes) + 6 + SIZE_DIGITS + 1


def _img_digits(n: int, classes: int) -> int:
    return max(5, len(str(max(-(-n // classes) - 1, 0))))


# ---------------------------------------------------------------------------------------------
# Worker side: each part in its own process


def synthetic_sizes(n: int, mean: int, seed: int = 0) -> np.ndarray:
    """``n`` ImageNet-like sample sizes (int64, lognormal around ``mean``), the same for every part."""
    out = np.empty(n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - SIZE_SIGMA**2 / 2
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        out[a:b] = np.clip(rng.lognormal(mu, SIZE_SIGMA, b - a), MIN_SIZE, MAX_SIZE)
    return out


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((values[:, None] // powers) % 10 + ord("0")).astype(np.uint8)


def write_manifest(path: str, sizes: np.ndarray, classes: int) -> int:
    """An ImageNet-like manifest (keys sorted by class, fixed-width numbers); returns its bytes."""
    n = len(sizes)
    width = _img_digits(n, classes)

    def const(text: bytes, m: int) -> np.ndarray:
        return np.broadcast_to(np.frombuffer(text, dtype=np.uint8), (m, len(text)))

    with open(path, "wb") as f:
        for a in range(0, n, CHUNK):
            ids = np.arange(a, min(a + CHUNK, n), dtype=np.int64)
            m = len(ids)
            cls = ids * classes // n
            img = ids - (cls * n + classes - 1) // classes  # position within the class
            wnid = _digits(WNID_BASE + cls * WNID_STEP, 8)
            cols = [const(b"train/n", m), wnid, const(b"/n", m), wnid, const(b"_", m), _digits(img, width)]
            cols += [const(b".JPEG ", m), _digits(sizes[a : a + m], SIZE_DIGITS), const(b"\n", m)]
            f.write(np.concatenate(cols, axis=1).tobytes())
    return os.path.getsize(path)


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class _Meter:
    """Times phases of a worker and measures their resident growth and peak."""

    def __init__(self) -> None:
        self.start = _proc_status()["VmRSS"]
        self.peak = 0
        self.resets = True

    def phase(self, fn):
        """``(fn(), seconds, resident growth, peak growth)``; the peak is this phase's own."""
        self.peak = max(self.peak, _proc_status()["VmHWM"])
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS
        except OSError:
            self.resets = False
        rss0 = _proc_status()["VmRSS"]
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        now = _proc_status()
        self.peak = max(self.peak, now["VmHWM"])
        return out, seconds, now["VmRSS"] - rss0, max(now["VmHWM"] - rss0, 0)

    def highest(self) -> int:
        """The process's peak resident size so far."""
        self.peak = max(self.peak, _proc_status()["VmHWM"])
        return self.peak

    def report(self, row: dict) -> dict:
        self.highest()
        row.update(process_start=self.start, process_peak=self.peak, peak_reset=self.resets)
        return row


def _unique_nbytes(arrays: dict[str, np.ndarray | None]) -> dict[str, int]:
    """``nbytes`` of each array, counting memory two of them share once (under the first name)."""
    out, seen = {}, []
    for name, a in arrays.items():
        if a is None:
            continue
        if any(np.shares_memory(a, b) for b in seen):
            out[name] = 0
            continue
        seen.append(a)
        out[name] = int(a.nbytes)
    return out


def _work_index(p: dict) -> dict:
    from kspeed.server.hosting import preload
    from kspeed.server.hosting.index import SampleIndex
    from kspeed.server.memory.flags import CHUNK
    from kspeed.server.memory.residency import Residency

    meter = _Meter()
    n = p["n"]
    sizes = synthetic_sizes(n, p["mean_size"])  # the listing's sizes: the index's length is a view of them
    index, build_s, build_rss, build_peak = meter.phase(lambda: SampleIndex("bench", 0, sizes, p["region_size"]))

    def fill() -> None:  # what a whole preload records
        index.crc[:] = 1
        index.loaded.set(slice(None))
        index.loaded_bytes = index.total_bytes

    _, _, fill_rss, _ = meter.phase(fill)
    residency, _, residency_rss, _ = meter.phase(lambda: Residency(0, index.loaded))
    arrays = _unique_nbytes(
        {
            "offset": index.offset,  # (a sample's region is found from the bounds)
            "crc": index.crc,
            "loaded": index.loaded.bits,
            "bounds": index.bounds,
            "residency": residency.state,
        }
    )

    def status() -> int:  # Preloader.progress() and result(), as every heartbeat asks per share
        return index.loaded_bytes + index.total_bytes + index.loaded_count * 2

    _, status_s, _, status_peak = meter.phase(status)
    row = {
        "bytes": sum(arrays.values()),
        "peak_bytes": build_peak,
        "seconds": round(build_s, 4),
        "arrays": arrays,
        "length_bytes_shared_with_listing": int(index.length.nbytes),
        "length_is_listing_view": bool(np.shares_memory(index.length, sizes)),
        "regions": index.num_regions,
        "build_rss_bytes": build_rss,
        "filled_rss_bytes": build_rss + fill_rss + residency_rss,
        "status_seconds": round(status_s, 5),
        "status_peak_bytes": status_peak,
        "light_peak": meter.highest(),
    }
    if p["light"]:
        return meter.report(row)

    def pending() -> object:  # a preload job's bookkeeping for a share with nothing loaded yet
        index.loaded.clear()
        return preload._Pending(list(range(index.num_regions)), index, 1 << 20, 16)

    job, pending_s, pending_rss, pending_peak = meter.phase(pending)
    del job
    index.loaded.set(slice(None))

    def scrub_list() -> int:  # SampleStore.scrub's walk over the loaded samples, a chunk at a time
        return sum(len(index.loaded.positions(a, a + CHUNK).tolist()) for a in range(0, n, CHUNK))

    _, scrub_s, _, scrub_peak = meter.phase(scrub_list)
    row.update(
        preload_job_seconds=round(pending_s, 4),
        preload_job_rss_bytes=pending_rss,
        preload_job_peak_bytes=pending_peak,
        scrub_list_seconds=round(scrub_s, 4),
        scrub_list_peak_bytes=scrub_peak,
    )
    if n <= p["save_max"]:
        path = os.path.join(p["scratch"], f"index-{n}.npz")
        _, save_s, _, save_peak = meter.phase(lambda: index.save(path))
        row.update(save_seconds=round(save_s, 4), save_file_bytes=os.path.getsize(path), save_peak_bytes=save_peak)
        os.unlink(path)
    return meter.report(row)


def _work_listing(p: dict) -> dict:
    from kspeed.server.backend.access import Backend
    from kspeed.server.backend.allowlist import AllowList
    from kspeed.server.backend.sources import open_source

    n = p["n"]
    path = os.path.join(p["scratch"], f"train-{n}.manifest")
    t0 = time.perf_counter()
    manifest = write_manifest(path, synthetic_sizes(n, p["mean_size"]), p["classes"])
    write_s = time.perf_counter() - t0
    backend = Backend(AllowList([p["scratch"]]))
    meter = _Meter()
    source, list_s, rss, peak = meter.phase(lambda: open_source(backend, "bench", path, kind="manifest"))
    keys = source.keys
    kept = {"keys_blob": len(keys.blob)} if keys is not None else {}
    kept.update(
        _unique_nbytes(
            {
                "keys_starts": keys.starts if keys is not None else None,
                "keys_ends": keys.ends if keys is not None else None,
                "sizes": source.sizes,
                "labels": source.labels,
                "stamps": source.stamps,
            }
        )
    )
    row = {
        "bytes": sum(kept.values()),
        "peak_bytes": peak,
        "seconds": round(list_s, 4),
        "kept": kept,
        "rss_bytes": rss,
        "manifest_bytes_total": manifest,
        "manifest_write_seconds": round(write_s, 3),
        "first_key": source.key(0),
        "last_key": source.key(n - 1),
        "sizes_match": bool(np.array_equal(source.sizes[:CHUNK], synthetic_sizes(min(n, CHUNK), p["mean_size"]))),
    }
    os.unlink(path)
    return meter.report(row)


def _layout(sizes: np.ndarray, region_size: int, name: str = "bench") -> tuple[np.ndarray, np.ndarray]:
    """Where each region starts and the bytes in it, as :meth:`DatasetHost.describe` lays the samples out."""
    from kspeed.layout import region_bounds

    starts = region_bounds(sizes, region_size, dataset=name)
    cum = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    return starts, cum[starts[1:]] - cum[starts[:-1]]


def _describe_reply(starts: np.ndarray, region_bytes: np.ndarray, region_size: int, total: int, classes: int):
    """A ``DescribeDatasetReply`` as :meth:`DatasetHost.describe` builds it (the region layout, a sha256 digest)."""
    from kspeed import wire
    from kspeed.proto import kspeed_pb2

    return kspeed_pb2.DescribeDatasetReply(
        fingerprint=kspeed_pb2.Fingerprint(count=int(starts[-1]), total_bytes=total, digest="0" * 64),
        class_names=[f"n{WNID_BASE + c * WNID_STEP:08d}" for c in range(classes)],
        region_size=region_size,
        region_starts=wire.pack_i64(starts),
        region_bytes=wire.pack_i64(region_bytes),
    )


def _work_describe(p: dict) -> dict:
    from kspeed import wire
    from kspeed.manager.allocator import ServerCapacity, allocate_regions
    from kspeed.proto import kspeed_pb2

    n, region_size, servers = p["n"], p["region_size"], p["servers"]
    sizes = synthetic_sizes(n, p["mean_size"])
    meter = _Meter()

    def pack() -> bytes:  # what the lister does: lay the samples out in regions, one entry per region
        starts, region_bytes = _layout(sizes, region_size)
        return _describe_reply(starts, region_bytes, region_size, int(sizes.sum()), p["classes"]).SerializeToString()

    data, pack_s, _, pack_peak = meter.phase(pack)
    free = 2 * (-(-int(sizes.sum()) // region_size) // servers) + 2

    def parse() -> tuple[np.ndarray, np.ndarray]:  # what the manager's _allocate does with the reply
        reply = kspeed_pb2.DescribeDatasetReply.FromString(data)
        return wire.unpack_i64(reply.region_starts, "starts"), wire.unpack_i64(reply.region_bytes, "bytes")

    (starts, region_bytes), parse_s, _, parse_peak = meter.phase(parse)
    capacities = [ServerCapacity(f"server-{k:03d}", free) for k in range(servers)]
    allocation, alloc_s, _, alloc_peak = meter.phase(
        lambda: allocate_regions("bench", starts, region_bytes, region_size, capacities)
    )
    return meter.report(
        {
            "bytes": len(data),
            "peak_bytes": parse_peak + alloc_peak,
            "seconds": round(alloc_s, 4),
            "server_pack_seconds": round(pack_s, 4),
            "server_pack_peak_bytes": pack_peak,
            "manager_parse_seconds": round(parse_s, 4),
            "manager_parse_peak_bytes": parse_peak,
            "allocate_peak_bytes": alloc_peak,
            "regions": allocation.num_regions,
            "shares": len(allocation.shares),
        }
    )


def _work_plan(p: dict) -> dict:
    from kspeed.client.planning.plans import make_plan

    n, ranks, servers = p["n"], p["ranks"], p["servers"]
    planned = -(-n // ranks)
    sizes = synthetic_sizes(n, p["mean_size"])
    ids = np.random.default_rng(1).integers(0, n, planned, dtype=np.int64)  # a rank's part of a shuffled epoch
    cuts = np.linspace(0, n, servers + 1).astype(np.int64)

    class Link:
        """A server answering lookups from the synthetic sizes (as ServerLink.lookup returns them)."""

        def __init__(self, k: int) -> None:
            self.name = self.server_id = f"server-{k:03d}"
            self.first_id, self.end_id = int(cuts[k]), int(cuts[k + 1])  # the share's IDs, as the allocation says

        def lookup(self, dataset: str, asked: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            positions = np.flatnonzero((asked >= self.first_id) & (asked < self.end_id))
            owned = asked[positions]
            return positions, sizes[owned], owned % p["classes"]

        def commit_plan(self, *args) -> None:
            return None

    links = [Link(k) for k in range(servers)]
    meter = _Meter()
    plan, plan_s, rss, peak = meter.phase(
        lambda: make_plan(
            links,
            dataset="bench",
            feed_ids=[f"feed-{k}" for k in range(servers)],
            epoch=0,
            feed_epoch=1,
            ids=ids,
            batch_size=p["batch_size"],
            labelled=True,
            deterministic=True,
            ring_bytes=1 << 50,
        )
    )
    arrays = _unique_nbytes(
        {
            "ids": plan.ids,
            "lengths": plan.lengths,
            "labels": plan.labels,
            "owner": plan.owner,
            "layout_offsets": plan.layout.offsets,
            "layout_lengths": plan.layout.lengths,
            "layout_starts": plan.layout.starts,
            "layout_batch_bytes": plan.layout.batch_bytes,
            "owed": plan.owed,
            "remote": plan.remote,
        }
    )
    return meter.report(
        {
            "planned": planned,
            "ranks": ranks,
            "bytes": sum(arrays.values()),
            "peak_bytes": peak,
            "seconds": round(plan_s, 4),
            "arrays": arrays,
            "rss_bytes": rss,
        }
    )


def _work_order(p: dict) -> dict:
    from kspeed.client.planning.sampling import EpochOrders

    n = p["n"]
    orders = EpochOrders(
        None,
        num_samples=n,
        batch_size=p["batch_size"],
        drop_last=False,
        seed=0,
        shuffle=True,
        rank=0,
        world_size=p["ranks"],
        dataset="bench",
    )
    meter = _Meter()
    ids, order_s, rss, peak = meter.phase(lambda: orders.order(0))
    return meter.report(
        {
            "planned": len(ids),
            "bytes": int(ids.nbytes),
            "peak_bytes": peak,
            "seconds": round(order_s, 4),
            "rss_bytes": rss,
        }
    )


def _work_limit(p: dict) -> dict:
    """The gRPC limits a DescribeDataset reply meets (16 bytes per region, none per sample), the
    dataset sizes that would break them, and a real call of the largest size measured."""
    from kspeed.config import ManagerConfig, ServerConfig
    from kspeed.control import rpc

    receive = dict(rpc.channel_options())["grpc.max_receive_message_length"]
    send = dict(rpc.server_options(ServerConfig().max_request_bytes))["grpc.max_send_message_length"]
    per_region = max(p["region_size"] // p["mean_size"], 1)  # samples of the mean size in one region
    overhead = _describe_reply(np.zeros(1, np.int64), np.zeros(0, np.int64), p["region_size"], 0, p["classes"])
    base = overhead.ByteSize() + 16  # two length-delimited fields' tags and lengths, generously

    def most(limit: int) -> int:  # samples of the mean size whose layout fits ``limit``
        return max((limit - base) // 16, 0) * per_region

    protobuf_max = 2**31 - 1
    out = {
        "manager_receive_limit": receive,
        "server_send_limit": send,
        "protobuf_limit": protobuf_max,
        "manager_max_request_bytes": ManagerConfig().max_request_bytes,
        "server_max_request_bytes": ServerConfig().max_request_bytes,
        "reply_overhead_bytes": base,
        "describe_bytes_per_region": 16,
        "samples_per_region": per_region,
        "max_samples_manager_receive": most(receive),
        "max_samples_server_send": most(send),
        "max_samples_protobuf": most(protobuf_max),
    }
    if p["check"]:
        out["grpc_check"] = _grpc_check(max(p["sizes"]), p["mean_size"], p["region_size"], p["classes"])
    return out


def _grpc_check(n: int, mean: int, region_size: int, classes: int) -> dict:
    """Send the layout of ``n`` samples from a server with the daemon's options to a channel opened
    as the manager opens its channels; what the call got."""
    from concurrent import futures

    import grpc

    from kspeed.config import SecurityConfig, ServerConfig
    from kspeed.control import rpc
    from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc

    starts, region_bytes = _layout(synthetic_sizes(n, mean), region_size)
    data = _describe_reply(starts, region_bytes, region_size, int(region_bytes.sum()), classes).SerializeToString()
    handler = grpc.method_handlers_generic_handler(
        "kspeed.v1.Server",
        {"DescribeDataset": grpc.unary_unary_rpc_method_handler(lambda request, context: data)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(2), options=rpc.server_options(ServerConfig().max_request_bytes), handlers=[handler]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = rpc.open_channel(f"127.0.0.1:{port}", SecurityConfig(auth="none"))
    try:
        stub = kspeed_pb2_grpc.ServerStub(channel)
        try:
            reply = stub.DescribeDataset(kspeed_pb2.DatasetSpec(name="d"), timeout=120)
            out = {"samples": n, "message_bytes": len(data), "ok": True, "regions": len(reply.region_bytes) // 8}
        except grpc.RpcError as exc:
            out = {"samples": n, "message_bytes": len(data), "ok": False, "code": exc.code().name}
    finally:
        channel.close()
        server.stop(0).wait()
    return out


WORKERS = {
    "index": _work_index,
    "listing": _work_listing,
    "describe": _work_describe,
    "plan": _work_plan,
    "order": _work_order,
    "limit": _work_limit,
}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--worker" or sys.argv[2] not in WORKERS:
        raise SystemExit(f"usage: {sys.argv[0]} --worker {{{','.join(WORKERS)}}} JSON (run by bench/scale.py index)")
    sys.path.insert(0, str(REPO))
    print(json.dumps(WORKERS[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
