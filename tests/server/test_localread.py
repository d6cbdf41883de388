"""Lean local reads: descriptor checks, symlinks, size changes, npy rows and checksums."""

from __future__ import annotations

import os

import google_crc32c
import numpy as np
import pytest

from kspeed.errors import AccessDeniedError, ChangedError, DatasetError
from kspeed.server.backend.localread import PIECE
from kspeed.server.backend.sources import open_source
from kspeed.server.memory.checksum import GIL_FREE_MIN, crc32c, crc32c_extend
from tests.server.datasets import write_tree


def read_all(src):
    sizes = src.sizes.tolist()
    offsets = np.concatenate(([0], np.cumsum(src.sizes)[:-1])).tolist()
    out = np.zeros(int(src.sizes.sum()) + 1, dtype=np.uint8)
    crcs, errors = src.read_run(list(range(src.count)), out, offsets, sizes)
    return out, offsets, crcs, errors


def test_run_is_byte_exact_with_checksums_across_pieces(tmp_path, backend):
    sizes = [0, 10, GIL_FREE_MIN + 7, PIECE + 1, 2 * PIECE + 3]
    files = write_tree(tmp_path / "d", sizes)
    src = open_source(backend, "ds", str(tmp_path / "d"))
    out, offsets, crcs, errors = read_all(src)
    assert not errors
    for i, key in enumerate(sorted(files)):
        got = out[offsets[i] : offsets[i] + len(files[key])]
        assert got.tobytes() == files[key] and crcs[i] == google_crc32c.value(files[key])


def test_run_reports_each_failed_sample_and_reads_the_rest(tmp_path, backend):
    files = write_tree(tmp_path / "d", [100] * 5)
    keys = sorted(files)
    src = open_source(backend, "ds", str(tmp_path / "d"))
    (tmp_path / "d" / keys[1]).unlink()
    (tmp_path / "d" / keys[2]).write_bytes(b"x" * 101)
    (tmp_path / "d" / keys[3]).write_bytes(b"x" * 99)
    out, offsets, crcs, errors = read_all(src)
    assert [e.sample for e in errors] == [1, 2, 3]
    assert isinstance(errors[0], ChangedError) and keys[1] in str(errors[0]) and errors[0].what == "deleted"
    assert "size 100 -> more than 100 bytes" in str(errors[1]) and "size 100 -> 99 bytes" in str(errors[2])
    assert isinstance(errors[1], ChangedError) and isinstance(errors[2], ChangedError)
    assert all(isinstance(e, DatasetError) and e.dataset == "ds" for e in errors)
    assert out[offsets[4] : offsets[4] + 100].tobytes() == files[keys[4]] and crcs[4] != 0


def test_symlink_inside_the_tree_is_followed_and_outside_refused(tmp_path, backend):
    files = write_tree(tmp_path / "d", [50, 50, 50])
    keys = sorted(files)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.bin").write_bytes(files[keys[0]])
    target = tmp_path / "d" / keys[0]
    target.unlink()
    os.symlink(tmp_path / "other" / "x.bin", target)  # still under the allowed tmp_path
    src = open_source(backend, "ds", str(tmp_path / "d"))
    assert src.read(0) == files[keys[0]]
    target.unlink()
    os.symlink("/etc/hostname", target)
    with pytest.raises(AccessDeniedError, match="sample 0"):
        src.read(0)


def test_directory_swapped_for_a_symlink_out_of_the_tree_is_refused(tmp_path, backend):
    write_tree(tmp_path / "d", [5, 5], classes=("a",))
    src = open_source(backend, "ds", str(tmp_path / "d"))
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    (tmp_path / "d" / "a").rename(outside)
    os.symlink(outside, tmp_path / "d" / "a")
    _, _, _, errors = read_all(src)
    assert [e.sample for e in errors] == [0, 1] and all(isinstance(e, AccessDeniedError) for e in errors)


def test_npy_rows_read_in_one_open(tmp_path, backend):
    arr = np.arange(40, dtype=np.int32).reshape(10, 4)
    np.save(tmp_path / "a.npy", arr)
    src = open_source(backend, "ds", str(tmp_path / "a.npy"))
    out, _, crcs, errors = read_all(src)
    assert not errors and out[: arr.nbytes].tobytes() == arr.tobytes()
    assert crcs[3] == google_crc32c.value(arr[3].tobytes())


def test_checksums_agree_with_the_extension():
    data = np.frombuffer(np.random.default_rng(0).bytes(3 * GIL_FREE_MIN), dtype=np.uint8)
    assert crc32c(data) == google_crc32c.value(data.tobytes())
    assert crc32c_extend(crc32c(data[:100]), data[100:]) == google_crc32c.value(data.tobytes())
