"""The cold-start benchmark's data: an ImageNet-like tree of small files and a manifest of many keys.

Both are made once under a data directory and reused by later runs: a tree is complete when its
``tree.json`` records its file count (written last), and a tree cut short resumes class by class
(a class's marker under ``progress/`` is written once all its files are). Files are written with
``os.open``/``os.write`` from a few threads (the calls release the GIL), their sizes and bytes drawn
from a generator seeded per class, so a resumed tree is the one a single run would have made.

Layout::

    <data-dir>/files-<N>/tree/n00000000/n00000000_0000000.bin   the tree (the dataset's root)
    <data-dir>/files-<N>/progress/n00000000                      class done
    <data-dir>/files-<N>/tree.json                               {"files": N, "classes": ..., "bytes": ...}
    <data-dir>/manifest-<K>/manifest.txt                         K ``key size`` lines
    <data-dir>/manifest-<K>/n00000000/...                        the first keys' files, which exist
    <data-dir>/manifest-<K>/manifest.json                        {"keys": K, "files": ..., ...}
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "EXTENSION",
    "MAX_CLASSES",
    "PER_CLASS",
    "SIZE_RANGE",
    "Manifest",
    "SpaceError",
    "Tree",
    "check_space",
    "class_counts",
    "class_name",
    "drop_page_cache",
    "evict_files",
    "file_key",
    "make_manifest",
    "make_tree",
    "manifest_need",
    "tree_need",
]

EXTENSION = ".bin"
MAX_CLASSES = 1000  # ImageNet's
PER_CLASS = 1280  # ImageNet's files per class, about; a smaller tree has fewer classes, not fewer files each
SIZE_RANGE = (200, 600)  # bytes per file, both ends included
SPACE_MARGIN = 1 << 30  # left free on the data directory's file system beyond what the data takes
INODE_MARGIN = 10_000
THREADS = 8
CHUNK_KEYS = 200_000  # manifest lines formatted at a time
MANIFEST_STREAM = 1 << 30  # the manifest's sizes: a random stream no class uses


class SpaceError(Exception):
    """The data directory's file system lacks the bytes or inodes the data needs (the message says which)."""


@dataclass(frozen=True)
class Tree:
    """A complete tree of ``files`` files in ``classes`` class folders under ``root``."""

    root: str
    files: int
    classes: int
    bytes: int
    extension: str = EXTENSION
    seed: int = 0


@dataclass(frozen=True)
class Manifest:
    """A manifest of ``keys`` lines at ``path``; the first ``files`` keys exist (under the manifest's directory)."""

    path: str
    keys: int
    files: int
    bytes: int
    seed: int = 0


