"""The auto-offload benchmark's figures: a sweep's best, a mid-run change's recovery, the targets
and the chart.

Recovery after a change: the trailing throughput over :data:`WINDOW_S` seconds (samples of the
batches handed over in that span), evaluated every 0.1 s from the first window wholly after the
change; the job is back at the first such time when that window is within :data:`WITHIN` of the
new best *and* the mean from then to the end of the run is too (so a lucky window does not count).
"""

from __future__ import annotations

import bisect
import math

from _common import pyplot

__all__ = ["WINDOW_S", "WITHIN", "best_fixed", "chart", "recovery", "targets"]

WINDOW_S = 2.0
WITHIN = 0.05
#: Targets: auto against the sweep's best and against offload=0; after a change, back within
#: WITHIN of the new best in RECOVER_S with at most MAX_CHANGES ratio changes.
VS_BEST, VS_LOCAL, RECOVER_S, MAX_CHANGES = 0.95, 0.98, 10.0, 2


def median_run(results: list[dict]) -> dict:
    """A configuration's runs as one: the run of median samples/s (the lower middle of an even
    count: a figure one run reached, never an average of two), with every run's samples/s beside
    it; a configuration with a failed run keeps the failure."""
    failed = [r for r in results if not r.get("ok")]
    if failed or len(results) == 1:
        return failed[0] if failed else results[0]
    ordered = sorted(results, key=lambda r: r["samples_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_samples_per_s": [r["samples_per_s"] for r in results]}


def best_fixed(configs: dict[str, dict]) -> tuple[str, float] | None:
    """The fixed ratio (label) with the most samples/s, and that figure."""
    fixed = [(k, c["samples_per_s"]) for k, c in configs.items() if k != "auto" and c.get("ok")]
    return max(fixed, key=lambda kv: kv[1]) if fixed else None


def recovery(series: list, change_at: float, best: float, end_at: float | None = None) -> dict:
    """Figures of a mid-run change from ``series`` (``(monotonic time, samples, ratio)`` per batch)."""
    times = [t for t, _, _ in series]
    cumulative = [0]
    for _, n, _ in series:
        cumulative.append(cumulative[-1] + n)
    end = end_at if end_at is not None else (times[-1] if times else change_at)

    def delivered(t: float) -> int:  # samples handed over by time t
        return cumulative[bisect.bisect_right(times, t)]

    def rate(a: float, b: float) -> float:
        return (delivered(b) - delivered(a)) / (b - a) if b > a else math.nan

    goal = (1 - WITHIN) * best
    back = None
    t = change_at + WINDOW_S
    while t <= end - WINDOW_S:
        if rate(t - WINDOW_S, t) >= goal and rate(t, end) >= goal:
            back = t - change_at
            break
        t += 0.1
    ratios_after = [r for tt, _, r in series if tt > change_at]
    before = [r for tt, _, r in series if tt <= change_at]
    changes = sum(1 for a, b in zip([before[-1] if before else None, *ratios_after], ratios_after) if a != b)
    start = times[0] if times else change_at
    per_second = []
    s = start
    while s + 1.0 <= end:
        per_second.append(
            {
                "t": round(s + 1.0 - change_at, 3),
                "samples_per_s": rate(s, s + 1.0),
                "trailing_2s": rate(max(s + 1.0 - WINDOW_S, start), s + 1.0),
                "ratio": next((r for tt, _, r in reversed(series) if tt <= s + 1.0), None),
            }
        )
        s += 1.0
    return {
        "recovery_s": back,
        "ratio_changes_after": changes,
        "ratio_at_change": before[-1] if before else None,
        "final_ratio": series[-1][2] if series else None,
        "new_best_samples_per_s": best,
        "samples_per_s_before": rate(max(start, change_at - 10.0), change_at),
        "samples_per_s_last_10s": rate(max(change_at, end - 10.0), end),
        "per_second": per_second,
    }


def _target(name: str, value, threshold: float, at_least: bool) -> dict:
    met = value is not None and not (isinstance(value, float) and math.isnan(value))
    met = met and (value >= threshold if at_least else value <= threshold)
    return {
        "name": name,
        "value": value,
        "threshold": threshold,
        "met": bool(met),
        "compare": ">=" if at_least else "<=",
    }


def targets(scenarios: dict, changes: dict) -> list[dict]:
    """Every target of the run, each ``{name, value, threshold, met, compare}``."""
    out = []
    for name, scenario in scenarios.items():
        configs = scenario["configs"]
        auto, best = configs.get("auto", {}), best_fixed(configs)
        auto_rate = auto.get("samples_per_s") if auto.get("ok") else None
        local = configs.get("0.00", {})
        local_rate = local.get("samples_per_s") if local.get("ok") else None
        out.append(
            _target(
                f"{name}: auto / best fixed ({'offload=' + best[0] if best else 'none'})",
                auto_rate / best[1] if auto_rate and best else None,
                VS_BEST,
                True,
            )
        )
        out.append(
            _target(
                f"{name}: auto / offload=0",
                auto_rate / local_rate if auto_rate and local_rate else None,
                VS_LOCAL,
                True,
            )
        )
    for name, change in changes.items():
        figures = change.get("figures") or {}
        out.append(
            _target(f"{name}: seconds until within 5% of the new best", figures.get("recovery_s"), RECOVER_S, False)
        )
        out.append(
            _target(f"{name}: ratio changes after the change", figures.get("ratio_changes_after"), MAX_CHANGES, False)
        )
    return out


def chart(doc: dict, path: str) -> None:
    """One panel per scenario (samples/s against the fixed ratio, auto marked) and per change
    (throughput and the ratio in force over time)."""
    plt = pyplot()
    if plt is None:
        return
    scenarios, changes = doc["scenarios"], doc["changes"]
    panels = len(scenarios) + len(changes)
    cols = 3
    rows = max(math.ceil(panels / cols), 1)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax, (name, scenario) in zip(flat, scenarios.items()):
        configs = scenario["configs"]
        fixed = sorted((float(k), c["samples_per_s"]) for k, c in configs.items() if k != "auto" and c.get("ok"))
        if fixed:
            ax.plot([x for x, _ in fixed], [y for _, y in fixed], "o-", color="tab:blue", label="fixed offload")
        auto = configs.get("auto", {})
        if auto.get("ok"):
            ratio = auto["stats_offload"]["ratio"]
            ax.axhline(auto["samples_per_s"], color="tab:red", linestyle="--", linewidth=1)
            ax.plot(
                [ratio],
                [auto["samples_per_s"]],
                "*",
                color="tab:red",
                markersize=14,
                label=f"auto (ends at {ratio:.2f})",
            )
        ax.set_title(f"{name}: {scenario['title']}", fontsize=10)
        ax.set_xlabel("offload (share of samples preprocessed on the servers)")
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    for ax, (name, change) in zip(flat[len(scenarios) :], changes.items()):
        figures = change.get("figures")
        ax.set_title(f"{name}: {change['title']}", fontsize=10)
        if not figures:
            ax.text(0.5, 0.5, change.get("error", "failed"), ha="center", va="center", wrap=True, fontsize=8)
            continue
        points = figures["per_second"]
        t = [p["t"] for p in points]
        ax.plot(t, [p["samples_per_s"] for p in points], color="tab:blue", alpha=0.4, label="samples/s (1 s bins)")
        ax.plot(t, [p["trailing_2s"] for p in points], color="tab:blue", label=f"trailing {WINDOW_S:.0f} s")
        if figures["recovery_s"] is not None:
            ax.axvline(figures["recovery_s"], color="tab:green", linestyle=":", label="back within 5%")
        ax.axvline(0, color="black", linestyle=":", label="change")
        ax.axhline(
            figures["new_best_samples_per_s"], color="tab:green", linestyle="--", linewidth=1, label="new best fixed"
        )
        ax.set_xlabel("seconds after the change")
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.step(t, [p["ratio"] for p in points], where="post", color="tab:red", label="ratio")
        twin.set_ylim(-0.05, 1.05)
        twin.set_ylabel("offload ratio in force")
        lines = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower left")
    for ax in flat[panels:]:
        ax.axis("off")
    fig.suptitle("offload='auto' against fixed splits (2-core VM: training on one core, KSpeed on the other)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
