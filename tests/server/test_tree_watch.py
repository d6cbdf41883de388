"""A share's folders watched: the files events name, what makes the watch give up, and the attach
that compares only those files (and every file where events cannot be trusted)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from kspeed.proto import kspeed_pb2
from kspeed.server.backend import inotify
from kspeed.server.backend.sources import open_source
from kspeed.server.backend.tree_watch import ShareWatch
from kspeed.server.hosting.datasets import DatasetHost, fingerprint_pb
from tests.server.datasets import REGION


def tree(root, count=40):
    for i in range(count):
        path = root / f"c{i % 4}" / f"{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (10 + i))
    (root / "top.bin").write_bytes(b"at the root")
    return root


def rewrite_in_place(path) -> None:
    data = path.read_bytes()
    with open(path, "r+b") as fh:
        fh.write(bytes(255 - b for b in data[:1]))


def share_watch(source, lo=0, hi=None):
    hi = source.count if hi is None else hi
    linked = source.unwatchable if source.unwatchable is not None else np.zeros(0, np.int64)
    watch = ShareWatch.start("d", source.root, source.keys, lo, hi, linked)
    assert watch is not None
    return watch


def test_a_rewrite_in_place_a_removal_and_a_file_at_the_root_are_named(tmp_path, backend):
    source = open_source(backend, "d", str(tree(tmp_path / "t")))
    watch = share_watch(source)
    try:
        assert watch.touched(always=True).tolist() == []
        keys = [source.key(i) for i in range(source.count)]
        rewrite_in_place(tmp_path / "t" / keys[5])
        (tmp_path / "t" / keys[9]).unlink()
        (tmp_path / "t" / "top.bin").write_bytes(b"new bytes")
        (tmp_path / "t" / "c1" / "new.bin").write_bytes(b"not a sample")
        assert watch.touched(always=False).tolist() == sorted([5, 9, keys.index("top.bin")])
        assert watch.touched(always=False).tolist() == []  # named once
        assert watch.intact
    finally:
        watch.close()


def test_only_the_share_s_samples_are_named(tmp_path, backend):
    source = open_source(backend, "d", str(tree(tmp_path / "t")))
    watch = share_watch(source, 10, 20)
    try:
        for i in (3, 12, 25):
            rewrite_in_place(tmp_path / "t" / source.key(i))
        assert watch.touched(always=False).tolist() == [12]
    finally:
        watch.close()


def test_links_are_always_named_and_a_removed_folder_ends_the_watch(tmp_path, backend):
    root = tree(tmp_path / "t")
    os.symlink(root / "c0" / "000.bin", root / "c2" / "link.bin")
    os.link(root / "c1" / "001.bin", tmp_path / "elsewhere.bin")
    source = open_source(backend, "d", str(root))
    keys = [source.key(i) for i in range(source.count)]
    linked = sorted([keys.index("c2/link.bin"), keys.index("c1/001.bin")])
    assert source.unwatchable.tolist() == linked
    watch = share_watch(source)
    try:
        assert watch.touched(always=True).tolist() == linked and watch.touched(always=False).tolist() == []
        for name in os.listdir(root / "c3"):
            os.unlink(root / "c3" / name)
        os.rmdir(root / "c3")
        assert watch.touched(always=True) is None and not watch.intact and "c3" in watch.why
    finally:
        watch.close()


def test_no_watch_where_events_would_not_tell_every_change(tmp_path, backend, monkeypatch, caplog):
    assert inotify.local_file_system("/proc") == ""  # not a file system of files at all
    if not inotify.local_file_system(str(tmp_path)):
        pytest.skip(f"{tmp_path} is not on a local file system here")
    source = open_source(backend, "d", str(tree(tmp_path / "t")))
    monkeypatch.setattr("kspeed.server.backend.tree_watch.local_file_system", lambda path: "")
    with caplog.at_level(logging.INFO, logger="kspeed.server.backend.tree_watch"):
        assert ShareWatch.start("d", source.root, source.keys, 0, source.count, np.zeros(0, np.int64)) is None
    assert "not on a local file system: an attach compares every file" in caplog.text


def assignment(backend, root) -> kspeed_pb2.AssignShareRequest:
    spec = kspeed_pb2.DatasetSpec(name="d", uri=str(root))
    source = open_source(backend, "d", spec.uri)
    share = kspeed_pb2.Share(server_id="s", first_id=0, end_id=source.count, first_region=0, num_regions=1)
    return kspeed_pb2.AssignShareRequest(spec=spec, fingerprint=fingerprint_pb(source), region_size=REGION, share=share)


def test_the_host_notices_a_change_at_once_and_an_attach_compares_only_what_events_named(tmp_path, backend, pool):
    root = tree(tmp_path / "t")
    host = DatasetHost(pool, backend, str(tmp_path))
    try:
        host.assign(assignment(backend, root))
        hosted = host.get("d")
        assert hosted.watch is not None
        compared: list[list[int]] = []
        check = hosted.source.check
        hosted.source.check = lambda ids: compared.append(list(map(int, ids))) or check(ids)  # type: ignore[method-assign]
        assert host.check("d", attach=True).changed_samples == 0 and compared == [[]]
        victim = 7
        path = root / hosted.source.key(victim)
        path.write_bytes(b"x" * path.stat().st_size)  # same size, new bytes and mtime
        os.utime(path, ns=(0, path.stat().st_mtime_ns + 3_000_000_000))
        assert host.look_at_events() == 1 and compared[-1] == [victim]
        assert hosted.changes.ids().tolist() == [victim]
        status = host.check("d", attach=True)
        assert status.changed_samples == 1 and compared[-1] == []
    finally:
        host.close()
        host.drop("d")


def test_an_attach_without_a_watch_compares_every_file(tmp_path, backend, pool, monkeypatch):
    root = tree(tmp_path / "t")
    monkeypatch.setattr("kspeed.server.backend.tree_watch.local_file_system", lambda path: "")
    host = DatasetHost(pool, backend, str(tmp_path))
    try:
        host.assign(assignment(backend, root))
        assert host.get("d").watch is None
        os.utime(root / host.get("d").source.key(3), ns=(0, 10**9))
        status = host.check("d", attach=True)
        assert status.changed_samples == 1 and "sample 3 " in status.changes[0] and "modified" in status.changes[0]
    finally:
        host.close()
        host.drop("d")
