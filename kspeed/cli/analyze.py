"""``kspeed analyze``: where a job's data waits come from, and the smallest cluster that removes them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kspeed.cli.args import say, subcommand
from kspeed.config import ClientConfig, load_config
from kspeed.errors import ConfigError


def _offload(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--offload must be 'auto' or a number 0..1, not {text!r}") from None


def _step(args: argparse.Namespace) -> str:
    given = [s for s in (args.step, args.step_ms, args.step_cpu_ms) if s is not None]
    if len(given) != 1:
        raise ConfigError("give the training step once: --step pkg.mod:function, --step-ms MS or --step-cpu-ms MS")
    if args.step is not None:
        return str(args.step)
    return f"sleep:{args.step_ms:g}" if args.step_ms is not None else f"cpu:{args.step_cpu_ms:g}"


def cmd_analyze(args: argparse.Namespace) -> int:
    """Measure the dataset's rates with the given step, then print (and write) the analysis."""
    from kspeed.analyze import Options, analyze
    from kspeed.analyze.report import finite, table, write_report

    options = Options(
        step=_step(args),
        batch_size=args.batch_size,
        seconds=args.seconds,
        warmup_s=args.warmup,
        ranks=args.ranks,
        offload=args.offload,
        num_workers=args.workers,
        rail=args.rail,
    )
    analysis = analyze(load_config(ClientConfig, args), args.dataset, options)
    if args.json:
        say(json.dumps(finite(analysis.as_dict()), indent=2, sort_keys=True))
    else:
        say(table(analysis))
    if args.report:
        for path in write_report(analysis, Path(args.report)):
            say(f"wrote {path}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``kspeed analyze``."""
    parser = subcommand(
        sub,
        "analyze",
        "measure a job's rates on the cluster (step, preprocessing, fetch) and predict what removes its stalls",
        "  kspeed analyze --dataset imgs --batch-size 256 --step train:step        your step, imported\n"
        "  kspeed analyze --dataset imgs --batch-size 256 --step-ms 120            a step of 120 ms (GPU-bound)\n"
        "  kspeed analyze --dataset imgs --batch-size 64 --step-cpu-ms 30 --ranks 2 --report analysis/\n",
    )
    parser.add_argument("--dataset", required=True, metavar="NAME", help="a registered dataset (its pipeline too)")
    parser.add_argument("--batch-size", type=int, required=True, metavar="N", help="samples per batch")
    parser.add_argument("--step", default=None, metavar="PKG.MOD:FUNC", help="the training step, called with a batch")
    parser.add_argument("--step-ms", type=float, default=None, metavar="MS", help="a step that waits MS per batch")
    parser.add_argument(
        "--step-cpu-ms", type=float, default=None, metavar="MS", help="a step that keeps a core busy MS per batch"
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, metavar="S", help="each phase's measured time (default 5)"
    )
    parser.add_argument(
        "--warmup", type=float, default=2.0, metavar="S", help="each phase's run before it is measured (default 2)"
    )
    parser.add_argument("--ranks", type=int, default=1, metavar="N", help="ranks measured at once (default 1)")
    parser.add_argument(
        "--offload", type=_offload, default=None, metavar="R|auto", help="the job's split (default: the client's)"
    )
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="client preprocessing workers per rank")
    parser.add_argument("--rail", default=None, metavar="RAIL", help="the rail (default: chosen as for any job)")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    parser.add_argument("--report", default="", metavar="DIR", help="write analysis.json, whatif.png and summary.md")
    parser.set_defaults(func=cmd_analyze)
