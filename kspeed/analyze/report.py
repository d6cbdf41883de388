"""What the analyzer found, for a person: a terminal table, and a report folder (JSON, PNG, Markdown)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kspeed.analyze.analysis import Analysis
from kspeed.errors import ConfigError

__all__ = ["finite", "plot", "summary", "table", "write_report"]

#: The curves of the report's chart, with how their axis is labelled and which setup field they vary.
CURVES = {
    "servers": "servers",
    "server_cores": "preprocessing workers per server",
    "client_cores": "preprocessing workers per rank",
    "cache_fraction": "share of the dataset in the servers' memory",
    "offload": "offload ratio (share preprocessed on the servers)",
    "rail_bytes_per_s": "rail bandwidth (MB/s)",
}
_RATES = (
    ("G", "step", "the step alone, data already in the ring (per rank)"),
    ("P_s", "server_prep", "the servers' preprocessing for this job (all servers)"),
    ("P_c", "client_prep", "one rank's workers preprocessing everything"),
    ("C", "memory_fetch", "stored bytes from the servers' memory (per rank)"),
    ("S", "backend_fetch", "reads from the backend (all servers)"),
)


def _grid(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header)), *[list(map(str, r)) for r in rows]]
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _rate(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.0f}/s"


def table(a: Analysis) -> str:
    """The analysis as a few fixed-width tables and the one-line answer."""
    m = a.measured
    p = a.prediction
    lines = [
        f"dataset {a.dataset}: {m.servers} server(s) x {m.server_cores} worker(s), {m.ranks} rank(s) "
        f"x {m.client_cores} worker(s), batch {a.options.batch_size}, step {a.options.step}",
        "",
        _grid(("RATE", "SAMPLES/S", "WHAT"), [(k, _rate(getattr(m, f)), w) for k, f, w in _RATES]),
        "",
        f"as the job runs (offload {a.as_is.offload:.2f}, {a.as_is.cache_fraction:.0%} in memory): "
        f"measured {a.observed:,.0f} samples/s per rank, model {p.samples_per_s:,.0f} "
        f"(bound: {p.bound}); prep stall {p.prep_stall:.0%}, fetch stall {p.fetch_stall:.0%} of a sample's time",
        "",
        _grid(
            ("RANK", "MEASURED", "DATA WAIT", "MODEL", "PREP STALL", "FETCH STALL", "BOUND"),
            [
                (
                    r["rank"],
                    _rate(r["observed_samples_per_s"]),
                    f"{r['observed_wait_share']:.0%}",
                    _rate(r["predicted_samples_per_s"]),
                    f"{r['prep_stall']:.0%}",
                    f"{r['fetch_stall']:.0%}",
                    r["bound"],
                )
                for r in a.ranks
            ],
        ),
        "",
        "what if (samples/s per rank; everything else as measured):",
    ]
    rows = []
    for key in ("servers", "cache_fraction", "offload", "client_cores", "server_cores"):
        points = a.curves[key]
        picks = points if len(points) <= 6 else [points[int(k * (len(points) - 1) / 5)] for k in range(6)]
        rows.append((key, "  ".join(f"{_value(key, pt[key])}: {_rate(pt['samples_per_s'])}" for pt in picks)))
    lines.append(_grid(("VARY", "PREDICTED"), rows))
    lines += ["", a.smallest["line"]]
    lines += [f"note: {n}" for n in a.notes]
    return "\n".join(lines)


def _value(key: str, value: Any) -> str:
    if key == "rail_bytes_per_s":
        return f"{value / 1e6:,.0f}MB/s"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _as_is_x(a: Analysis, key: str) -> float:
    value = getattr(a.as_is, key)
    return value / 1e6 if key == "rail_bytes_per_s" else value


def plot(a: Analysis, path: Path, extra: Sequence[dict] = ()) -> None:
    """The predicted curves, one panel per dimension, with the measured point on them (and the
    ``extra`` points: ``{"curve", "x", "samples_per_s", "label"}``, e.g. a benchmark's held-out runs).

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'kspeed[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("charts need matplotlib: pip install 'kspeed[plot]'", field="report") from exc
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for ax, (key, label) in zip(axes.flat, CURVES.items()):
        points = a.curves[key]
        xs = [pt[key] / 1e6 if key == "rail_bytes_per_s" else pt[key] for pt in points]
        ax.plot(xs, [pt["samples_per_s"] for pt in points], "-", color="tab:blue", label="model")
        ax.axhline(a.measured.step, color="tab:gray", linestyle=":", label="step alone (G)")
        ax.plot([_as_is_x(a, key)], [a.observed], "o", color="tab:red", label="measured, as the job runs")
        for point in extra:
            if point["curve"] == key:
                ax.plot([point["x"]], [point["samples_per_s"]], "s", color="tab:green")
                ax.annotate(point.get("label", ""), (point["x"], point["samples_per_s"]), fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel("samples/s per rank")
        ax.set_ylim(bottom=0)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(
        f"{a.dataset}: predicted samples/s per rank as one dimension changes\n{a.smallest['line']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(a: Analysis, chart: str | None) -> str:
    """A short Markdown summary of the analysis."""
    m, p = a.measured, a.prediction
    lines = [
        f"# Stall analysis of `{a.dataset}`",
        "",
        f"Measured on {m.servers} server(s) of {m.server_cores} preprocessing worker(s), {m.ranks} rank(s) "
        f"of {m.client_cores} worker(s), batch {a.options.batch_size}, step `{a.options.step}`, "
        f"{a.options.seconds:g} s per phase ({a.seconds:.0f} s in all).",
        "",
        "| rate | samples/s | what |",
        "|---|---|---|",
        *[f"| {k} | {_rate(getattr(m, f))} | {w} |" for k, f, w in _RATES],
        "",
        f"**As the job runs** (offload {a.as_is.offload:.2f}, {a.as_is.cache_fraction:.0%} of the dataset in "
        f"memory): {a.observed:,.0f} samples/s per rank measured, {p.samples_per_s:,.0f} predicted, bound by "
        f"**{p.bound}**. Prep stall {p.prep_stall:.0%} and fetch stall {p.fetch_stall:.0%} of a sample's time.",
        "",
        f"**{a.smallest['line']}.**",
    ]
    if chart:
        lines += ["", f"![what if]({chart})"]
    if a.notes:
        lines += ["", *[f"- {n}" for n in a.notes]]
    return "\n".join(lines) + "\n"


def write_report(a: Analysis, directory: Path) -> list[Path]:
    """``analysis.json``, ``whatif.png`` (where matplotlib is installed) and ``summary.md`` in
    ``directory`` (made if missing); the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "analysis.json"]
    written[0].write_text(json.dumps(finite(a.as_dict()), indent=2, sort_keys=True, allow_nan=False) + "\n")
    chart: str | None = "whatif.png"
    missing = ""
    try:
        plot(a, directory / "whatif.png")
        written.append(directory / "whatif.png")
    except ConfigError as exc:
        chart, missing = None, f"\nNo chart: {exc}.\n"
    (directory / "summary.md").write_text(summary(a, chart) + missing)
    written.append(directory / "summary.md")
    return written


def finite(value: Any) -> Any:
    """``value`` with every infinite or NaN float (no limit, nothing measured) as ``None``, for JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
