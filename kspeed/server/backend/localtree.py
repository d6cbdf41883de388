"""Listing a local directory tree at the file system's speed: one ``stat`` per file, in C where it can.

A general file system listing (fsspec's ``find(detail=True)``) builds a dictionary of a dozen
fields per file; a dataset needs three (key, size, mtime). :func:`walk_tree` lists the root's own
files with ``os.scandir``, and the folders under it with GNU ``find``, several processes at once
(:mod:`kspeed.server.backend.findwalk`), or, where GNU ``find`` is not installed or fails, with
``os.scandir`` and one ``stat`` per file in this process. It sorts once and returns numpy arrays
and one bytes blob of keys: nothing per sample outlives the call. What it finds is what fsspec's
listing finds, so a dataset's sample IDs do not depend on which path listed it:

* files in sorted order of their relative keys (byte order of their UTF-8 names, which is ``str``
  order);
* hidden entries (a name starting with ``.``) and what lies under them skipped;
* a symbolic link is not followed into a directory; a link to a file is a sample whose size and
  stamp are its target's, and whose path must lie under the allow-list (``check_link``);
* labels by the first directory under the root when every file lies in one (ImageFolder's
  convention).

The fingerprint's tags of a local tree are its stamps' bytes (``TAGS_PREFIX``); before, they were
one ``mtime=<repr>`` line per file as fsspec reported it, which took as long to format as a ``stat``
(:func:`legacy_tags` rebuilds them, to recognise a dataset registered with them).
"""

from __future__ import annotations

import bisect
import os
import stat as stat_module
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kspeed.server.backend.findwalk import find_files

__all__ = ["TAGS_PREFIX", "Tree", "legacy_tags", "walk_tree"]

TAGS_PREFIX = b"stamps\0"


@dataclass(frozen=True)
class Tree:
    """What :func:`walk_tree` found, sorted by key.

    Attributes:
        blob: the keys, ``\\n``-separated, UTF-8.
        starts: int64 offset of each key in ``blob``.
        ends: int64 end of each key in ``blob``.
        sizes: int64 size of each file.
        stamps: float64 mtime of each file (a link's target's).
        tags: the fingerprint's tags (:data:`TAGS_PREFIX` and the stamps' bytes).
        labels: int32 class index per file (its first directory under the root), or ``None``.
        classes: the class names in sorted order.
        unwatchable: int64 IDs, sorted, of the files that are symbolic links or have several hard
            links (a change to them may come through another folder).
    """

    blob: bytes
    starts: np.ndarray
    ends: np.ndarray
    sizes: np.ndarray
    stamps: np.ndarray
    tags: bytes
    labels: np.ndarray | None
    classes: tuple[str, ...]
    unwatchable: np.ndarray


def legacy_tags(stamps: np.ndarray) -> bytes:
    """The fingerprint's tags of a local tree as they were made before :data:`TAGS_PREFIX`."""
    return "\n".join(map("mtime={}".format, stamps.tolist())).encode()


@dataclass
class _Files:
    """Files found, in the order found: keys relative to the root, and their first folder."""

    keys: list[bytes] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    linked: list[int] = field(default_factory=list)  # indexes (in keys) of links and multiply linked files


def walk_tree(root: str, check_link: Callable[[str, str], None], *, processes: int | None = None) -> Tree:
    """List every file under ``root`` (see the module docstring).

    Args:
        root: an absolute local directory.
        check_link: called with ``(path, key)`` for every symbolic link met; raises to refuse it
            (a link out of the allow-list).
        processes: ``find`` processes at once (default: the cores this process may use).

    Raises:
        OSError: a directory cannot be read or a file vanished while it was listed.
    """
    top = _Files()
    folders: list[tuple[str, str]] = []  # (path, name) of the root's folders
    _scan(root, "", check_link, top, folders)
    names = [name for _, name in folders]
    workers = processes or len(os.sched_getaffinity(0))
    try:
        found = find_files(root, names, workers) if names else None
    except OSError:
        found = None  # walked here instead: a real error is raised again, by the walk
    if found is None:
        below = _Files()
        pending = [(path, name + "/") for path, name in folders]
        while pending:
            path, prefix = pending.pop()
            more: list[tuple[str, str]] = []
            _scan(path, prefix, check_link, below, more)
            pending.extend((p, prefix + n + "/") for p, n in more)
        return _tree(
            top,
            below.keys,
            np.asarray(below.sizes, dtype=np.int64),
            np.asarray(below.stamps, dtype=np.float64),
            below.linked,
            names,
        )
    sizes, stamps = found.sizes, found.stamps
    keep = np.ones(len(found.keys), dtype=bool)
    for i in found.links.tolist():  # few: resolved here, as the walk would
        key = found.keys[i].decode("utf-8", "surrogateescape")
        path = os.path.join(root, key)
        check_link(path, key)
        target = os.stat(path)
        if stat_module.S_ISDIR(target.st_mode):
            keep[i] = False
            continue
        sizes[i], stamps[i] = target.st_size, target.st_mtime
        found.linked[i] = True
    keys = [k for k, kept in zip(found.keys, keep.tolist(), strict=True) if kept] if not keep.all() else found.keys
    linked = np.flatnonzero(found.linked[keep]).tolist()
    return _tree(top, keys, sizes[keep], stamps[keep], linked, names)


