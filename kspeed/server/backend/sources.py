"""Dataset sources: a listed backend dataset with stable sample IDs, and reads of its samples.

:func:`open_source` lists a dataset (the kinds are described in :mod:`kspeed.server.backend.listing`)
into a :class:`Source`. Zero-length samples are allowed everywhere: they occupy no bytes, have
crc32c 0 and read back as ``b""``. A sample whose size differs from the listing, an unreadable
file and an ID outside ``0..N-1`` raise errors naming the dataset and the sample. Local files
are read through :class:`~kspeed.server.backend.localread.LocalReader` (no fsspec object per file); other
protocols through their fsspec file system.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import posixpath
import socket
from collections.abc import Iterator, Sequence

import fsspec
import numpy as np

from kspeed.errors import BackendError, ChangedError, DatasetError, NotFoundError
from kspeed.server.backend.access import Backend, failures
from kspeed.server.backend.changes import Change
from kspeed.server.backend.listing import SOURCE_KINDS, Keys, Listing, list_dataset, stamp
from kspeed.server.backend.localread import LocalReader, fd_path
from kspeed.server.backend.localtree import legacy_tags
from kspeed.server.memory.checksum import crc32c

__all__ = ["SOURCE_KINDS", "Fingerprint", "Source", "open_source", "source_of"]

log = logging.getLogger(__name__)


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
        row_offset: ``npy`` only: byte offset of row 0 in the file.
        stamps: per sample, the stamp of its file at listing (``None`` where the kind records none).
        file_stamp: ``npy``: the stamp of the one file at listing; ``manifest``: the manifest's.
        unwatchable: a local tree: the samples whose changes may not show as events on their folders.
    """

    def __init__(
        self,
        backend: Backend,
        dataset: str,
        uri: str,
        kind: str,
        root: str,
        protocol: str,
        sizes: np.ndarray,
        tags: bytes,
        *,
        keys: Keys | None = None,
        row_offset: int = 0,
        labels: np.ndarray | None = None,
        classes: Sequence[str] = (),
        stamps: np.ndarray | None = None,
        file_stamp: float = 0.0,
        shards: Sequence[str] = (),
        shard_of: np.ndarray | None = None,
        offsets: np.ndarray | None = None,
        dtype: str = "",
        row_shape: tuple[int, ...] = (),
        fingerprint: Fingerprint | None = None,
        unwatchable: np.ndarray | None = None,
    ) -> None:
        self.unwatchable = unwatchable
        self.backend, self.dataset, self.uri, self.kind = backend, dataset, uri, kind
        self.shards = tuple(shards)
        self.shard_of = shard_of
        self.offsets = offsets
        self.dtype, self.row_shape = dtype, tuple(row_shape)
        self.root, self.protocol = root, protocol
        self.fs = backend.filesystem(protocol)
        self.sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        self.sizes.setflags(write=False)
        self.labels = labels
        self.classes = tuple(classes)
        self._keys = keys
        self.row_offset = row_offset
        self.stamps = stamps
        self.file_stamp = file_stamp
        self._local = LocalReader(self) if protocol == "file" else None
        if fingerprint is None:
            h = hashlib.sha256(kind.encode() + b"\0" + self.sizes.tobytes() + b"\0" + tags)
            fingerprint = Fingerprint(len(self.sizes), int(self.sizes.sum()), h.hexdigest())
        self.fingerprint = fingerprint

    @property
    def keys(self) -> Keys | None:
        """The samples' keys as listed (``None`` for a single-file kind)."""
        return self._keys

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
        if self.shard_of is not None:
            return self.shards[int(self.shard_of[sample_id])]
        key = self.key(sample_id)
        if self.kind == "list":
            return key
        return posixpath.join(self.root, key) if self.root else key

    def where(self, path: str) -> str:
        """``path`` as a URI, for messages (an HTTP file system's paths are whole URLs already)."""
        return path if "://" in path else f"{self.protocol}://{path}"

    def paths(self, ids: Sequence[int]) -> list[str]:
        """The backend paths of owned, valid sample IDs (no ID check: for the preload's runs)."""
        if self._keys is None:
            return [self.root] * len(ids)
        idx = np.asarray(ids, dtype=np.int64)
        if self.shard_of is not None:
            return [self.shards[s] for s in self.shard_of[idx].tolist()]
        blob = self._keys.blob
        keys = [
            blob[a:b].decode("utf-8", "replace")
            for a, b in zip(self._keys.starts[idx].tolist(), self._keys.ends[idx].tolist(), strict=True)
        ]
        if self.kind == "list" or not self.root:
            return keys
        prefix = self.root.rstrip("/") + "/"
        return [prefix + k for k in keys]

    def shard_starts(self) -> np.ndarray:
        """``tar`` only: each shard's first sample ID, then the sample count (samples follow the shards)."""
        assert self.shard_of is not None
        firsts = np.searchsorted(self.shard_of, np.arange(len(self.shards)), side="left")
        return np.append(firsts, self.count).astype(np.int64)

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
        view = (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")
        if len(view) < size:
            raise DatasetError(
                f"dataset {self.dataset!r} sample {i}: buffer of {len(view)} bytes for a {size}-byte sample",
                dataset=self.dataset,
                sample=i,
            )
        if self._local is not None:
            _, errors = self._local.read_run([i], np.frombuffer(view, dtype=np.uint8), [0], [size], checksum=False)
            if errors:
                raise errors[0]
            return size
        path = self.path(i)
        what = f"read {self.where(path)}"
        try:
            return self._read_remote(i, path, what, view, size)
        except FileNotFoundError:
            raise self.changed_error(Change(i, path, "deleted")) from None

    def _read_remote(self, i: int, path: str, what: str, view: memoryview, size: int) -> int:
        with self._not_found_passes(what, i), self.fs.open(path, "rb") as f:
            if self.backend.is_local(self.protocol):
                # The path the open descriptor really names: no symlink or '..' can escape, and no
                # race between checking and opening.
                real = fd_path(f.fileno())
                self.backend.allow.check_resolved(self.protocol, real, dataset=self.dataset, sample=i)
            if self.kind == "npy":
                f.seek(self.row_offset + i * size)
            elif self.offsets is not None:
                f.seek(int(self.offsets[i]))
            got = _read_full(f, view[:size])
            extra = b"" if self.kind in ("npy", "tar") or got < size else f.read(1)
        if got != size or extra:
            raise self.size_changed(i, size, got + len(extra))
        return size

    @contextlib.contextmanager
    def _not_found_passes(self, what: str, sample: int) -> Iterator[None]:
        """:meth:`Backend.errors`, except that a missing file stays ``FileNotFoundError`` (a change)."""
        try:
            with self.backend.errors(what, dataset=self.dataset, sample=sample):
                yield
        except BackendError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise exc.__cause__ from None
            raise

    def read_run(
        self, ids: Sequence[int], out: np.ndarray, offsets: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[int], list[DatasetError]]:
        """Read valid sample IDs into ``out`` at ``offsets`` and checksum them, without raising.

        Local files take the lean path of :class:`~kspeed.server.backend.localread.LocalReader`; other
        protocols read sample by sample through their file system.

        Returns:
            The crc32c of each sample (0 for a failed one) and one error per failed sample, each
            naming the dataset and the sample.
        """
        if self._local is not None:
            return self._local.read_run(ids, out, offsets, sizes)
        crcs = [0] * len(ids)
        errors: list[DatasetError] = []
        dsts = [out[offsets[j] : offsets[j] + sizes[j]] for j in range(len(ids))]
        # Remote stores: one ranged request per sample, the run's all in one call (an async file
        # system such as s3fs or HTTP has them in flight at once). Local paths are opened one by
        # one, each checked against the allow-list by the path its descriptor names.
        ranged = [] if self.backend.is_local(self.protocol) else [j for j in range(len(ids)) if sizes[j] > 0]
        ranged_errors = dict(zip(ranged, self._read_ranges([ids[j] for j in ranged], [dsts[j] for j in ranged])))
        for j, i in enumerate(ids):
            try:
                if j in ranged_errors:
                    error = ranged_errors[j]
                    if error is not None:
                        raise error
                else:
                    self.read_into(i, dsts[j])
            except DatasetError as exc:
                errors.append(exc)
                continue
            crcs[j] = crc32c(dsts[j])
        return crcs, errors

    def _read_ranges(self, ids: Sequence[int], dsts: Sequence[np.ndarray]) -> list[DatasetError | None]:
        """Read samples of a remote store into ``dsts`` with one ``cat_ranges`` call: per sample,
        ``None`` or the error that names it. A whole-file sample asks for one byte more than it
        holds, so that a file that grew is noticed as one that shrank is."""
        if not len(ids):
            return []
        paths = self.paths(ids)
        starts: list[int] = []
        ends: list[int] = []
        for i, dst in zip(ids, dsts, strict=True):
            size = len(dst)
            if self.kind == "npy":
                start, end = self.row_offset + int(i) * size, self.row_offset + (int(i) + 1) * size
            elif self.offsets is not None:
                start = int(self.offsets[i])
                end = start + size
            else:
                start, end = 0, size + 1
            starts.append(start)
            ends.append(end)
        try:
            got = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        except failures() as exc:  # the whole call failed: each sample with it
            got = [exc] * len(paths)
        out: list[DatasetError | None] = []
        for i, path, dst, data in zip(ids, paths, dsts, got, strict=True):
            size = len(dst)
            if isinstance(data, FileNotFoundError):
                out.append(self.changed_error(Change(int(i), path, "deleted")))
            elif isinstance(data, BaseException):
                out.append(self.backend.error(data, f"read {self.where(path)}", dataset=self.dataset, sample=i))
            elif len(data) != size:
                out.append(self.size_changed(int(i), size, len(data)))
            else:
                dst[:] = np.frombuffer(data, np.uint8, size)
                out.append(None)
        return out

    def size_changed(self, sample_id: int, listed: int, found: int) -> ChangedError:
        """The error for a sample whose backend size (``found``) differs from the ``listed`` one."""
        shown = f"more than {listed}" if found > listed else str(found)
        return self.changed_error(Change(sample_id, self.key(sample_id), f"size {listed} -> {shown} bytes"))

    def check(self, ids: Sequence[int] | np.ndarray) -> list[Change]:
        """Compare the backend files of ``ids`` with the listing: size, and stamp where one was listed.

        A missing file is a change ("deleted"). For ``npy`` the one file is compared once and every
        asked sample changes with it.

        Raises:
            BackendError: the backend cannot tell (unreachable, refused): nothing is known changed.
        """
        ids = [int(i) for i in ids]
        if not ids:
            return []
        if self.kind == "npy":
            what = self._differs(self.root, self.row_offset + int(self.sizes.sum()), self.file_stamp, exact=False)
            return [Change(i, f"{self.root}[{i}]", what) for i in ids] if what else []
        if self.shard_of is not None and self.offsets is not None and self.stamps is not None:
            # a shard is compared once; every asked sample of a changed shard changed with it
            asked = np.asarray(ids, dtype=np.int64)
            found = []
            for shard in np.unique(self.shard_of[asked]).tolist():
                mine = asked[self.shard_of[asked] == shard]
                end = int((self.offsets[mine] + self.sizes[mine]).max())
                first = int(mine[0])
                what = self._differs(self.shards[shard], end, float(self.stamps[first]), exact=False)
                found += (
                    [Change(int(i), f"{self.shards[shard]}:{self.key(int(i))}", what) for i in mine] if what else []
                )
            return found
        if self._local is not None:
            return self._stat_files(ids)
        changes = []
        for i, path in zip(ids, self.paths(ids), strict=True):
            listed = None if self.stamps is None else float(self.stamps[i])
            what = self._differs(path, int(self.sizes[i]), listed, exact=True)
            if what:
                changes.append(Change(i, path, what))
        return changes

    def _stat_files(self, ids: list[int]) -> list[Change]:
        """:meth:`check` of local files: one ``stat`` each (no file system object per file)."""
        changes = []
        sizes = self.sizes[ids].tolist()
        stamps = self.stamps[ids].tolist() if self.stamps is not None else [None] * len(ids)
        for i, path, size, listed in zip(ids, self.paths(ids), sizes, stamps, strict=True):
            try:
                found = os.stat(path)
            except FileNotFoundError:
                changes.append(Change(i, path, "deleted"))
                continue
            except OSError as exc:
                raise self.backend.error(exc, f"stat {self.where(path)}", dataset=self.dataset, sample=i) from exc
            if found.st_size != size:
                changes.append(Change(i, path, f"size {size} -> {found.st_size} bytes"))
            elif listed is not None and found.st_mtime != listed:
                changes.append(Change(i, path, "modified (a new mtime or etag)"))
        return changes

    def verify(self, ids: np.ndarray) -> list[Change]:
        """Compare the samples ``ids`` with the backend as a job's attach does: in the cheapest way
        that still notices a listed file rewritten, resized or removed.

        * a local tree or list file: one ``stat`` per file (:meth:`check`);
        * a tree on another file system (an object store): one listing of it, paged by the store,
          whose fingerprint (sizes and etags) is compared with this one; only when it differs are
          the files of ``ids`` compared one by one, to name the changes;
        * a manifest: the manifest file's stamp; only when it changed are the files of ``ids``
          compared (by size: a manifest records no stamps, so a sample file rewritten in place at
          the same size under an unchanged manifest is not noticed, here or when it is read);
        * ``.npy`` and tar shards: one ``stat`` of each file that holds them (:meth:`check`).

        Raises:
            BackendError: the backend cannot tell (unreachable, refused): nothing is known changed.
        """
        if self.kind == "manifest":
            path = self.backend.resolve(self.uri, dataset=self.dataset)[1]
            if not self._differs(path, -1, self.file_stamp, exact=False):
                return []
        elif self.kind == "dir" and self._local is None:
            with self.backend.errors(f"list {self.uri}", dataset=self.dataset):
                if self.reopen().fingerprint == self.fingerprint:
                    return []
        return self.check(ids)

    def _differs(self, path: str, size: int, listed: float | None, *, exact: bool) -> str:
        """What differs between ``path`` now and its listing ("" when nothing)."""
        with self.backend.errors(f"stat {self.where(path)}", dataset=self.dataset):
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return "deleted"
        found = int(info.get("size") or 0)
        if (found != size) if exact else (found < size):
            return f"size {size} -> {found} bytes"
        if listed is not None and stamp(info) != listed:
            return "modified (a new mtime or etag)"
        return ""

    def changed_error(self, change: Change) -> ChangedError:
        """The error of a read that met a changed file."""
        return ChangedError(
            f"dataset {self.dataset!r} {change} after it was listed; register the dataset again",
            dataset=self.dataset,
            sample=change.sample,
            path=change.path,
            what=change.what,
        )

    def reopen(self) -> Source:
        """List the backend again (same URI and kind); compare fingerprints to notice a change."""
        return open_source(self.backend, self.dataset, self.uri, kind=self.kind)

    def legacy_digest(self) -> str:
        """A local tree's fingerprint digest as listings made it before its tags were its stamps'
        bytes (:func:`~kspeed.server.backend.localtree.legacy_tags`), to recognise a dataset
        registered then; ``""`` for any other listing."""
        if self.kind != "dir" or self._local is None or self.stamps is None:
            return ""
        tags = legacy_tags(self.stamps)
        return hashlib.sha256(self.kind.encode() + b"\0" + self.sizes.tobytes() + b"\0" + tags).hexdigest()

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


def open_source(backend: Backend, dataset: str, uri: str, *, kind: str = "auto") -> Source:
    """List the dataset at ``uri`` and return its :class:`Source`.

    Args:
        backend: the server's backend (allow-list and storage options).
        dataset: the dataset's name, for messages.
        uri: a directory, list file, manifest file or ``.npy`` file.
        kind: one of :data:`SOURCE_KINDS`, or ``"auto"``: a ``*.tar`` or a brace pattern is
            ``tar``, a directory is ``dir``, ``*.npy`` is
            ``npy``, a name ending in ``.manifest`` or ``.manifest.txt`` is ``manifest``, any
            other file is ``list``.

    Raises:
        AccessDeniedError: the URI or an entry lies outside the allow-list.
        BackendError: the backend cannot list or read it.
        DatasetError: the dataset is empty or malformed.
    """
    fs, root, protocol = backend.resolve(uri, dataset=dataset)
    try:
        found = _list(backend, dataset, uri, fs, root, protocol, kind)
    except BackendError as exc:
        if backend.is_local(protocol) and isinstance(exc.__cause__, FileNotFoundError) and not fs.exists(root):
            raise BackendError(f"{exc}; {_not_here(root)}", dataset=dataset) from exc.__cause__
        raise
    source = source_of(backend, dataset, uri, protocol, found)
    if source.count == 0:
        hint = f"; {_not_here(root)}" if backend.is_local(protocol) else ""
        raise DatasetError(f"dataset {dataset!r}: {uri} holds no samples{hint}", dataset=dataset)
    log.info("dataset %s: listed %s (%s): %s", dataset, uri, found.kind, source.fingerprint)
    return source


def source_of(
    backend: Backend, dataset: str, uri: str, protocol: str, found: Listing, fingerprint: Fingerprint | None = None
) -> Source:
    """The :class:`Source` of a listing of ``uri`` (``fingerprint``: as its lister computed it, for a
    listing fetched from another server; by default computed from the listing's sizes and tags)."""
    return Source(
        backend,
        dataset,
        uri,
        found.kind,
        found.root,
        protocol,
        found.sizes,
        found.tags,
        keys=found.keys,
        row_offset=found.row_offset,
        labels=found.labels,
        classes=found.classes,
        stamps=found.stamps,
        file_stamp=found.file_stamp,
        shards=found.shards,
        shard_of=found.shard_of,
        offsets=found.offsets,
        dtype=found.dtype,
        row_shape=found.row_shape,
        fingerprint=fingerprint,
        unwatchable=found.unwatchable,
    )


def _not_here(root: str) -> str:
    """What to do about a local dataset path this server cannot see (or sees empty)."""
    return (
        f"the servers read a dataset themselves, so {root} must hold it on each of them (a shared file system, or "
        f"a copy at the same path), not only where the client runs (this server's host: {socket.gethostname()})"
    )


def _list(
    backend: Backend, dataset: str, uri: str, fs: fsspec.AbstractFileSystem, root: str, protocol: str, kind: str
) -> Listing:
    """The listing of ``uri`` of ``kind`` (``auto``: guessed from the path), backend errors converted."""
    with backend.errors(f"list {uri}", dataset=dataset):
        if kind == "auto":
            if "{" in root or root.endswith(".tar"):
                kind = "tar"
            elif fs.isdir(root):
                kind = "dir"
            elif root.endswith(".npy"):
                kind = "npy"
            elif root.endswith((".manifest", ".manifest.txt")):
                kind = "manifest"
            else:
                kind = "list"
        return list_dataset(backend, dataset, uri, fs, root, protocol, kind)
