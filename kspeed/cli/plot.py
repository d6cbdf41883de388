"""``kspeed status --job J --plot FILE.png``: each rank's data wait over time, stacked by cause.

Drawn from the history the manager keeps per rank (:data:`kspeed.manager.jobs.HISTORY` reports of
cumulative figures): between two reports, each cause's seconds over the wall seconds between them
is the share of the loop's time it cost; the step's share is drawn above them, so a rank that
never waits shows a band of step alone. A wait is counted when its ``next()`` returns, so an
interval spent inside one long ``next()`` shows nothing and the next one shows it all. One panel
per rank, the ranks that waited most first.
matplotlib is optional (``pip install 'kspeed[plot]'``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

from kspeed.causes import CAUSES
from kspeed.errors import ConfigError

__all__ = ["MAX_PANELS", "plot_job"]

MAX_PANELS = 8  # ranks drawn, those with the largest wait share first
_COLOURS = {
    "pacing": "#8c564b",
    "failover": "#d62728",
    "client_prep": "#9467bd",
    "client": "#7f7f7f",
    "production": "#ff7f0e",
    "fetch": "#e377c2",
    "prep": "#1f77b4",
    "link": "#2ca02c",
    "server": "#bcbd22",
}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "kspeed status --plot needs matplotlib, which is not installed: pip install 'kspeed[plot]'",
            field="plot",
        ) from exc
    return plt


def rank_series(samples: list[dict]) -> tuple[list[float], dict[str, list[float]], list[float]]:
    """Per interval between consecutive reports: its end (seconds since the first report), each
    cause's share of the interval and the step's share."""
    times: list[float] = []
    shares: dict[str, list[float]] = {cause: [] for cause in CAUSES}
    steps: list[float] = []
    for before, after in itertools.pairwise(samples):
        wall = after["report_unix"] - before["report_unix"]
        if wall <= 0:
            continue
        times.append(after["report_unix"] - samples[0]["report_unix"])
        for cause in CAUSES:
            spent = after["blocked"].get(cause, 0.0) - before["blocked"].get(cause, 0.0)
            shares[cause].append(min(max(spent / wall, 0.0), 1.0))
        steps.append(min(max((after["step_s"] - before["step_s"]) / wall, 0.0), 1.0))
    return times, shares, steps


def plot_job(job: dict, path: str | Path, panels: int = MAX_PANELS) -> int:
    """Draw ``job`` (:func:`kspeed.control.status.job_dict` with its history) into ``path``;
    returns the panels drawn.

    Raises:
        ConfigError: matplotlib is missing, or the job has no history of two reports yet.
    """
    share = {(r["rank"], r["dataset"]): r["wait_share"] for r in job["ranks"]}
    histories = [h for h in job["history"] if len(h["samples"]) >= 2]
    if not histories:
        raise ConfigError(
            f"job {job['job']!r}: no rank has reported twice yet; plot again in a few seconds", field="plot"
        )
    histories.sort(key=lambda h: share.get((h["rank"], h["dataset"]), 0.0), reverse=True)
    histories = histories[:panels]
    plt = _pyplot()
    fig, axes = plt.subplots(len(histories), 1, figsize=(10, 2.2 * len(histories) + 0.6), sharex=True, squeeze=False)
    for ax, history in zip(axes[:, 0], histories):
        times, shares, steps = rank_series(history["samples"])
        drawn = [c for c in CAUSES if any(shares[c])]
        ax.stackplot(
            times,
            *[shares[c] for c in drawn],
            steps,
            labels=[*drawn, "step"],
            colors=[*(_COLOURS[c] for c in drawn), "#dddddd"],
            step="pre",  # each value is the interval's that ends there
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of time")
        ax.set_title(f"rank {history['rank']} ({history['dataset']})", fontsize=9, loc="left")
        ax.legend(loc="upper right", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel("seconds since the first report kept")
    fig.suptitle(f"job {job['job']}: data wait by cause")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
    return len(histories)
