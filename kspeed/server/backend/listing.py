"""Listing a backend dataset: stable sample IDs, sizes, keys and labels, without reading samples.

Four kinds, all giving sample IDs ``0..N-1`` and per-sample sizes as an int64 array:

* ``dir``: a directory tree, listed recursively; IDs follow the sorted relative keys; hidden
  files (any component starting with ``.``) are skipped. When every file lies in a subdirectory,
  labels follow the first directory under the root (the ImageFolder convention), classes being
  those names in sorted order; otherwise there are no labels.
* ``list``: a text file with one path per line, relative to the list file's directory or
  absolute; IDs follow the line order; each path is checked against the allow-list.
* ``manifest``: one ``key size`` line per sample (keys relative to the manifest's directory), for
  millions of keys without listing; IDs follow the line order. Sizes are trusted at listing and
  verified when the sample is read. Parsed with numpy, no Python object per line.
* ``npy``: one ``.npy`` array of fixed-size samples, sample i = row i; only the header is read.
  Samples arrive as the rows' raw bytes; the dataset's dtype and row shape are in its listing
  (``Source.dtype``, ``Source.row_shape``).
* ``tar``: WebDataset-style tar shards (:mod:`kspeed.server.backend.shards`): a shard, a brace pattern of
  shards or a directory of them; a sample is one member's bytes, read by one ranged read; IDs
  follow the shards' order, then tar order; labels (``cls``) from each sample's ``.cls`` member.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import numpy as np
from numpy.lib import format as npy_format

from kspeed.errors import DatasetError
from kspeed.server.backend.access import URL_PROTOCOLS, Backend
from kspeed.server.backend.localtree import walk_tree
from kspeed.server.backend.shards import expand_braces, index_shards

__all__ = ["SOURCE_KINDS", "Keys", "Listing", "list_dataset", "stamp"]

SOURCE_KINDS = ("dir", "list", "manifest", "npy", "tar")
_MAX_SIZE_DIGITS = 18
_DOTDOT = re.compile(rb"\.\.")


class Keys:
    """Sample keys stored as one bytes blob plus start/end offsets (no Python object per key)."""

    def __init__(self, blob: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        self.blob, self.starts, self.ends = blob, starts.astype(np.int64), ends.astype(np.int64)

    @classmethod
    def from_strings(cls, keys: Sequence[str]) -> Keys:
        encoded = [k.encode() for k in keys]
        lengths = np.fromiter((len(k) + 1 for k in encoded), dtype=np.int64, count=len(encoded))
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        return cls(b"\n".join(encoded), starts, starts + lengths - 1)

    def __getitem__(self, i: int) -> str:
        return self.blob[self.starts[i] : self.ends[i]].decode("utf-8", "replace")


@dataclasses.dataclass(frozen=True)
class Listing:
    """What listing a dataset found.

    Attributes:
        kind: one of :data:`SOURCE_KINDS`.
        root: the directory keys are relative to (``dir``, ``manifest``), the list file's
            directory (``list``, whose keys are full paths) or the ``.npy`` file itself.
        sizes: int64 sample sizes, indexed by sample ID.
        tags: the mtimes or etags the backend reported, for the fingerprint.
        keys: sample keys (``None`` for ``npy``).
        row_offset: ``npy`` only: byte offset of row 0 (the header's length).
        labels: int64 class index per sample, or ``None``.
        classes: class names, label i being ``classes[i]``.
        stamps: per sample, the :func:`stamp` of its file (``dir`` and ``list``; ``None`` for
            ``manifest``, whose sizes are all it records, and ``npy``).
        file_stamp: ``npy``: the :func:`stamp` of the one file; ``manifest``: the manifest's.
        shards: ``tar`` only: the shard paths, in order.
        shard_of: ``tar`` only: each sample's shard (index into ``shards``).
        offsets: ``tar`` only: the byte offset of each sample's member data in its shard.
        dtype: ``npy`` only: the array's dtype (``numpy.dtype.str``).
        row_shape: ``npy`` only: the shape of one row (one sample).
        unwatchable: a local ``dir`` only: the sorted IDs of samples that are symbolic links or
            have several hard links (:mod:`kspeed.server.backend.tree_watch`).
    """

    kind: str
    root: str
    sizes: np.ndarray
    tags: bytes
    keys: Keys | None = None
    row_offset: int = 0
    labels: np.ndarray | None = None
    classes: Sequence[str] = ()
    stamps: np.ndarray | None = None
    file_stamp: float = 0.0
    shards: tuple[str, ...] = ()
    shard_of: np.ndarray | None = None
    offsets: np.ndarray | None = None
    dtype: str = ""
    row_shape: tuple[int, ...] = ()
    unwatchable: np.ndarray | None = None


def list_dataset(
    backend: Backend, dataset: str, uri: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str, kind: str
) -> Listing:
    """List the dataset of ``kind`` (one of :data:`SOURCE_KINDS`) at ``root`` on ``fs``.

    Raises:
        DatasetError: the kind is unknown or the listing is malformed.
        AccessDeniedError: an entry lies outside the allow-list.
    """
    openers = {"dir": _open_dir, "list": _open_list, "manifest": _open_manifest, "npy": _open_npy, "tar": _open_tar}
    if kind not in openers:
        raise DatasetError(f"dataset {dataset!r}: unknown source kind {kind!r}; use {SOURCE_KINDS}", dataset=dataset)
    return openers[kind](backend, dataset, uri, fs, root, protocol)


def _tag(info: dict) -> str:
    for name in ("mtime", "ETag", "etag", "LastModified", "last_modified", "updated", "md5Hash"):
        if info.get(name) is not None:
            return f"{name}={info[name]}"
    return ""


def stamp(info: Mapping[str, Any]) -> float:
    """A file's version as one float: its mtime where the backend reports one, else a hash of its etag.

    A local file's stamp is its ``st_mtime`` exactly (so an ``fstat`` of an open file can be
    compared with it); another backend's is a 48-bit hash of the tag it reports (exact in a float).
    """
    mtime = info.get("mtime")
    if isinstance(mtime, (int, float)):
        return float(mtime)
    digest = hashlib.blake2b(_tag(dict(info)).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))


def _open_dir(
    backend: Backend, dataset: str, uri: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str
) -> Listing:
    if backend.is_local(protocol):
        return _open_local_dir(backend, dataset, root, protocol)
    return _open_fs_dir(backend, dataset, fs, root, protocol)


def _open_fs_dir(backend: Backend, dataset: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str) -> Listing:
    """A tree of any file system, through fsspec's ``find`` (a local one has a faster path)."""
    entries = fs.find(root, detail=True, withdirs=False)
    prefix = root.rstrip("/") + "/"
    rel: list[tuple[str, int, str, float]] = []
    for name, info in entries.items():
        key = name[len(prefix) :] if name.startswith(prefix) else name
        if any(part.startswith(".") for part in key.split("/")):
            continue
        if protocol in URL_PROTOCOLS:  # a page's links may lead anywhere: each must lie under the allow-list
            backend.allow.check(name, dataset=dataset, sample=key)
        if info.get("islink"):
            backend.allow.check(f"{protocol}://{name}", dataset=dataset, sample=key)
        elif info.get("type") != "file":
            continue
        version = stamp(info)
        if info.get("islink") and backend.is_local(protocol):
            version = os.stat(
                name
            ).st_mtime  # the target's, as a read of the file sees it (the listing gives the link's)
        rel.append((key, int(info.get("size") or 0), _tag(info), version))
    rel.sort()
    keys = [k for k, _, _, _ in rel]
    sizes = np.fromiter((s for _, s, _, _ in rel), dtype=np.int64, count=len(rel))
    tags = "\n".join(t for _, _, t, _ in rel).encode()
    stamps = np.fromiter((s for _, _, _, s in rel), dtype=np.float64, count=len(rel))
    labels: np.ndarray | None = None
    classes: tuple[str, ...] = ()
    if keys and all("/" in k for k in keys):
        tops = [k.split("/", 1)[0] for k in keys]
        classes = tuple(sorted(set(tops)))
        lookup = {c: i for i, c in enumerate(classes)}
        labels = np.fromiter((lookup[t] for t in tops), dtype=np.int64, count=len(tops))
    return Listing(
        "dir", root, sizes, tags, keys=Keys.from_strings(keys), labels=labels, classes=classes, stamps=stamps
    )


