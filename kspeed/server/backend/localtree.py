"""Listing a local directory tree at the file system's speed: ``os.scandir`` and one ``stat`` per file.

A general file system listing (fsspec's ``find(detail=True)``) builds a dictionary of a dozen
fields per file; a dataset needs three (key, size, mtime). :func:`walk_tree` keeps them in flat
lists while it walks, then sorts once and returns numpy arrays and one bytes blob of keys: nothing
per sample outlives the call. What it finds is exactly what the fsspec listing found, so a
dataset's sample IDs and fingerprint do not depend on which path listed it:

* files in sorted order of their relative keys (``str`` order, which is UTF-8 byte order);
* hidden entries (a name starting with ``.``) and what lies under them skipped;
* a symbolic link is not followed into a directory; a link to a file is a sample whose size and
  stamp are its target's and whose tag is the link's own mtime (as fsspec reports it), and whose
  path must lie under the allow-list (``check_link``);
* labels by the first directory under the root when every file lies in one (ImageFolder's
  convention).
"""

from __future__ import annotations

import os
import stat as stat_module
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Tree", "walk_tree"]


@dataclass(frozen=True)
class Tree:
    """What :func:`walk_tree` found, sorted by key.

    Attributes:
        blob: the keys, ``\\n``-separated, UTF-8.
        starts: int64 offset of each key in ``blob``.
        ends: int64 end of each key in ``blob``.
        sizes: int64 size of each file.
        stamps: float64 mtime of each file (a link's target's).
        tags: the fingerprint's tags: ``mtime=<mtime>`` per file, ``\\n``-separated.
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


def walk_tree(root: str, check_link: Callable[[str, str], None]) -> Tree:
    """List every file under ``root`` (see the module docstring).

    Args:
        root: an absolute local directory.
        check_link: called with ``(path, key)`` for every symbolic link met; raises to refuse it
            (a link out of the allow-list).

    Raises:
        OSError: a directory cannot be read or a file vanished while it was listed.
    """
    keys: list[str] = []
    sizes: list[int] = []
    stamps: list[float] = []
    tag_times: list[float] = []
    tops: list[int] = []  # each file's first directory (index into top_names); -1 at the root
    linked: list[int] = []  # files (their index in keys) that are links or have several hard links
    top_names: list[str] = []
    pending: list[tuple[str, str, int]] = [(root, "", -1)]
    while pending:
        path, prefix, top = pending.pop()
        with os.scandir(path) as entries:
            for entry in entries:
                name = entry.name
                if name[0] == ".":
                    continue
                key = prefix + name
                if entry.is_symlink():
                    check_link(entry.path, key)
                    linked.append(len(keys))
                    target = os.stat(entry.path)
                    if stat_module.S_ISDIR(target.st_mode):
                        continue
                    sizes.append(target.st_size)
                    stamps.append(target.st_mtime)
                    tag_times.append(entry.stat(follow_symlinks=False).st_mtime)
                elif entry.is_dir(follow_symlinks=False):
                    if top < 0:
                        top_names.append(name)
                    pending.append((entry.path, key + "/", len(top_names) - 1 if top < 0 else top))
                    continue
                else:
                    info = entry.stat(follow_symlinks=False)
                    if not stat_module.S_ISREG(info.st_mode):
                        continue
                    sizes.append(info.st_size)
                    stamps.append(info.st_mtime)
                    tag_times.append(info.st_mtime)
                    if info.st_nlink > 1:
                        linked.append(len(keys))
                keys.append(key)
                tops.append(top)
    return _sorted(keys, sizes, stamps, tag_times, tops, top_names, linked)


def _sorted(
    keys: list[str],
    sizes: list[int],
    stamps: list[float],
    tag_times: list[float],
    tops: list[int],
    top_names: list[str],
    linked: list[int],
) -> Tree:
    """The walk's lists as a :class:`Tree` in key order."""
    count = len(keys)
    order = np.array(sorted(range(count), key=keys.__getitem__), dtype=np.int64)
    encoded = [keys[i].encode("utf-8", "surrogateescape") for i in order.tolist()]
    del keys
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=count)
    starts = np.zeros(count, dtype=np.int64)
    if count:
        np.cumsum(lengths[:-1] + 1, out=starts[1:])
    blob = b"\n".join(encoded)
    del encoded
    times = np.asarray(tag_times, dtype=np.float64)[order]
    tags = "\n".join(map("mtime={}".format, times.tolist())).encode()
    labels: np.ndarray | None = None
    classes: tuple[str, ...] = ()
    top_of = np.asarray(tops, dtype=np.int64)[order] if count else np.zeros(0, dtype=np.int64)
    if count and (top_of >= 0).all():
        used = np.unique(top_of)
        names = [top_names[i] for i in used.tolist()]
        rank = sorted(range(len(names)), key=names.__getitem__)
        classes = tuple(names[i] for i in rank)
        label_of = np.zeros(len(top_names), dtype=np.int32)
        label_of[used[rank]] = np.arange(len(rank), dtype=np.int32)
        labels = label_of[top_of]
    return Tree(
        blob=blob,
        starts=starts,
        ends=starts + lengths,
        sizes=np.asarray(sizes, dtype=np.int64)[order],
        stamps=np.asarray(stamps, dtype=np.float64)[order],
        tags=tags,
        labels=labels,
        classes=classes,
        unwatchable=np.sort(np.argsort(order)[np.asarray(linked, dtype=np.int64)]) if linked else np.zeros(0, np.int64),
    )
