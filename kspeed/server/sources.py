"""Dataset sources: list a backend dataset into stable sample IDs and read single samples.

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

Zero-length samples are allowed everywhere: they occupy no bytes, have crc32c 0 and read back
as ``b""``. A sample whose size differs from the listing, an unreadable file and an ID outside
``0..N-1`` raise errors naming the dataset and the sample.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import posixpath
import re
from collections.abc import Sequence

import numpy as np
from numpy.lib import format as npy_format

from kspeed.errors import DatasetError, NotFoundError
from kspeed.server.backend import Backend

__all__ = ["SOURCE_KINDS", "Fingerprint", "Source", "open_source"]

log = logging.getLogger(__name__)

SOURCE_KINDS = ("dir", "list", "manifest", "npy")
_MAX_SIZE_DIGITS = 18
_DOTDOT = re.compile(rb"\.\.")


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What identifies a dataset's backend content, so a changed backend is noticed.

    Attributes:
        count: number of samples.
        total_bytes: sum of their sizes.
        digest: sha256 (hex) over the sizes and the mtimes or etags the backend reports.
    """

    count: int
    total_bytes: int
    digest: str

    def __str__(self) -> str:
        return f"{self.count} samples, {self.total_bytes} bytes, sha256 {self.digest[:16]}"