def _open_local_dir(backend: Backend, dataset: str, root: str, protocol: str) -> Listing:
    """A local tree, walked with ``os.scandir`` (:mod:`kspeed.server.backend.localtree`)."""

    def check_link(path: str, key: str) -> None:
        backend.allow.check(f"{protocol}://{path}", dataset=dataset, sample=key)

    tree = walk_tree(root, check_link)
    return Listing(
        "dir",
        root,
        tree.sizes,
        tree.tags,
        keys=Keys(tree.blob, tree.starts, tree.ends),
        labels=tree.labels,
        classes=tree.classes,
        stamps=tree.stamps,
        unwatchable=tree.unwatchable,
    )


def _open_list(
    backend: Backend, dataset: str, uri: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str
) -> Listing:
    base = posixpath.dirname(root)
    text = fs.cat_file(root).decode("utf-8")
    paths: list[str] = []
    sizes: list[int] = []
    tags: list[str] = []
    stamps: list[float] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        entry = line if line.startswith("/") or "://" in line else posixpath.join(base, line)
        entry_protocol, path = backend.allow.check(
            entry if "://" in entry else f"{protocol}://{entry}", dataset=dataset, sample=f"line {lineno}"
        )
        both_local = backend.is_local(entry_protocol) and backend.is_local(protocol)
        if entry_protocol != protocol and not both_local:
            raise DatasetError(
                f"dataset {dataset!r}: list {uri} line {lineno}: {line!r} is on {entry_protocol}, the list "
                f"on {protocol}; a list file names paths of its own backend",
                dataset=dataset,
                sample=f"line {lineno}",
            )
        with backend.errors(f"stat {line!r} (list line {lineno})", dataset=dataset, sample=len(paths)):
            info = fs.info(path)
        paths.append(path)
        sizes.append(int(info.get("size") or 0))
        tags.append(_tag(info))
        stamps.append(stamp(info))
    return Listing(
        "list",
        base,
        np.asarray(sizes, dtype=np.int64),
        "\n".join(tags).encode(),
        keys=Keys.from_strings(paths),
        stamps=np.asarray(stamps, dtype=np.float64),
    )


