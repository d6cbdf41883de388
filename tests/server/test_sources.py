"""Dataset sources: each kind, labels, fingerprints, listing speed and every bad input."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from kspeed.errors import AccessDeniedError, ChangedError, DatasetError, NotFoundError
from kspeed.server.backend.access import Backend
from kspeed.server.backend.allowlist import AllowList
from kspeed.server.backend.sources import open_source
from tests.server.datasets import write_tree


def test_directory_tree_sorted_ids_and_labels(tmp_path, backend):
    files = write_tree(tmp_path / "d", [10, 0, 30, 5], classes=("zebra", "ant"))
    (tmp_path / "d" / "zebra" / ".hidden").write_bytes(b"x")
    src = open_source(backend, "ds", str(tmp_path / "d"))
    keys = sorted(files)
    assert src.kind == "dir" and src.count == 4
    assert [src.key(i) for i in range(4)] == keys
    assert src.sizes.tolist() == [len(files[k]) for k in keys]
    assert src.classes == ("ant", "zebra")
    assert src.labels.tolist() == [0 if k.startswith("ant") else 1 for k in keys]
    for i, k in enumerate(keys):
        assert src.read(i) == files[k]
    assert src.read(keys.index("ant/00001.bin")) == b""


def test_flat_directory_has_no_labels(tmp_path, backend):
    (tmp_path / "d").mkdir()
    for n in ("b", "a"):
        (tmp_path / "d" / n).write_bytes(n.encode())
    src = open_source(backend, "ds", str(tmp_path / "d"))
    assert src.labels is None and src.read(0) == b"a"


def test_list_file_relative_and_absolute(tmp_path, backend):
    files = write_tree(tmp_path / "d", [3, 4, 5])
    keys = sorted(files)
    lst = tmp_path / "d" / "train.txt"
    lst.write_text(f"{keys[2]}\n\n# comment\n{tmp_path / 'd' / keys[0]}\n")
    src = open_source(backend, "ds", str(lst))
    assert src.kind == "list" and src.count == 2
    assert src.read(0) == files[keys[2]] and src.read(1) == files[keys[0]]


def test_list_file_entry_outside_allow_list(tmp_path, backend):
    lst = tmp_path / "l.txt"
    lst.write_text("/etc/hostname\n")
    with pytest.raises(AccessDeniedError, match="line 1"):
        open_source(backend, "ds", str(lst))


def test_manifest(tmp_path, backend):
    files = write_tree(tmp_path / "d", [7, 0, 9])
    keys = sorted(files)
    man = tmp_path / "d" / "data.manifest"
    man.write_bytes(b"".join(f"{k} {len(files[k])}\r\n".encode() for k in keys) + b"\n")
    src = open_source(backend, "ds", str(man))
    assert src.kind == "manifest" and src.sizes.tolist() == [len(files[k]) for k in keys]
    assert [src.key(i) for i in range(3)] == keys
    assert [src.read(i) for i in range(3)] == [files[k] for k in keys]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"a 1\nb\n", "line 2"),
        (b"a 1\nb x2\n", "line 2"),
        (b"a 1\n../x 3\n", r"contains '\.\.'"),
        (b"/etc/passwd 3\n", "is absolute"),
        (b"", "no samples"),
    ],
)
def test_bad_manifests(tmp_path, backend, text, match):
    man = tmp_path / "bad.manifest"
    man.write_bytes(text)
    with pytest.raises(DatasetError, match=match):
        open_source(backend, "ds", str(man))


def test_manifest_of_a_million_keys_parses_fast(tmp_path, backend):
    n = 1_000_000
    sizes = np.random.default_rng(1).integers(0, 10**9, n)
    body = "".join(f"shard{i // 1000:04d}/sample{i:07d}.jpg {s}\n" for i, s in enumerate(sizes.tolist()))
    man = tmp_path / "big.manifest"
    man.write_text(body)
    t = time.perf_counter()
    src = open_source(backend, "ds", str(man))
    elapsed = time.perf_counter() - t
    assert src.count == n and np.array_equal(src.sizes, sizes)
    assert src.key(123456) == "shard0123/sample0123456.jpg"
    assert elapsed < 5.0, f"listing a 1M-key manifest took {elapsed:.1f} s"


def test_npy_rows(tmp_path, backend):
    arr = np.arange(5 * 3 * 2, dtype=np.float32).reshape(5, 3, 2)
    np.save(tmp_path / "x.npy", arr)
    src = open_source(backend, "ds", str(tmp_path / "x.npy"))
    assert src.kind == "npy" and src.count == 5 and set(src.sizes.tolist()) == {24}
    for i in range(5):
        assert src.read(i) == arr[i].tobytes()
    assert src.key(2).endswith("x.npy[2]")


def test_npy_refuses_object_and_truncated(tmp_path, backend):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DatasetError, match="non-object"):
        open_source(backend, "ds", str(tmp_path / "o.npy"))
    np.save(tmp_path / "t.npy", np.zeros((100, 8), np.uint8))
    with open(tmp_path / "t.npy", "r+b") as f:
        f.truncate(200)
    with pytest.raises(DatasetError, match="truncated"):
        open_source(backend, "ds", str(tmp_path / "t.npy"))


def test_ten_thousand_files_list_quickly(tmp_path, backend):
    root = tmp_path / "many"
    for c in range(10):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(1000):
            (root / f"c{c}" / f"{i:04d}").write_bytes(b"")
    t = time.perf_counter()
    src = open_source(backend, "ds", str(root))
    assert src.count == 10_000 and src.labels[-1] == 9
    assert time.perf_counter() - t < 5.0


def test_fingerprint_notices_changes(tmp_path, backend):
    write_tree(tmp_path / "d", [10, 20])
    src = open_source(backend, "ds", str(tmp_path / "d"))
    assert src.reopen().fingerprint == src.fingerprint
    path = tmp_path / "d" / src.key(0)
    path.write_bytes(b"y" * 10)
    os.utime(path, (1, 1))
    changed = src.reopen()
    assert changed.fingerprint.count == 2 and changed.fingerprint != src.fingerprint
    with pytest.raises(DatasetError, match="changed"):
        changed.check_fingerprint(src.fingerprint)


def test_read_errors_name_dataset_and_sample(tmp_path, backend):
    files = write_tree(tmp_path / "d", [10, 20, 30])
    keys = sorted(files)
    src = open_source(backend, "ds", str(tmp_path / "d"))
    (tmp_path / "d" / keys[0]).write_bytes(b"short")
    with pytest.raises(ChangedError, match=r"'ds' sample 0 \(.*\): size 10 -> 5 bytes after it was listed") as err:
        src.read(0)
    assert (err.value.sample, err.value.what) == (0, "size 10 -> 5 bytes")
    (tmp_path / "d" / keys[1]).write_bytes(b"z" * (len(files[keys[1]]) + 1))
    with pytest.raises(DatasetError, match=f"more than {len(files[keys[1]])}"):
        src.read(1)
    (tmp_path / "d" / keys[2]).unlink()
    with pytest.raises(ChangedError, match=r"'ds' sample 2 .*deleted") as err:  # a listed file that vanished
        src.read(2)
    assert err.value.sample == 2
    with pytest.raises(NotFoundError, match="no sample 3"):
        src.read(3)
    with pytest.raises(NotFoundError, match="no sample -1"):
        src.read_into(-1, bytearray(10))


def test_a_remote_store_reads_a_run_in_one_call_and_names_each_failed_sample(tmp_path):
    # "throttled" over the local file system stands for an object store: not a local-path protocol,
    # so a run of samples is one cat_ranges call (a whole file asks one byte more than listed).
    backend = Backend(AllowList([f"throttled://{tmp_path}"]), {"throttled": {"latency": 0.001}})
    files = write_tree(tmp_path / "d", [10, 20, 30, 0, 40, 50])
    keys = sorted(files)
    src = open_source(backend, "ds", f"throttled://{tmp_path}/d")
    fs = src.fs
    out = np.zeros(256, np.uint8)
    offsets = np.concatenate([[0], np.cumsum(src.sizes)[:-1]]).tolist()
    calls = []
    cat_ranges = fs.cat_ranges
    fs.cat_ranges = lambda paths, *a, **k: (calls.append(len(paths)), cat_ranges(paths, *a, **k))[1]
    crcs, errors = src.read_run(list(range(6)), out, offsets, src.sizes.tolist())
    assert not errors and calls == [5]  # the five non-empty ones in one call (the empty one is opened)
    assert [bytes(out[o : o + n]) for o, n in zip(offsets, src.sizes.tolist())] == [files[k] for k in keys]
    empty = int(np.flatnonzero(src.sizes == 0)[0])
    assert crcs[empty] == 0 and all(crcs[j] for j in range(6) if j != empty)  # an empty sample's crc32c is 0
    changed = [j for j in range(6) if j != empty][:3]
    n = [int(src.sizes[j]) for j in changed]
    (tmp_path / "d" / keys[changed[0]]).write_bytes(b"s")  # shrank
    (tmp_path / "d" / keys[changed[1]]).write_bytes(b"z" * (n[1] + 1))  # grew
    (tmp_path / "d" / keys[changed[2]]).unlink()
    crcs, errors = src.read_run(list(range(6)), out, offsets, src.sizes.tolist())
    assert calls == [5, 5]
    assert [(e.sample, e.what) for e in errors] == [
        (changed[0], f"size {n[0]} -> 1 bytes"),
        (changed[1], f"size {n[1]} -> more than {n[1]} bytes"),
        (changed[2], "deleted"),
    ]
    assert all(isinstance(e, ChangedError) and "'ds' sample" in str(e) for e in errors)
    assert [crcs[j] for j in changed] == [0, 0, 0] and all(crcs[j] for j in range(6) if j not in (*changed, empty))


def test_symlink_planted_after_listing_is_refused_at_read(tmp_path, backend):
    files = write_tree(tmp_path / "d", [5])
    src = open_source(backend, "ds", str(tmp_path / "d"))
    path = tmp_path / "d" / sorted(files)[0]
    path.unlink()
    os.symlink("/etc/hostname", path)
    with pytest.raises(AccessDeniedError, match="sample 0"):
        src.read(0)


def test_symlink_out_of_tree_is_refused_at_listing(tmp_path, backend):
    write_tree(tmp_path / "d", [5])
    os.symlink("/etc/hostname", tmp_path / "d" / "cat" / "evil")
    with pytest.raises(AccessDeniedError, match="refused"):
        open_source(backend, "ds", str(tmp_path / "d"))


@pytest.mark.parametrize("made", [True, False], ids=["empty", "missing"])
def test_a_path_this_server_cannot_see_says_the_servers_read_it_themselves(tmp_path, backend, made):
    # A path that exists only where the client runs: empty or missing on the server.
    path = tmp_path / "only-on-the-client"
    if made:
        path.mkdir()
    with pytest.raises(DatasetError) as info:
        open_source(backend, "ds", str(path))
    said = str(info.value)
    assert ("holds no samples" if made else "No such file") in said
    assert "the servers read a dataset themselves" in said and "not only where the client runs" in said
    assert f"this server's host: {socket.gethostname()}" in said


def test_uri_outside_allow_list(backend):
    with pytest.raises(AccessDeniedError, match="/etc"):
        open_source(backend, "ds", "file:///etc")


def test_throttled_filesystem_adds_latency(tmp_path, backend):
    files = write_tree(tmp_path / "d", [100] * 5)
    src = open_source(backend, "ds", f"slowfile://{tmp_path}/d")
    t = time.perf_counter()
    data = [src.read(i) for i in range(5)]
    assert time.perf_counter() - t >= 5 * 0.002
    assert data == [files[k] for k in sorted(files)]


def bump_mtime(path, seconds: int = 3) -> None:
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 1_000_000_000))


def test_an_attach_compares_a_manifest_by_its_stamp_then_its_files_by_size(tmp_path, backend):
    files = write_tree(tmp_path / "d", [7, 5, 9])
    keys = sorted(files)
    man = tmp_path / "d" / "data.manifest"
    man.write_bytes(b"".join(f"{k} {len(files[k])}\n".encode() for k in keys))
    src = open_source(backend, "ds", str(man))
    ids = np.arange(3)
    (tmp_path / "d" / keys[1]).write_bytes(
        b"x" * 6
    )  # resized (from 9 or 5 bytes), the manifest untouched: not looked at
    assert src.verify(ids) == []
    bump_mtime(man)  # a new manifest: its files are compared (by size: a manifest has no stamps)
    changes = src.verify(ids)
    assert [(c.sample, c.what) for c in changes] == [(1, f"size {len(files[keys[1]])} -> 6 bytes")]


def test_an_attach_lists_an_object_store_once_and_compares_files_only_when_it_changed(tmp_path, backend):
    files = write_tree(tmp_path / "d", [7, 5, 9, 4])
    keys = sorted(files)
    src = open_source(backend, "ds", f"slowfile://{tmp_path / 'd'}")  # not local: no stat per file
    assert src.kind == "dir" and src._local is None
    checked = []
    check = src.check
    src.check = lambda ids: checked.append(list(ids)) or check(ids)
    assert src.verify(np.arange(4)) == [] and checked == []
    bump_mtime(tmp_path / "d" / keys[2])
    changes = src.verify(np.arange(4))
    assert [(c.sample, c.what) for c in changes] == [(2, "modified (a new mtime or etag)")] and len(checked) == 1
