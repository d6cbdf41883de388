"""What ranks, servers and dataset size cost the control plane, measured on one machine in simulation.

Three parts, each a module of its own, each writing its figures into one JSON document and its
curves as PNG charts (``docs/scale/`` by default, where ``docs/scale.md`` shows them):

- ``plan`` (:mod:`_scale_plan`): the real manager and real server daemons, and hundreds of
  simulated ranks that speak the real client protocol (the client library's own links, feeds,
  planner, pump, statistics reporter and membership watch) from a few "node" processes on
  loopback. Samples are 8 bytes, so what moves per epoch is a few MB and the control plane is what
  is measured: epoch-boundary plan time (lookup + commit) against ranks and servers, the servers'
  CPU seconds for it, connections, threads and memory per server, and a server's health and info
  latency while 512 ranks plan.
- ``control`` (:mod:`_scale_control`): the real manager against up to 1,000 light simulated
  servers (registration, heartbeats, health probes answered) and simulated ranks (statistics,
  membership watches): the manager's CPU and the latency of each call.
- ``index`` (:mod:`_scale_index`): memory of a server's sample index, of the listing and of the
  manager's sizing against dataset size, up to 100M samples.

    python bench/scale.py all --json bench/results/scale.json --charts docs/scale
    python bench/scale.py plan --ranks 8,64,512 --servers 16 --quick
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import machine_info, stop_on_sigterm, write_json  # noqa: E402

PARTS = ("plan", "control", "index")


def _module(part: str):
    return importlib.import_module(f"_scale_{part}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures here (merged into an existing document)")
    parser.add_argument("--charts", default="", help="write the PNG curves into this directory")
    parser.add_argument(
        "--as",
        dest="key",
        default="",
        help="keep the figures under this key instead of the part's name (e.g. plan_before, for a run of "
        "the code before a change: its curves are drawn beside the part's own)",
    )
    sub = parser.add_subparsers(dest="part", required=True)
    for part in PARTS:
        module = _module(part)
        module.add_arguments(sub.add_parser(part, help=module.__doc__.splitlines()[0]))
    every = sub.add_parser("all", help="every part with its defaults")
    every.add_argument("--quick", action="store_true", help="small sizes only (minutes)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every part stops its daemons and removes its files.
    stop_on_sigterm()

    doc: dict = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    doc["machine"] = machine_info()
    parts = PARTS if args.part == "all" else (args.part,)
    for part in parts:
        module = _module(part)
        part_args = args
        if args.part == "all":
            part_parser = argparse.ArgumentParser()
            module.add_arguments(part_parser)
            part_args = part_parser.parse_args(["--quick"] if args.quick else [])
        started = time.time()
        print(f"== {part}", flush=True)
        result = module.measure(part_args)
        result["wall_s"] = round(time.time() - started, 1)
        result["when"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        key = args.key or part
        merge = getattr(module, "merge", None)
        doc[key] = merge(doc[key], result) if merge is not None and key in doc else result
        if args.charts and part in doc:
            os.makedirs(args.charts, exist_ok=True)
            for path in module.charts(doc[part], args.charts, before=doc.get(f"{part}_before")):
                print(f"chart: {path}", flush=True)
        if args.json:  # after every part, so a later failure keeps the earlier figures
            write_json(args.json, doc)
    if not args.json:
        write_json(None, doc)


if __name__ == "__main__":
    main()
