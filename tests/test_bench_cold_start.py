"""The cold-start benchmark's pure parts: its tree and manifest, its memory arithmetic and its targets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _cold_data as data
import _cold_report as report


def test_classes_follow_imagenet_and_hold_every_file():
    assert data.class_counts(1_280_000).tolist() == [1280] * 1000
    assert data.class_counts(2_000).tolist() == [1000, 1000]
    assert data.class_counts(1).tolist() == [1]
    counts = data.class_counts(10_000_001)
    assert len(counts) == 1000 and counts.sum() == 10_000_001 and counts.max() - counts.min() == 1
    with pytest.raises(ValueError):
        data.class_counts(0)


def test_a_tree_is_made_once_and_a_cut_short_one_resumes_to_the_same_bytes(tmp_path):
    tree, reused = data.make_tree(tmp_path, 3000, threads=2)
    assert not reused and tree.classes == 3
    files = sorted(Path(tree.root).rglob(f"*{data.EXTENSION}"))
    sizes = [f.stat().st_size for f in files]
    assert len(files) == 3000 and sum(sizes) == tree.bytes
    assert min(sizes) >= data.SIZE_RANGE[0] and max(sizes) <= data.SIZE_RANGE[1]
    assert files[0].relative_to(tree.root).as_posix() == data.file_key(0, 0)
    assert data.make_tree(tmp_path, 3000) == (tree, True)

    victim = Path(tree.root) / data.class_name(1)
    before = {f.name: f.read_bytes() for f in victim.iterdir()}
    (tmp_path / "files-3000" / "tree.json").unlink()  # cut short: class 1 half written, not marked done
    (tmp_path / "files-3000" / "progress" / data.class_name(1)).unlink()
    for f in sorted(victim.iterdir())[500:]:
        f.unlink()
    again, reused = data.make_tree(tmp_path, 3000)
    assert not reused and again == tree
    assert {f.name: f.read_bytes() for f in victim.iterdir()} == before


def test_the_manifest_lists_key_and_size_and_its_first_files_exist(tmp_path):
    manifest, reused = data.make_manifest(tmp_path, 5000, 7)
    assert not reused and manifest.keys == 5000 and manifest.files == 7
    lines = Path(manifest.path).read_text().splitlines()
    assert len(lines) == 5000
    base = Path(manifest.path).parent
    for i, line in enumerate(lines):
        key, size = line.rsplit(" ", 1)
        assert data.SIZE_RANGE[0] <= int(size) <= data.SIZE_RANGE[1]
        path = base / key
        assert path.exists() == (i < 7)
        if i < 7:
            assert path.stat().st_size == int(size)
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == manifest.bytes
    assert data.make_manifest(tmp_path, 5000, 7) == (manifest, True)


def test_a_tree_that_does_not_fit_is_refused_before_a_file_is_written(tmp_path):
    with pytest.raises(data.SpaceError, match=r"not enough room .* GB"):
        data.make_tree(tmp_path, 10**12)
    assert not (tmp_path / f"files-{10**12}" / "tree").exists()


def _snapshot(client_anon: int, server_anon: list[int]) -> dict:
    return {
        "client": {"anon": client_anon, "rss": client_anon * 2},
        "servers": [{"total": {"anon": a, "rss": a * 2}} for a in server_anon],
    }


def test_memory_per_sample_is_the_growth_since_before_register():
    memory = {
        "before": _snapshot(1000, [5000, 7000]),
        "registered": _snapshot(2000, [6000, 17000]),
        "first_batch": _snapshot(3000, [9000, 8000]),
    }
    got = report.per_sample(memory, 100)
    assert got["first_batch"]["client"] == {"anon": 20.0, "rss": 40.0}
    assert [s["anon"] for s in got["first_batch"]["servers"]] == [40.0, 10.0]
    assert got["first_batch"]["server_max"] == 40.0 and got["registered"]["server_max"] == 100.0
    assert got["largest"] == {"client": {"anon": 20.0}, "server_max": 100.0}


def test_the_memory_slope_cancels_fixed_costs():
    def entry(files, server, client):
        return {
            "files": files,
            "memory": {"per_sample": {"largest": {"server_max": server, "client": {"anon": client}}}},
        }

    def grown(files, fixed, per):
        return (fixed + per * files) / files

    doc = {"sizes": [entry(n, grown(n, 1e6, 100), grown(n, 5e5, 50)) for n in (11_000, 1000)]}
    assert report.memory_slope(doc) == pytest.approx(
        {"from_files": 1000, "to_files": 11_000, "server": 100.0, "client": 50.0}
    )
    assert report.memory_slope({"sizes": doc["sizes"][:1]}) is None


def test_verdicts_compare_each_figure_with_its_target():
    entry = {
        "files": 1_280_000,
        "listing": {"median_s": 2.0},
        "register": {"median_s": 3.9},
        "attach": {"median_s": 0.6},
        "cold": {"first_batch_s": 1.0, "register_preload_s": 10.0},
        "memory": {"per_sample": {"largest": {"server_max": 120.0, "client": {"anon": 10.0}}}},
    }
    got = report.verdicts(entry)
    assert got["register"] == {"value": 3.9, "limit": 4.0, "met": True}
    assert got["attach"]["met"] and got["attach"]["limit"] == pytest.approx(2.2)
    assert got["attach_imagenet"] == {"value": 0.6, "limit": 0.5, "met": False}
    assert got["cold_first_batch"] == {"value": 1.0, "limit": 2.5, "met": True}
    assert not got["server_memory"]["met"] and got["client_memory"]["met"]
    assert report.verdicts({"files": 10, "listing": {"error": "boom"}}) == {}


def test_a_summary_names_each_failed_section(tmp_path):
    doc = {"sizes": [{"files": 2000, "listing": {"error": "ChildError: boom"}, "verdicts": {}}], "manifest": None}
    lines = report.summary(doc)
    assert any("2,000 files / listing: ChildError: boom" in line for line in lines)
    json.dumps(doc)  # what the benchmark writes stays JSON


def test_file_counts_take_repeats_and_lists():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from cold_start import DEFAULT_FILES, file_counts

    assert file_counts(["40000", "1.28e6,2000"]) == [40_000, 1_280_000, 2000]
    assert file_counts(None) == list(DEFAULT_FILES)
