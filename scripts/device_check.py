"""The GPU paths on a GPU, in one command: ``scripts/device-check`` (``--quick``, ``--dry-run``).

Made for a lent GPU machine (an NVIDIA H100 or H200, no RDMA NIC, no network, its own ``python3``
with a CUDA build of torch and torchvision, a few minutes in all):

1. *setup*: the project's other dependencies are installed from the cp312 wheels carried in
   ``.device-wheels/`` (``scripts/device-wheels`` downloads them on a CPU machine; never the
   network here) into a private folder put first on ``PYTHONPATH``, and the project itself with
   ``pip install --no-deps --no-build-isolation -e .``; the machine's own torch, torchvision,
   numpy and cupy are used whatever their versions.
2. the parts, each in its own process with its own time limit, so a failing or hanging part does
   not stop the others (cheapest first):

   - ``env``: the GPU, its driver and link, the runtime (kernel, virtualisation), the versions;
   - ``dmabuf``: a device ring's memory exported as a dma-buf, viewed through cupy and flushed
     (GPUDirect RDMA itself needs a NIC; a refusal is recorded with its reason, as a skip);
   - ``tests``: every ``gpu``-marked test;
   - ``gpu-prep``: ``bench/gpu_prep.py``, JPEG decode and augmentation on the GPU against one CPU
     core and all of them;
   - ``delivery``: ``bench/client.py`` with ``device="cuda"`` against pinned-memory DataLoaders
     at 32 KiB, 256 KiB and 1 MiB, beside the host-to-device copy bandwidth and the ``shm``
     rail's rate measured in the same run.
3. ``device-check.json`` (every part's status, figures and the targets) and ``device-check.png``
   in the results folder (``--results``; printed), rewritten after every part, so a run cut short
   keeps what it finished. ``--rerun FILE`` runs again only the parts that did not pass in an
   earlier ``device-check.json`` and merges the new results into it.

``--dry-run`` needs no GPU (``make test`` runs it): it checks that everything the real run needs is
present (the parts' scripts accept their arguments, the ``gpu`` tests are collected, the wheels
are named) and lists what it would run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".device-wheels"
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its helper modules beside it

from _device_probes import FAILED, PASSED, PROBES, SKIPPED  # noqa: E402
from _device_report import chart, judge, targets  # noqa: E402
from _device_wheels import FROM_THE_IMAGE, download_wheels, missing_on_the_machine, requirements  # noqa: E402

#: The delivery benchmark's systems: the shm rail into host memory (its rate is a limit), into the
#: GPU, and the DataLoader as a user would feed a GPU, at every sensible worker count.
DELIVERY_SYSTEMS = "kspeed-shm,kspeed-shm-cuda," + ",".join(f"dataloader-pin-w{n}" for n in (0, 2, 4, 8, 16))
DELIVERY_SIZES = "32K,256K,1M"


@dataclass
class Part:
    """One part of the check: how to run it and for how long (seconds: full, quick)."""

    name: str
    what: str
    limit_s: tuple[int, int]
    argv: list[str] = field(default_factory=list)


def parts(results: Path, quick: bool, python: str) -> list[Part]:
    """The parts in the order they run, with their command lines."""
    me = [python, str(Path(__file__).resolve())]
    delivery = [
        python,
        str(ROOT / "bench" / "client.py"),
        "--json",
        str(results / "delivery.json"),
        "--sizes",
        DELIVERY_SIZES,
        "--systems",
        DELIVERY_SYSTEMS,
        *(["--quick"] if quick else ["--dataset-mib", "256", "--seconds", "2"]),
    ]
    gpu_prep = [
        python,
        str(ROOT / "bench" / "gpu_prep.py"),
        "--json",
        str(results / "gpu_prep.json"),
        "--png",
        str(results / "gpu_prep.png"),
        *(["--quick"] if quick else []),
    ]
    tests = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "-o",
        "addopts=",
        "-rA",
        "--continue-on-collection-errors",
        f"--junitxml={results / 'gpu-tests.xml'}",
        *gpu_test_files(),
    ]
    return [
        Part("env", "the GPU, driver, runtime and versions", (60, 60), [*me, "--probe", "env"]),
        Part("dmabuf", "a device ring exported as a dma-buf, viewed and flushed", (60, 60), [*me, "--probe", "dmabuf"]),
        Part("tests", "every gpu-marked test", (240, 150), tests),
        Part("gpu-prep", "JPEG decode + augment on the GPU vs CPU cores", (120, 60), gpu_prep),
        Part("delivery", "device='cuda' delivery vs pinned DataLoaders", (240, 100), delivery),
    ]


def gpu_test_files() -> list[str]:
    """The test files holding ``gpu``-marked tests (relative to the repository)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if GPU_MARK.search(path.read_text(encoding="utf-8")):
            found.append(str(path.relative_to(ROOT)))
    return found


