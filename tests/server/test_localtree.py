"""The scandir walk of a local tree finds what fsspec's listing finds: same IDs, sizes, stamps, fingerprint."""

from __future__ import annotations

import os

import fsspec
import pytest

from kspeed.errors import AccessDeniedError
from kspeed.server.backend import findwalk, listing, localtree


@pytest.fixture(autouse=True, params=["find", "python"])
def walker(request, monkeypatch):
    """Each test with GNU find's walk and with the walk in Python (where find is missing)."""
    if request.param == "python":
        monkeypatch.setattr(localtree, "find_files", lambda root, folders, processes: None)
    elif not findwalk.gnu_find():
        pytest.skip("GNU find is not installed here")
    return request.param


def both(backend, root):
    fs = fsspec.filesystem("file")
    fast = listing._open_dir(backend, "d", str(root), fs, str(root), "file")
    slow = listing._open_fs_dir(backend, "d", fs, str(root), "file")  # the general path: fsspec's find
    return fast, slow


def same(fast, slow):
    assert fast.keys.blob == slow.keys.blob
    assert (fast.keys.starts == slow.keys.starts).all() and (fast.keys.ends == slow.keys.ends).all()
    assert (fast.sizes == slow.sizes).all() and (fast.stamps == slow.stamps).all()
    assert fast.classes == slow.classes
    assert (fast.labels is None) == (slow.labels is None)
    if fast.labels is not None:
        assert (fast.labels == slow.labels).all()


def test_class_tree_with_hidden_entries_nested_folders_and_a_file_link(tmp_path, backend):
    root = tmp_path / "t"
    for key, size in (("b/1.jpg", 3), ("a/x/2.jpg", 5), ("a-b/3.jpg", 0), ("a/4.jpg", 9), ("ä/5", 1)):
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(b"z" * size)
    (root / ".cache").mkdir()
    (root / ".cache" / "skip").write_bytes(b"no")
    (root / "b" / ".hidden").write_bytes(b"no")
    os.symlink(root / "a" / "4.jpg", root / "b" / "link.jpg")
    fast, slow = both(backend, root)
    same(fast, slow)
    assert fast.classes == ("a", "a-b", "b", "ä") and len(fast.sizes) == 6


def test_files_at_the_root_mean_no_labels(tmp_path, backend):
    root = tmp_path / "t"
    (root / "c").mkdir(parents=True)
    (root / "top.bin").write_bytes(b"1")
    (root / "c" / "in.bin").write_bytes(b"22")
    fast, slow = both(backend, root)
    same(fast, slow)
    assert fast.labels is None and fast.classes == ()


def test_a_link_out_of_the_allow_list_is_refused(tmp_path, backend):
    root = tmp_path / "t"
    root.mkdir()
    os.symlink("/etc/hostname", root / "escape")
    with pytest.raises(AccessDeniedError):
        listing._open_dir(backend, "d", str(root), fsspec.filesystem("file"), str(root), "file")


def test_a_link_to_a_folder_is_not_a_sample(tmp_path, backend):
    root = tmp_path / "t"
    (root / "real").mkdir(parents=True)
    (root / "real" / "f").write_bytes(b"1")
    os.symlink(root / "real", root / "again")
    fast = listing._open_dir(backend, "d", str(root), fsspec.filesystem("file"), str(root), "file")
    assert [fast.keys[i] for i in range(len(fast.sizes))] == ["real/f"]


def test_odd_names_and_both_walks_agree(tmp_path, backend, monkeypatch):
    root = tmp_path / "t"
    names = ["-dash/a", "sp ace/b c", "new\nline/d", "ünï/é", "x/y/z/deep", "x/.hid/no", "plain"]
    for i, key in enumerate(names):
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(b"q" * i)
    fs = fsspec.filesystem("file")
    found = listing._open_dir(backend, "d", str(root), fs, str(root), "file")
    slow = listing._open_fs_dir(backend, "d", fs, str(root), "file")
    same(found, slow)
    assert [found.keys[i] for i in range(len(found.sizes))] == sorted(k for k in names if ".hid" not in k)
    assert found.labels is None  # "plain" lies at the root