def _open_manifest(
    backend: Backend, dataset: str, uri: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str
) -> Listing:
    data = fs.cat_file(root)
    starts, ends, sizes = _parse_manifest(data, dataset, uri)
    if _DOTDOT.search(data) or (len(starts) and (np.frombuffer(data, np.uint8)[starts] == ord("/")).any()):
        for i in np.flatnonzero(np.frombuffer(data, np.uint8)[starts] == ord("/")):
            _refuse_key(dataset, uri, data[starts[i] : ends[i]], "is absolute")
        for m in _DOTDOT.finditer(data):
            k = int(np.searchsorted(ends, m.start(), side="left"))
            if k < len(starts) and starts[k] <= m.start() < ends[k]:
                key = data[starts[k] : ends[k]]
                if b".." in key.split(b"/"):
                    _refuse_key(dataset, uri, key, "contains '..'")
    info = fs.info(root)
    base = posixpath.dirname(root)
    return Listing("manifest", base, sizes, _tag(info).encode(), keys=Keys(data, starts, ends), file_stamp=stamp(info))


def _refuse_key(dataset: str, uri: str, key: bytes, why: str) -> None:
    raise DatasetError(
        f"dataset {dataset!r}: manifest {uri}: key {key.decode('utf-8', 'replace')!r} {why}; manifest keys "
        "are relative to the manifest's directory",
        dataset=dataset,
        sample=key.decode("utf-8", "replace"),
    )


