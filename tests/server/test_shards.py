"""Tar shards: brace patterns, samples grouped by key, the bytes member and the .cls label, ranged reads."""

from __future__ import annotations

import io
import tarfile

import fsspec
import numpy as np
import pytest

from kspeed.errors import AccessDeniedError, DatasetError
from kspeed.server.backend.shards import expand_braces, index_shards, sample_key
from kspeed.server.backend.sources import open_source


def write_shard(path, samples: list[tuple[str, bytes, int | None]]) -> None:
    """A WebDataset-style shard: per sample ``key.bin`` (and ``key.cls`` when a label is given)."""
    with tarfile.open(path, "w") as tar:
        for key, data, label in samples:
            members = [(f"{key}.bin", data)] + ([(f"{key}.cls", str(label).encode())] if label is not None else [])
            for name, body in members:
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))


def test_brace_patterns_expand_in_order():
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}/x-{8..10}.tar") == [
        "a/x-8.tar",
        "a/x-9.tar",
        "a/x-10.tar",
        "b/x-8.tar",
        "b/x-9.tar",
        "b/x-10.tar",
    ]
    assert expand_braces("plain.tar") == ["plain.tar"]
    with pytest.raises(ValueError, match="backwards"):
        expand_braces("s-{5..1}.tar")
    assert sample_key("train/000017.seg.png") == ("train/000017", "seg.png")


def test_members_group_by_key_the_first_non_label_is_the_sample_and_cls_its_label(tmp_path):
    rng = np.random.default_rng(0)
    samples = [(f"d/{k:04d}", rng.bytes(int(rng.integers(0, 3000))), k % 3) for k in range(20)]
    write_shard(tmp_path / "s-0.tar", samples[:12])
    write_shard(tmp_path / "s-1.tar", samples[12:])
    index = index_shards(fsspec.filesystem("file"), "ds", [str(tmp_path / "s-0.tar"), str(tmp_path / "s-1.tar")])
    assert index.shard_of.tolist() == [0] * 12 + [1] * 8 and index.labels.tolist() == [k % 3 for k in range(20)]
    assert index.keys[13] == "s-1.tar/d/0013.bin" and index.sizes.tolist() == [len(d) for _, d, _ in samples]
    for i, (_, data, _) in enumerate(samples):  # each sample is one ranged read
        with open(index.shards[index.shard_of[i]], "rb") as f:
            f.seek(int(index.offsets[i]))
            assert f.read(int(index.sizes[i])) == data


def test_a_source_of_shards_reads_every_sample_exactly_and_names_what_is_wrong(tmp_path, backend):
    samples = [(f"{k:03d}", bytes([k]) * (100 + k), k % 2) for k in range(30)]
    write_shard(tmp_path / "t-00.tar", samples[:15])
    write_shard(tmp_path / "t-01.tar", samples[15:])
    source = open_source(backend, "ds", str(tmp_path / "t-{00..01}.tar"))
    assert source.kind == "tar" and source.count == 30 and source.classes == ("0", "1")
    for i, (_, data, _) in enumerate(samples):
        assert source.read(i) == data
    out = np.zeros(1 << 16, np.uint8)
    offsets = np.cumsum([0] + [len(d) for _, d, _ in samples])[:-1].tolist()
    crcs, errors = source.read_run(list(range(30)), out, offsets, [len(d) for _, d, _ in samples])
    assert (
        not errors
        and all(crcs)
        and out[: offsets[-1] + len(samples[-1][1])].tobytes() == b"".join(d for _, d, _ in samples)
    )
    (tmp_path / "bad.tar").write_bytes(b"not a tar file at all" * 100)
    with pytest.raises(DatasetError, match="not an uncompressed tar"):
        open_source(backend, "ds", str(tmp_path / "bad.tar"))
    write_shard(tmp_path / "labels-only.tar", [("x", b"", None)])
    with tarfile.open(tmp_path / "labels-only.tar", "w") as tar:
        info = tarfile.TarInfo("x.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(DatasetError, match=r"no member besides its \.cls label"):
        open_source(backend, "ds", str(tmp_path / "labels-only.tar"))


def test_a_shard_that_goes_or_leads_outside_the_allow_list_is_named_for_each_of_its_samples(tmp_path, backend):
    samples = [(f"{k:03d}", bytes([k + 1]) * 50, None) for k in range(10)]
    write_shard(tmp_path / "u-0.tar", samples[:5])
    write_shard(tmp_path / "u-1.tar", samples[5:])
    source = open_source(backend, "ds", str(tmp_path / "u-{0..1}.tar"))
    (tmp_path / "u-1.tar").unlink()
    out = np.zeros(1000, np.uint8)
    crcs, errors = source.read_run(list(range(10)), out, [50 * k for k in range(10)], [50] * 10)
    assert all(crcs[:5]) and not any(crcs[5:])
    assert sorted(e.sample for e in errors) == list(range(5, 10)) and all("deleted" in str(e) for e in errors)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    write_shard(outside / "o.tar", samples[:2])
    (tmp_path / "linked.tar").symlink_to(outside / "o.tar")
    with pytest.raises(AccessDeniedError):
        open_source(backend, "ds", str(tmp_path / "linked.tar"))