class _Keys:
    """Sample keys stored as one bytes blob plus start/end offsets (no Python object per key)."""

    def __init__(self, blob: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        self.blob, self.starts, self.ends = blob, starts.astype(np.int64), ends.astype(np.int64)

    @classmethod
    def from_strings(cls, keys: Sequence[str]) -> _Keys:
        encoded = [k.encode() for k in keys]
        lengths = np.fromiter((len(k) + 1 for k in encoded), dtype=np.int64, count=len(encoded))
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        return cls(b"\n".join(encoded), starts, starts + lengths - 1)

    def __getitem__(self, i: int) -> str:
        return self.blob[self.starts[i] : self.ends[i]].decode("utf-8", "replace")


class Source:
    """A listed dataset: sizes, labels, fingerprint, and per-sample reads.

    Obtain one with :func:`open_source`. Reads are thread-safe (each opens its own file).

    Attributes:
        dataset: the dataset's name (used in every error message).
        uri: the URI it was opened from.
        kind: one of :data:`SOURCE_KINDS`.
        sizes: int64 array of sample sizes in bytes, indexed by sample ID.
        labels: int64 array of class indices, or ``None``.
        classes: class names, label i being ``classes[i]``.
        fingerprint: see :class:`Fingerprint`.
    """

    def __init__(
        self, backend: Backend, dataset: str, uri: str, kind: str, root: str, protocol: str,
        sizes: np.ndarray, tags: bytes, *, keys: _Keys | None = None, row_offset: int = 0,
        labels: np.ndarray | None = None, classes: Sequence[str] = (),
    ) -> None:
        self.backend, self.dataset, self.uri, self.kind = backend, dataset, uri, kind
        self.root, self.protocol = root, protocol
        self.fs = backend.filesystem(protocol)
        self.sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        self.sizes.setflags(write=False)
        self.labels = labels
        self.classes = tuple(classes)
        self._keys = keys
        self._row_offset = row_offset
        h = hashlib.sha256(kind.encode() + b"\0" + self.sizes.tobytes() + b"\0" + tags)
        self.fingerprint = Fingerprint(len(self.sizes), int(self.sizes.sum()), h.hexdigest())

    @property
    def count(self) -> int:
        """Number of samples N."""
        return len(self.sizes)

    @property
    def total_bytes(self) -> int:
        """Sum of the sample sizes."""
        return self.fingerprint.total_bytes

    def key(self, sample_id: int) -> str:
        """The sample's key (relative path, list entry, or ``file[row]`` for ``npy``)."""
        self._check_id(sample_id)
        if self._keys is None:
            return f"{self.root}[{sample_id}]"
        return self._keys[sample_id]

    def path(self, sample_id: int) -> str:
        """The backend path holding the sample."""
        self._check_id(sample_id)
        if self.kind == "npy":
            return self.root
        key = self._keys[sample_id]
        if self.kind == "list":
            return key
        return posixpath.join(self.root, key) if self.root else key

    def read(self, sample_id: int) -> bytes:
        """The sample's bytes, read from the backend."""
        buf = bytearray(int(self.sizes[self._check_id(sample_id)]))
        self.read_into(sample_id, buf)
        return bytes(buf)

    def read_into(self, sample_id: int, buf: memoryview | bytearray | np.ndarray) -> int:
        """Read the sample into the start of ``buf`` (at least its size) and return its size.

        Raises:
            NotFoundError: ``sample_id`` is outside ``0..N-1``.
            AccessDeniedError: a local path now resolves outside the allow-list (e.g. a new symlink).
            BackendError: the backend cannot open or read the file.
            DatasetError: the sample's size differs from the listing.
        """
        i = self._check_id(sample_id)
        size = int(self.sizes[i])
        view = memoryview(buf).cast("B")
        if len(view) < size:
            raise DatasetError(
                f"dataset {self.dataset!r} sample {i}: buffer of {len(view)} bytes for a {size}-byte sample",
                dataset=self.dataset, sample=i,
            )
        path = self.path(i)
        local = self.backend.is_local(self.protocol)
        what = f"read {self.protocol}://{path}"
        with self.backend.errors(what, dataset=self.dataset, sample=i):
            # Plain local files skip fsspec's per-open overhead and read unbuffered straight into
            # ``buf``; other protocols (the throttled one included) go through their file system.
            plain = self.protocol == "file"
            with open(path, "rb", buffering=0) if plain else self.fs.open(path, "rb") as f:
                if local:
                    # The path the open descriptor really names: no symlink or '..' can escape, and
                    # no race between checking and opening.
                    real = os.readlink(f"/proc/self/fd/{f.fileno()}")
                    self.backend.allow.check_resolved(self.protocol, real, dataset=self.dataset, sample=i)
                if self.kind == "npy":
                    f.seek(self._row_offset + i * size)
                got = _read_full(f, view[:size])
                extra = b"" if self.kind == "npy" or got < size else f.read(1)
        if got != size or extra:
            found = f"more than {size}" if extra else str(got)
            raise DatasetError(
                f"dataset {self.dataset!r} sample {i} ({self.key(i)}): size changed since listing "
                f"({size} bytes listed, {found} bytes found); the backend changed: register the dataset "
                "again",
                dataset=self.dataset, sample=i,
            )
        return size

    def reopen(self) -> Source:
        """List the backend again (same URI and kind); compare fingerprints to notice a change."""
        return open_source(self.backend, self.dataset, self.uri, kind=self.kind)

    def check_fingerprint(self, expected: Fingerprint) -> None:
        """Raise DatasetError if this listing's fingerprint differs from ``expected``."""
        if self.fingerprint != expected:
            raise DatasetError(
                f"dataset {self.dataset!r}: backend {self.uri} changed: expected {expected}, "
                f"found {self.fingerprint}; register the dataset again",
                dataset=self.dataset,
            )

    def _check_id(self, sample_id: int) -> int:
        i = int(sample_id)
        if not 0 <= i < len(self.sizes):
            raise NotFoundError(
                f"dataset {self.dataset!r}: no sample {sample_id} (the dataset has {len(self.sizes)}, "
                f"IDs 0..{len(self.sizes) - 1})"
            )
        return i


def _read_full(f, view: memoryview) -> int:
    got = 0
    readinto = getattr(f, "readinto", None)
    while got < len(view):
        if readinto is not None:
            n = readinto(view[got:])
        else:
            chunk = f.read(len(view) - got)
            n = len(chunk)
            view[got : got + n] = chunk
        if not n:
            break
        got += n
    return got


def _tag(info: dict) -> str:
    for name in ("mtime", "ETag", "etag", "LastModified", "last_modified", "updated", "md5Hash"):
        if info.get(name) is not None:
            return f"{name}={info[name]}"
    return ""


def open_source(backend: Backend, dataset: str, uri: str, *, kind: str = "auto") -> Source:
    """List the dataset at ``uri`` and return its :class:`Source`.

    Args:
        backend: the server's backend (allow-list and storage options).
        dataset: the dataset's name, for messages.
        uri: a directory, list file, manifest file or ``.npy`` file.
        kind: one of :data:`SOURCE_KINDS`, or ``"auto"``: a directory is ``dir``, ``*.npy`` is
            ``npy``, a name ending in ``.manifest`` or ``.manifest.txt`` is ``manifest``, any
            other file is ``list``.

    Raises:
        AccessDeniedError: the URI or an entry lies outside the allow-list.
        BackendError: the backend cannot list or read it.
        DatasetError: the dataset is empty or malformed.
    """
    fs, root, protocol = backend.resolve(uri, dataset=dataset)
    with backend.errors(f"list {uri}", dataset=dataset):
        if kind == "auto":
            if fs.isdir(root):
                kind = "dir"
            elif root.endswith(".npy"):
                kind = "npy"
            elif root.endswith((".manifest", ".manifest.txt")):
                kind = "manifest"
            else:
                kind = "list"
        if kind not in SOURCE_KINDS:
            raise DatasetError(f"dataset {dataset!r}: unknown source kind {kind!r}; use {SOURCE_KINDS}",
                               dataset=dataset)
        source = {"dir": _open_dir, "list": _open_list, "manifest": _open_manifest, "npy": _open_npy}[kind](
            backend, dataset, uri, fs, root, protocol
        )
    if source.count == 0:
        raise DatasetError(f"dataset {dataset!r}: {uri} holds no samples", dataset=dataset)
    log.info("dataset %s: listed %s (%s): %s", dataset, uri, kind, source.fingerprint)
    return source


def _open_dir(backend, dataset, uri, fs, root, protocol) -> Source:
    entries = fs.find(root, detail=True, withdirs=False)
    prefix = root.rstrip("/") + "/"
    rel: list[tuple[str, int, str]] = []
    for name, info in entries.items():
        key = name[len(prefix) :] if name.startswith(prefix) else name
        if any(part.startswith(".") for part in key.split("/")):
            continue
        if info.get("islink"):
            backend.allow.check(f"{protocol}://{name}", dataset=dataset, sample=key)
        elif info.get("type") != "file":
            continue
        rel.append((key, int(info.get("size") or 0), _tag(info)))
    rel.sort()
    keys = [k for k, _, _ in rel]
    sizes = np.fromiter((s for _, s, _ in rel), dtype=np.int64, count=len(rel))
    tags = "\n".join(t for _, _, t in rel).encode()
    labels, classes = None, ()
    if keys and all("/" in k for k in keys):
        tops = [k.split("/", 1)[0] for k in keys]
        classes = tuple(sorted(set(tops)))
        lookup = {c: i for i, c in enumerate(classes)}
        labels = np.fromiter((lookup[t] for t in tops), dtype=np.int64, count=len(tops))
    return Source(backend, dataset, uri, "dir", root, protocol, sizes, tags,
                  keys=_Keys.from_strings(keys), labels=labels, classes=classes)


def _open_list(backend, dataset, uri, fs, root, protocol) -> Source:
    base = posixpath.dirname(root)
    text = fs.cat_file(root).decode("utf-8")
    paths, sizes, tags = [], [], []
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
                dataset=dataset, sample=f"line {lineno}",
            )
        with backend.errors(f"stat {line!r} (list line {lineno})", dataset=dataset, sample=len(paths)):
            info = fs.info(path)
        paths.append(path)
        sizes.append(int(info.get("size") or 0))
        tags.append(_tag(info))
    return Source(backend, dataset, uri, "list", base, protocol, np.asarray(sizes, dtype=np.int64),
                  "\n".join(tags).encode(), keys=_Keys.from_strings(paths))


