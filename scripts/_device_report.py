"""How the device check reads its parts' results (a JUnit report, the benchmarks' JSON, the
probes' dicts), states the issue's targets, and draws the chart."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from _device_probes import FAILED, PASSED, PROBES

__all__ = ["chart", "judge", "read_junit", "targets"]


def read_junit(path: Path) -> dict:
    """Counts and the failed and skipped tests (with their messages) of a JUnit XML report."""
    root = ElementTree.parse(path).getroot()
    cases = list(root.iter("testcase"))
    summary: dict = {"tests": len(cases), "passed": 0, "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            summary["failed"].append({"test": name, "message": (bad.get("message") or "")[:500]})
        elif skipped is not None:
            summary["skipped"].append({"test": name, "reason": (skipped.get("message") or "")[:500]})
        else:
            summary["passed"] += 1
    return summary


def judge(name: str, rc: int, results: Path, probe: dict | None) -> tuple[str, dict]:
    """A part's status and figures from its exit code and what it wrote."""
    if rc == 124:
        return FAILED, {"error": "ran past its time limit"}
    if name in PROBES:
        if probe is None:
            return FAILED, {"error": f"the probe exited with {rc} and wrote nothing"}
        return probe.pop("status", PASSED if rc == 0 else FAILED), probe
    if name == "tests":
        report = results / "gpu-tests.xml"
        if not report.exists():
            return FAILED, {"error": f"pytest exited with {rc} and wrote no report"}
        summary = read_junit(report)
        ok = rc == 0 and not summary["failed"] and summary["passed"] > 0
        return (PASSED if ok else FAILED), summary
    out = results / ("delivery.json" if name == "delivery" else "gpu_prep.json")
    if not out.exists():
        return FAILED, {"error": f"exited with {rc} and wrote no {out.name}"}
    doc = json.loads(out.read_text())
    figures = {"results": doc.get("results"), "targets": doc.get("targets"), "limits": doc.get("limits")}
    figures = {k: v for k, v in figures.items() if v is not None}
    if name == "gpu-prep":
        figures["ratios"] = doc.get("ratios")
    errors = _row_errors(doc.get("results"))
    if errors:
        figures["errors"] = errors
    return (PASSED if rc == 0 and not errors else FAILED), figures


def _row_errors(rows) -> list[str]:
    if isinstance(rows, dict):
        rows = [{"system": k, **v} for k, v in rows.items() if isinstance(v, dict)]
    return [f"{r.get('system')} {r.get('size', '')}: {r['error']}".strip() for r in rows or [] if "error" in r]


def targets(doc: dict) -> dict:
    """The issue's targets, each with its figure and whether it was met (``None``: not measured)."""
    got: dict = {}
    tests = doc["parts"].get("tests", {})
    figures = tests.get("figures", {})
    if "tests" in figures:
        got["every_gpu_test_passes"] = {
            "passed": figures["passed"],
            "of": figures["tests"],
            "met": figures["passed"] == figures["tests"],
        }
    delivery = doc["parts"].get("delivery", {}).get("figures", {}).get("targets") or []
    for row in delivery:  # bench/client.py's targets: the CPU ones are another issue's
        if row["target"].startswith("cuda_"):
            got[f"delivery:{row['target']}@{row['size']}"] = row
    for key, met in (doc["parts"].get("gpu-prep", {}).get("figures", {}).get("targets") or {}).items():
        got[f"gpu-prep:{key}"] = met
    return got


def chart(doc: dict, path: Path) -> None:
    """Delivery GB/s per size and system (with the limits), GPU vs CPU preprocessing samples/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    delivery = doc["parts"].get("delivery", {}).get("figures", {})
    rows = [r for r in delivery.get("results") or [] if "gbps" in r]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        values = [next((r["gbps"] for r in rows if r["system"] == system and r["size"] == s), 0) for s in sizes]
        left.bar([i + k * width for i in range(len(sizes))], values, width, label=system)
    limits = delivery.get("limits") or {}
    if "h2d_gbps" in limits:
        left.axhline(limits["h2d_gbps"], color="black", linestyle="--", label="host-to-device copy")
    labels = [f"{s // 2**20} MiB" if s >= 2**20 else f"{s // 2**10} KiB" for s in sizes]
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], labels)
    left.set_ylabel("GB/s into the training loop")
    left.set_title("delivery")
    if systems:
        left.legend(fontsize=7)
    prep = doc["parts"].get("gpu-prep", {}).get("figures", {}).get("results") or {}
    arms = [a for a, r in prep.items() if isinstance(r, dict) and "samples_per_s" in r]
    right.bar(arms, [prep[a]["samples_per_s"] for a in arms], color="tab:green")
    for i, arm in enumerate(arms):
        cpu = prep[arm].get("cpu_s_per_sample")
        if cpu is not None:
            label = f"{cpu * 1e3:.2f} ms CPU/sample"
            right.annotate(label, (i, prep[arm]["samples_per_s"]), ha="center", va="bottom", fontsize=8)
    right.set_ylabel("samples/s")
    right.set_title("decode + RandomResizedCrop + flip + normalize")
    device = doc.get("device") or "?"
    fig.suptitle(f"scripts/device-check on {device}, {doc.get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
