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
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

__all__ = ["STAT_THREADS", "Tree", "walk_tree"]

STAT_THREADS = 8  # folders listed at once


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


@dataclass
class _Folder:
    """What one folder of the walk holds: its files (by key) and the folders under it."""

    keys: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    tag_times: list[float] = field(default_factory=list)
    linked: list[int] = field(default_factory=list)  # indexes (in keys) of links and multiply linked files
    top: int = -1  # the first folder under the root it lies in (index into the root's folders); -1: the root
    folders: list[tuple[str, str, int]] = field(default_factory=list)  # (path, key prefix, top) under it


def walk_tree(root: str, check_link: Callable[[str, str], None], *, threads: int = STAT_THREADS) -> Tree:
    """List every file under ``root`` (see the module docstring), ``threads`` folders at a time
    (a ``stat`` waits for the disk when the inodes are not cached: in parallel those waits overlap).

    Args:
        root: an absolute local directory.
        check_link: called with ``(path, key)`` for every symbolic link met; raises to refuse it
            (a link out of the allow-list).

    Raises:
        OSError: a directory cannot be read or a file vanished while it was listed.
    """
    found: list[_Folder] = []
    if threads <= 1:
        pending = [(root, "", -1)]
        while pending:
            folder = _scan(*pending.pop(), check_link)
            found.append(folder)
            pending.extend(folder.folders)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="kspeed-list") as pool:
            running = {pool.submit(_scan, root, "", -1, check_link)}
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    folder = future.result()
                    found.append(folder)
                    running |= {pool.submit(_scan, *sub, check_link) for sub in folder.folders}
    tops = [name for _, name, _ in found[0].folders] if found else []
    return _sorted(found, [t.rstrip("/") for t in tops])


def _scan(path: str, prefix: str, top: int, check_link: Callable[[str, str], None]) -> _Folder:
    """One folder of the walk: its files' keys, sizes and stamps, and the folders under it."""
    out = _Folder(top=top)
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
                out.tag_times.append(entry.stat(follow_symlinks=False).st_mtime)
            elif entry.is_dir(follow_symlinks=False):
                below = len(out.folders) if top < 0 else top
                out.folders.append((entry.path, key + "/", below))
                continue
            else:
                info = entry.stat(follow_symlinks=False)
                if not stat_module.S_ISREG(info.st_mode):
                    continue
                if info.st_nlink > 1:
                    out.linked.append(len(out.keys))
                out.sizes.append(info.st_size)
                out.stamps.append(info.st_mtime)
                out.tag_times.append(info.st_mtime)
            out.keys.append(key)
    return out


def _sorted(found: list[_Folder], top_names: list[str]) -> Tree:
    """The walk's folders as one :class:`Tree` in key order."""
    keys = [k for f in found for k in f.keys]
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
    times = np.fromiter((t for f in found for t in f.tag_times), dtype=np.float64, count=count)[order]
    tags = "\n".join(map("mtime={}".format, times.tolist())).encode()
    labels: np.ndarray | None = None
    classes: tuple[str, ...] = ()
    top_of = np.fromiter((f.top for f in found for _ in f.keys), dtype=np.int64, count=count)[order]
    if count and (top_of >= 0).all():
        used = np.unique(top_of)
        names = [top_names[i] for i in used.tolist()]
        rank = sorted(range(len(names)), key=names.__getitem__)
        classes = tuple(names[i] for i in rank)
        label_of = np.zeros(len(top_names), dtype=np.int32)
        label_of[used[rank]] = np.arange(len(rank), dtype=np.int32)
        labels = label_of[top_of]
    firsts = np.cumsum([0] + [len(f.keys) for f in found])
    linked = np.array([firsts[n] + i for n, f in enumerate(found) for i in f.linked], dtype=np.int64)
    return Tree(
        blob=blob,
        starts=starts,
        ends=starts + lengths,
        sizes=np.fromiter((x for f in found for x in f.sizes), dtype=np.int64, count=count)[order],
        stamps=np.fromiter((x for f in found for x in f.stamps), dtype=np.float64, count=count)[order],
        tags=tags,
        labels=labels,
        classes=classes,
        unwatchable=np.sort(np.argsort(order)[linked]) if len(linked) else np.zeros(0, dtype=np.int64),
    )