# ---- setup -------------------------------------------------------------------------------------


def child_env(site: Path | None) -> dict[str, str]:
    """The environment of every part: the carried wheels' folder and the tree first on the path."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    path = [str(site)] if site else []
    path += [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def setup(python: str, wheels: Path, log) -> tuple[dict, Path | None]:
    """Install the carried wheels into a private folder and the project in editable mode."""
    record: dict = {"python": python}
    site = None
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    record["wheels"] = [w.name for w in found]
    if found:
        site = Path(tempfile.gettempdir()) / "kspeed-device-site"
        shutil.rmtree(site, ignore_errors=True)
        pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
        done = _run([*pip, "--upgrade", "--target", str(site), *map(str, found)], None, 180, log, "setup: wheels")
        record["wheels_installed"] = done.returncode == 0
        if done.returncode != 0:
            site = None
    editable = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."]
    done = _run(editable, child_env(site), 180, log, "setup: editable install")
    record["editable_install"] = done.returncode == 0
    if done.returncode != 0:
        record["note"] = "the editable install failed; the parts import the tree through PYTHONPATH"
    return record, site


def _run(argv: list[str], env: dict | None, limit_s: float, log, title: str) -> subprocess.CompletedProcess:
    """Run ``argv`` in the repository with a time limit, its output appended to ``log``."""
    log.write(f"\n===== {title}: {' '.join(argv)}\n")
    log.flush()
    try:
        return subprocess.run(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s, check=False
        )
    except subprocess.TimeoutExpired:
        log.write(f"\n===== {title}: stopped after {limit_s:.0f} s\n")
        return subprocess.CompletedProcess(argv, 124)
    finally:
        log.flush()


# ---- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Set up, run the selected parts, write the results after each; 0 when every part passed."""
    results = Path(args.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    doc_path = results / "device-check.json"
    earlier = json.loads(Path(args.rerun).read_text()) if args.rerun else None
    chosen = select(args, earlier)
    started = time.monotonic()
    doc = earlier or {"parts": {}}
    doc.update(
        {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["scripts/device-check", *(args.argv or [])]),
            "quick": args.quick,
        }
    )
    with open(results / "log.txt", "a", encoding="utf-8") as log:
        doc["setup"], site = setup(args.python, Path(args.wheels), log) if not args.no_install else ({}, None)
        env = child_env(site)
        for part in parts(results, args.quick, args.python):
            if part.name not in chosen:
                continue
            left = args.budget_s - (time.monotonic() - started)
            if left < 20:
                doc["parts"][part.name] = {"status": SKIPPED, "figures": {"error": "no time left in --budget-s"}}
                continue
            limit = min(part.limit_s[1 if args.quick else 0], left - 10)
            print(f"device-check: {part.name} ({part.what}), at most {limit:.0f} s", file=sys.stderr, flush=True)
            probe_out = results / f".{part.name}.probe.json"
            argv = [*part.argv, "--probe-out", str(probe_out)] if part.name in PROBES else part.argv
            t0 = time.monotonic()
            done = _run(argv, env, limit, log, part.name)
            probe = json.loads(probe_out.read_text()) if probe_out.exists() else None
            probe_out.unlink(missing_ok=True)
            status, figures = judge(part.name, done.returncode, results, probe)
            doc["parts"][part.name] = {
                "status": status,
                "rc": done.returncode,
                "seconds": round(time.monotonic() - t0, 1),
                "figures": figures,
            }
            if part.name == "env" and isinstance(figures.get("gpu"), dict):
                doc["device"] = figures["gpu"]["name"]
            print(f"device-check: {part.name} {status} in {doc['parts'][part.name]['seconds']} s", file=sys.stderr)
            save(doc, doc_path)
    doc["targets"] = targets(doc)
    doc["wall_seconds"] = round(time.monotonic() - started, 1)
    save(doc, doc_path)
    try:
        chart(doc, results / "device-check.png")
    except Exception as exc:  # the JSON holds the figures; a chart that fails is reported, not fatal
        print(f"device-check: no chart: {type(exc).__name__}: {exc}", file=sys.stderr)
    statuses = {name: part["status"] for name, part in doc["parts"].items()}
    print(json.dumps({"results": str(results), "parts": statuses, "targets": doc["targets"]}, indent=1))
    return 0 if all(s != FAILED for s in statuses.values()) else 1


def select(args: argparse.Namespace, earlier: dict | None) -> set[str]:
    """The parts to run: ``--only``, else those an earlier run did not pass (``--rerun``), else all."""
    names = [p.name for p in parts(Path("."), False, "python3")]
    if args.only:
        chosen = set(args.only.split(","))
        unknown = chosen - set(names)
        if unknown:
            raise SystemExit(f"device-check: unknown part(s) {', '.join(sorted(unknown))}; parts: {', '.join(names)}")
        return chosen
    if earlier is not None:
        return {n for n in names if earlier.get("parts", {}).get(n, {}).get("status") != PASSED}
    return set(names)