def _parse_manifest(data: bytes, dataset: str, uri: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse ``key size`` lines; returns key start/end offsets into ``data`` and the sizes."""
    arr = np.frombuffer(data, dtype=np.uint8)
    if not len(arr):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    nl = np.flatnonzero(arr == ord("\n"))
    starts = np.concatenate(([0], nl + 1)).astype(np.int64)
    ends = np.concatenate((nl, [len(arr)])).astype(np.int64)
    ends -= (ends > starts) & (arr[np.maximum(ends - 1, 0)] == ord("\r"))
    lineno = np.arange(1, len(starts) + 1)
    keep = (ends > starts) & (arr[np.minimum(starts, len(arr) - 1)] != ord("#"))
    starts, ends, lineno = starts[keep], ends[keep], lineno[keep]
    spaces = np.flatnonzero((arr == ord(" ")) | (arr == ord("\t")))
    pos = np.searchsorted(spaces, ends, side="left") - 1
    sep = np.where(pos >= 0, spaces[np.maximum(pos, 0)] if len(spaces) else -1, -1)
    ndig = ends - sep - 1
    bad = (sep <= starts) | (ndig < 1) | (ndig > _MAX_SIZE_DIGITS)
    sizes = np.zeros(len(starts), dtype=np.int64)
    for j in range(int(ndig[~bad].max()) if (~bad).any() else 0):
        col = ends - ndig + j
        use = (j < ndig) & ~bad
        digit = arr[np.where(use, col, 0)].astype(np.int64) - ord("0")
        bad |= use & ((digit < 0) | (digit > 9))
        sizes = np.where(use, sizes * 10 + digit, sizes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        line = data[starts[i] : ends[i]].decode("utf-8", "replace")
        raise DatasetError(
            f"dataset {dataset!r}: manifest {uri} line {lineno[i]}: {line[:200]!r} is not 'key size' "
            f"({int(bad.sum())} bad lines)",
            dataset=dataset,
            sample=f"line {lineno[i]}",
        )
    key_ends = sep.copy()
    while True:
        trailing = (key_ends > starts) & np.isin(arr[np.maximum(key_ends - 1, 0)], (ord(" "), ord("\t")))
        if not trailing.any():
            break
        key_ends -= trailing
    return starts, key_ends, sizes


def _open_npy(
    backend: Backend, dataset: str, uri: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str
) -> Listing:
    info = fs.info(root)
    with fs.open(root, "rb") as f:
        try:
            version = npy_format.read_magic(f)
            reader = npy_format.read_array_header_2_0
            if version == (1, 0):
                reader = npy_format.read_array_header_1_0
            shape, fortran, dtype = reader(f)
        except ValueError as exc:
            raise DatasetError(f"dataset {dataset!r}: {uri} is not a valid .npy file: {exc}", dataset=dataset) from exc
        header = f.tell()
    if not shape or dtype.hasobject or (fortran and len(shape) > 1):
        raise DatasetError(
            f"dataset {dataset!r}: {uri}: need a C-ordered, non-object array of at least one dimension "
            f"(shape {shape}, dtype {dtype}, fortran_order {fortran})",
            dataset=dataset,
        )
    row = int(dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    count = int(shape[0])
    size = int(info.get("size") or 0)
    if size < header + count * row:
        raise DatasetError(
            f"dataset {dataset!r}: {uri} is truncated: {size} bytes, header says {header + count * row}",
            dataset=dataset,
        )
    tags = f"{_tag(info)} shape={shape} dtype={dtype.str} size={size}".encode()
    return Listing(
        "npy",
        root,
        np.full(count, row, dtype=np.int64),
        tags,
        row_offset=header,
        file_stamp=stamp(info),
        dtype=dtype.str,
        row_shape=tuple(int(d) for d in shape[1:]),
    )


def _open_tar(
    backend: Backend, dataset: str, uri: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str
) -> Listing:
    if "{" in root:
        try:
            shards = expand_braces(root)
        except ValueError as exc:
            raise DatasetError(f"dataset {dataset!r}: {uri}: {exc}", dataset=dataset) from None
    elif fs.isdir(root):
        shards = sorted(p for p in fs.find(root, withdirs=False) if p.endswith(".tar"))
    else:
        shards = [root]
    for shard in shards:  # every shard lies under the allow-list too (a local one resolved: no symlink out)
        backend.allow.check(shard if "://" in shard else f"{protocol}://{shard}", dataset=dataset, sample=shard)
    infos = [fs.info(shard) for shard in shards]
    index = index_shards(fs, dataset, shards)
    shard_stamps = np.array([stamp(info) for info in infos], dtype=np.float64)
    tags = (
        "\n".join(f"{s} {_tag(info)}" for s, info in zip(shards, infos, strict=True)).encode() + index.offsets.tobytes()
    )
    labels = index.labels
    classes = tuple(str(k) for k in range(int(labels.max()) + 1)) if labels is not None and len(labels) else ()
    return Listing(
        "tar",
        root,
        index.sizes,
        tags,
        keys=Keys.from_strings(index.keys),
        labels=labels,
        classes=classes,
        stamps=shard_stamps[index.shard_of] if len(index.shard_of) else np.zeros(0),
        shards=index.shards,
        shard_of=index.shard_of,
        offsets=index.offsets,
    )