def _open_manifest(backend, dataset, uri, fs, root, protocol) -> Source:
    data = fs.cat_file(root)
    starts, ends, sizes = _parse_manifest(data, dataset, uri)
    if _DOTDOT.search(data) or (len(starts) and (np.frombuffer(data, np.uint8)[starts] == ord("/")).any()):
        for i in np.flatnonzero(np.frombuffer(data, np.uint8)[starts] == ord("/")):
            _refuse_key(dataset, uri, data[starts[i] : ends[i]], "is absolute")
        for m in _DOTDOT.finditer(data):
            i = int(np.searchsorted(ends, m.start(), side="left"))
            if i < len(starts) and starts[i] <= m.start() < ends[i]:
                key = data[starts[i] : ends[i]]
                if b".." in key.split(b"/"):
                    _refuse_key(dataset, uri, key, "contains '..'")
    info = fs.info(root)
    base = posixpath.dirname(root)
    return Source(backend, dataset, uri, "manifest", base, protocol, sizes, _tag(info).encode(),
                  keys=_Keys(data, starts, ends))


def _refuse_key(dataset: str, uri: str, key: bytes, why: str) -> None:
    raise DatasetError(
        f"dataset {dataset!r}: manifest {uri}: key {key.decode('utf-8', 'replace')!r} {why}; manifest keys "
        "are relative to the manifest's directory",
        dataset=dataset, sample=key.decode("utf-8", "replace"),
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
            dataset=dataset, sample=f"line {lineno[i]}",
        )
    key_ends = sep.copy()
    while True:
        trailing = (key_ends > starts) & np.isin(arr[np.maximum(key_ends - 1, 0)], (ord(" "), ord("\t")))
        if not trailing.any():
            break
        key_ends -= trailing
    return starts, key_ends, sizes


def _open_npy(backend, dataset, uri, fs, root, protocol) -> Source:
    info = fs.info(root)
    with fs.open(root, "rb") as f:
        try:
            version = npy_format.read_magic(f)
            reader = npy_format.read_array_header_2_0
            if version == (1, 0):
                reader = npy_format.read_array_header_1_0
            shape, fortran, dtype = reader(f)
        except ValueError as exc:
            raise DatasetError(f"dataset {dataset!r}: {uri} is not a valid .npy file: {exc}",
                               dataset=dataset) from exc
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
    return Source(backend, dataset, uri, "npy", root, protocol, np.full(count, row, dtype=np.int64), tags,
                  row_offset=header)