def save(doc: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


def dry_run(args: argparse.Namespace) -> int:
    """Check that the real run has what it needs (no GPU needed) and list what it would run."""
    problems: list[str] = []
    plan = parts(Path(args.results or "RESULTS"), args.quick, args.python)
    for module in FROM_THE_IMAGE:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            problems.append(f"{module} is not importable here (the GPU machine's image brings it; CI must too)")
    for part in plan:
        script = next((Path(a) for a in part.argv if a.endswith(".py")), None)
        if script is not None and script.name in ("client.py", "gpu_prep.py"):
            problems += _check_arguments(script, part.argv[part.argv.index(str(script)) + 1 :])
    files = gpu_test_files()
    problems += [
        f"{module} is imported by the gpu tests' modules but is neither in the GPU machine's image "
        "(FROM_THE_IMAGE) nor carried (CARRIED)"
        for module in sorted(missing_on_the_machine(files))
    ]
    collected = _collect_gpu_tests(files)
    if not collected:
        problems.append(f"no gpu-marked test was collected from {files}")
    try:
        wanted = requirements()
    except SystemExit as exc:
        problems.append(str(exc))
        wanted = []
    carried = sorted(p.name for p in Path(args.wheels).glob("*.whl")) if Path(args.wheels).is_dir() else []
    for requirement in wanted:
        name, version = requirement.split("==")
        stem = re.sub(r"[-_.]+", "_", name).lower()
        if carried and not any(w.lower().startswith(f"{stem}-{version}-") for w in carried):
            problems.append(f"{args.wheels} has no wheel of {requirement}: run scripts/device-wheels")
    report = {
        "parts": [
            {"name": p.name, "what": p.what, "limit_s": p.limit_s[1 if args.quick else 0], "argv": p.argv} for p in plan
        ],
        "gpu_tests": collected,
        "wheels": {"wanted": wanted, "carried": carried or "none yet: run scripts/device-wheels before the device run"},
        "problems": problems,
    }
    print(json.dumps(report, indent=1))
    return 1 if problems else 0


def _check_arguments(script: Path, argv: list[str]) -> list[str]:
    """Whether ``script``'s ``parse_args`` accepts ``argv`` (importing it runs no benchmark)."""
    spec = importlib.util.spec_from_file_location(f"_device_check_{script.stem}", script)
    if spec is None or spec.loader is None:
        return [f"{script} cannot be imported"]
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    sys.path.insert(0, str(script.parent))
    try:
        spec.loader.exec_module(module)
        module.parse_args(argv)
    except SystemExit as exc:
        return [f"{script.name} refuses the arguments {argv}: exit {exc.code}"]
    except Exception as exc:
        return [f"{script.name} cannot check its arguments: {type(exc).__name__}: {exc}"]
    finally:
        sys.path.remove(str(script.parent))
        sys.modules.pop(spec.name, None)
    return []


def _collect_gpu_tests(files: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False, env=child_env(None))
    return [line for line in done.stdout.splitlines() if "::" in line]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/device-check", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller data and shorter timings (about 2 minutes)")
    parser.add_argument("--dry-run", action="store_true", help="check what the run needs and list it; no GPU needed")
    parser.add_argument("--results", default=None, help="results folder (default bench/results/device-check-DATE)")
    parser.add_argument("--only", default=None, help="comma list of parts to run (env,dmabuf,tests,gpu-prep,delivery)")
    parser.add_argument("--rerun", default=None, help="an earlier device-check.json: run the parts it did not pass")
    parser.add_argument("--budget-s", type=float, default=600, help="stop starting parts after this many seconds")
    parser.add_argument("--wheels", default=str(WHEELS), help=f"carried wheels (default {WHEELS.relative_to(ROOT)})")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the parts (default: this one)")
    parser.add_argument("--no-install", action="store_true", help="skip the setup (the tree is installed already)")
    parser.add_argument("--download-wheels", action="store_true", help="download the carried wheels (CPU machine)")
    parser.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        try:
            found = PROBES[args.probe]()
        except Exception as exc:  # written down as the part's failure, with where it happened
            found = {"status": FAILED, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        Path(args.probe_out).write_text(json.dumps(found, indent=1, default=str))
        return 0 if found.get("status") != FAILED else 1
    if args.download_wheels:
        return download_wheels(Path(args.wheels), args.python)
    if args.dry_run:
        return dry_run(args)
    if args.results is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        args.results = str(ROOT / "bench" / "results" / f"device-check-{stamp}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