def class_counts(files: int) -> np.ndarray:
    """Files per class folder: ``ceil(files / PER_CLASS)`` classes (1 to :data:`MAX_CLASSES`), filled evenly."""
    if files < 1:
        raise ValueError(f"a tree needs at least one file, not {files}")
    classes = min(MAX_CLASSES, max(1, -(-files // PER_CLASS)))
    counts = np.full(classes, files // classes, dtype=np.int64)
    counts[: files % classes] += 1
    return counts


def class_name(c: int) -> str:
    """The folder of class ``c``, in ImageNet's style (``n`` and eight digits)."""
    return f"n{c:08d}"


def file_key(c: int, j: int) -> str:
    """File ``j`` of class ``c``, relative to the tree's root."""
    name = class_name(c)
    return f"{name}/{name}_{j:07d}{EXTENSION}"


def _class_sizes(seed: int, c: int, count: int) -> tuple[np.random.Generator, np.ndarray]:
    rng = np.random.default_rng((seed, c))
    return rng, rng.integers(SIZE_RANGE[0], SIZE_RANGE[1] + 1, count)


def _block_size(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return os.statvfs(path).f_frsize or 4096


def tree_need(files: int, block: int = 4096) -> tuple[int, int]:
    """Bytes (a block per file, as each is smaller than a block, and one per folder) and inodes a tree takes."""
    classes = len(class_counts(files))
    per_file = -(-SIZE_RANGE[1] // block) * block
    return files * per_file + (classes + 1) * block, files + classes + 4


def manifest_need(keys: int, files: int, block: int = 4096) -> tuple[int, int]:
    """Bytes and inodes of a manifest of ``keys`` lines whose first ``files`` keys exist."""
    line = len(file_key(0, 0)) + len(str(SIZE_RANGE[1])) + 2
    tree_bytes, tree_inodes = tree_need(files, block) if files else (0, 0)
    return keys * line + tree_bytes + 2 * block, tree_inodes + 3


def check_space(directory: Path, need_bytes: int, need_inodes: int, what: str) -> None:
    """Raise :class:`SpaceError` unless ``directory``'s file system has room for ``what`` and a margin."""
    directory.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(directory)
    free_bytes, free_inodes = st.f_bavail * st.f_frsize, st.f_favail
    short = []
    if free_bytes < need_bytes + SPACE_MARGIN:
        short.append(
            f"{need_bytes / 1e9:.2f} GB (+{SPACE_MARGIN / 1e9:.1f} GB margin) needed, {free_bytes / 1e9:.2f} GB free"
        )
    if st.f_files and free_inodes < need_inodes + INODE_MARGIN:  # f_files == 0: no inode limit (e.g. btrfs)
        short.append(f"{need_inodes:,} inodes (+{INODE_MARGIN:,}) needed, {free_inodes:,} free")
    if short:
        raise SpaceError(
            f"not enough room in {directory} for {what}: {'; '.join(short)}; free some or pass another --data-dir"
        )


def _write_class(folder: Path, seed: int, c: int, count: int) -> int:
    rng, sizes = _class_sizes(seed, c, count)
    blob = memoryview(rng.bytes(int(sizes.sum())))
    folder.mkdir(parents=True, exist_ok=True)
    name = class_name(c)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    pos = 0
    for j, size in enumerate(sizes.tolist()):
        fd = os.open(f"{folder}/{name}_{j:07d}{EXTENSION}", flags, 0o644)
        try:
            os.write(fd, blob[pos : pos + size])
        finally:
            os.close(fd)
        pos += size
    return int(sizes.sum())


def _make_classes(root: Path, progress: Path, counts: np.ndarray, seed: int, threads: int, say=None) -> int:
    """Write every class of ``counts`` under ``root`` that ``progress`` does not mark done; returns all bytes."""
    progress.mkdir(parents=True, exist_ok=True)
    done = set(os.listdir(progress))
    todo = [c for c in range(len(counts)) if class_name(c) not in done]
    total = sum(int(_class_sizes(seed, c, int(counts[c]))[1].sum()) for c in range(len(counts)) if c not in todo)

    def one(c: int) -> int:
        written = _write_class(root / class_name(c), seed, c, int(counts[c]))
        (progress / class_name(c)).touch()
        return written

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for k, written in enumerate(pool.map(one, todo), 1):
            total += written
            if say is not None and (k % 50 == 0 or k == len(todo)):
                say(f"  {k}/{len(todo)} classes written")
    return total


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def make_tree(data_dir: Path, files: int, *, seed: int = 0, threads: int = THREADS, say=None) -> tuple[Tree, bool]:
    """The tree of ``files`` files under ``data_dir``, made (or finished) if needed; returns it and
    whether it was already complete.

    Raises:
        SpaceError: the file system has no room for what is left to write.
    """
    base = data_dir / f"files-{files}"
    marker = base / "tree.json"
    known = _read_marker(marker)
    if known is not None and known.get("files") == files and known.get("seed") == seed:
        return Tree(**{**known, "root": str(base / "tree")}), True  # (the data directory may have moved)
    counts = class_counts(files)
    progress = base / "progress"
    done = set(os.listdir(progress)) if progress.is_dir() else set()
    left = sum(int(n) for c, n in enumerate(counts) if class_name(c) not in done)
    need_bytes, need_inodes = tree_need(left, _block_size(data_dir)) if left else (0, 0)
    check_space(data_dir, need_bytes, need_inodes, f"a tree of {files:,} files ({left:,} still to write)")
    if say is not None:
        say(f"writing {left:,} of {files:,} files in {len(counts)} classes under {base / 'tree'}")
    total = _make_classes(base / "tree", progress, counts, seed, threads, say)
    tree = Tree(root=str(base / "tree"), files=files, classes=len(counts), bytes=total, seed=seed)
    marker.write_text(json.dumps(asdict(tree)) + "\n")
    return tree, False


def make_manifest(data_dir: Path, keys: int, files: int, *, seed: int = 0, say=None) -> tuple[Manifest, bool]:
    """A manifest of ``keys`` keys (``MAX_CLASSES`` classes' files in class order) whose first ``files``
    exist, made if needed; returns it and whether it was already complete.

    The keys follow the tree's naming with ``ceil(keys / MAX_CLASSES)`` files per class, so the
    first ``files`` keys are the first files of class 0 (and on), written as a tree would be.

    Raises:
        SpaceError: the file system has no room for it.
    """
    base = data_dir / f"manifest-{keys}"
    marker = base / "manifest.json"
    known = _read_marker(marker)
    if known is not None and known.get("keys") == keys and known.get("files") == files and known.get("seed") == seed:
        return Manifest(**{**known, "path": str(base / "manifest.txt")}), True  # (the data directory may have moved)
    check_space(data_dir, *manifest_need(keys, files, _block_size(data_dir)), f"a manifest of {keys:,} keys")
    per_class = -(-keys // MAX_CLASSES)
    files = min(files, keys)
    existing = np.zeros(-(-files // per_class), dtype=np.int64) + per_class if files else np.zeros(0, np.int64)
    if files:
        existing[-1] = files - per_class * (len(existing) - 1)
        if say is not None:
            say(f"writing the manifest's first {files:,} files under {base}")
        _make_classes(base, base / ".progress", existing, seed, THREADS)
    sizes = np.random.default_rng((seed, MANIFEST_STREAM)).integers(SIZE_RANGE[0], SIZE_RANGE[1] + 1, keys)
    for c, count in enumerate(existing.tolist()):  # the files that exist: their real sizes
        sizes[c * per_class : c * per_class + count] = _class_sizes(seed, c, count)[1]
    if say is not None:
        say(f"writing a manifest of {keys:,} keys to {base / 'manifest.txt'}")
    part = base / "manifest.txt.part"
    with open(part, "w") as out:
        for start in range(0, keys, CHUNK_KEYS):
            ids = range(start, min(keys, start + CHUNK_KEYS))
            out.write(_manifest_lines(ids, per_class, sizes[ids.start : ids.stop]))
    os.replace(part, base / "manifest.txt")
    manifest = Manifest(str(base / "manifest.txt"), keys, files, int(sizes.sum()), seed)
    marker.write_text(json.dumps(asdict(manifest)) + "\n")
    return manifest, False


def _manifest_lines(ids: range, per_class: int, sizes: np.ndarray) -> str:
    return "".join(
        f"n{c:08d}/n{c:08d}_{j:07d}{EXTENSION} {s}\n"
        for c, j, s in zip((i // per_class for i in ids), (i % per_class for i in ids), sizes.tolist(), strict=True)
    )


def drop_page_cache() -> str | None:
    """Drop the kernel's page, dentry and inode caches (needs root); returns why not, or None when done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError as exc:
        return f"cannot write /proc/sys/vm/drop_caches: {exc}"
    return None


def evict_files(root: str) -> int:
    """Ask the kernel to drop ``root``'s files from the page cache (``posix_fadvise(DONTNEED)`` after a
    sync): the fallback without root. Their dentries and inodes stay cached. Returns the files seen."""
    os.sync()
    seen = 0
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            seen += 1
    return seen