def _scan(
    path: str,
    prefix: str,
    check_link: Callable[[str, str], None],
    out: _Files,
    folders: list[tuple[str, str]],
) -> None:
    """One folder: its files into ``out`` (keys ``prefix + name``), its folders into ``folders``."""
    with os.scandir(path) as entries:
        for entry in entries:
            name = entry.name
            if name[0] == ".":
                continue
            key = prefix + name
            if entry.is_symlink():
                check_link(entry.path, key)
                target = os.stat(entry.path)
                if stat_module.S_ISDIR(target.st_mode):
                    continue
                out.linked.append(len(out.keys))
                out.sizes.append(target.st_size)
                out.stamps.append(target.st_mtime)
            elif entry.is_dir(follow_symlinks=False):
                folders.append((entry.path, name))
                continue
            else:
                info = entry.stat(follow_symlinks=False)
                if not stat_module.S_ISREG(info.st_mode):
                    continue
                if info.st_nlink > 1:
                    out.linked.append(len(out.keys))
                out.sizes.append(info.st_size)
                out.stamps.append(info.st_mtime)
            out.keys.append(key.encode("utf-8", "surrogateescape"))


def _tree(
    top: _Files,
    keys: list[bytes],
    sizes: np.ndarray,
    stamps: np.ndarray,
    linked: list[int],
    top_names: list[str],
) -> Tree:
    """The root's files and the files below it as one :class:`Tree` in key order."""
    everything = top.keys + keys
    count = len(everything)
    order = np.array(sorted(range(count), key=everything.__getitem__), dtype=np.int64)
    ordered = [everything[i] for i in order.tolist()]
    del everything
    lengths = np.fromiter(map(len, ordered), dtype=np.int64, count=count)
    starts = np.zeros(count, dtype=np.int64)
    if count:
        np.cumsum(lengths[:-1] + 1, out=starts[1:])
    blob = b"\n".join(ordered)
    all_stamps = np.concatenate((np.asarray(top.stamps, dtype=np.float64), stamps))[order]
    labels, classes = _labels(ordered, top_names) if count and not top.keys else (None, ())
    del ordered
    multiple = np.array(top.linked + [len(top.keys) + i for i in linked], dtype=np.int64)
    return Tree(
        blob=blob,
        starts=starts,
        ends=starts + lengths,
        sizes=np.concatenate((np.asarray(top.sizes, dtype=np.int64), sizes))[order],
        stamps=all_stamps,
        tags=TAGS_PREFIX + all_stamps.tobytes(),
        labels=labels,
        classes=classes,
        unwatchable=np.sort(np.argsort(order)[multiple]) if len(multiple) else np.zeros(0, dtype=np.int64),
    )


def _labels(ordered: list[bytes], top_names: list[str]) -> tuple[np.ndarray | None, tuple[str, ...]]:
    """Each file's class (its first folder, every file lying in one) from the sorted keys: a class's
    files are one run of them, found by bisection (nothing per file in Python)."""
    names = sorted({name.encode("utf-8", "surrogateescape") for name in top_names})
    bounds = [bisect.bisect_left(ordered, name + b"/") for name in names]
    ends = [bisect.bisect_left(ordered, name + b"0") for name in names]  # "0" follows "/"
    used = [k for k in range(len(names)) if ends[k] > bounds[k]]
    labels = np.full(len(ordered), -1, dtype=np.int32)
    for label, k in enumerate(used):  # (a run's place in key order need not be its name's: "a-b/" < "a/")
        labels[bounds[k] : ends[k]] = label
    if (labels < 0).any():
        return None, ()
    return labels, tuple(names[k].decode("utf-8", "surrogateescape") for k in used)
