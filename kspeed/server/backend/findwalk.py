"""Listing a local tree with GNU ``find``, several processes at once, parsed with numpy.

The listing's cost is one ``stat`` per file; in Python each also costs a few microseconds of
interpreter, and threads cannot share that work (the GIL). GNU ``find`` does the walk and the
``stat`` in C and prints what a listing needs (type, path, size, mtime, link count) separated by
NUL bytes; :func:`find_files` runs one ``find`` per group of the root's folders, as many as there
are cores, reads their outputs at once and parses them without a Python object per number. Only
the keys become Python ``bytes`` (to be sorted). Where GNU ``find`` is not installed (a minimal
container, another system's ``find``) :func:`find_files` returns ``None`` and the caller walks the
tree in Python (:mod:`kspeed.server.backend.localtree`).

What it finds is what the Python walk finds: hidden entries pruned, links not followed into
folders (each link is handed back for the caller to check and resolve), only regular files and
links kept. A file's mtime is computed from ``find``'s ``%T@`` exactly as Python computes
``st_mtime`` (seconds + nanoseconds x 1e-9, in double precision), so both walks give equal stamps.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["Found", "find_files"]

FORMAT = r"%y\0%p\0%s\0%T@\0%n\0"
FIELDS = 5
_gnu: bool | None = None
_lock = threading.Lock()


@dataclass
class Found:
    """The files under the root's folders, unsorted.

    Attributes:
        keys: each file's path relative to the root.
        sizes: int64 sizes (a link's own; the caller resolves links).
        stamps: float64 mtimes (as ``os.stat``'s ``st_mtime``).
        linked: bool, a file with several hard links.
        links: the indexes of symbolic links in ``keys``.
    """

    keys: list[bytes]
    sizes: np.ndarray
    stamps: np.ndarray
    linked: np.ndarray
    links: np.ndarray


def gnu_find() -> bool:
    """Whether ``find`` on the path is GNU findutils (it has ``-printf``)."""
    global _gnu
    with _lock:
        if _gnu is None:
            path = shutil.which("find")
            try:
                out = subprocess.run([path, "--version"], capture_output=True, timeout=10).stdout if path else b""
            except (OSError, subprocess.SubprocessError):
                out = b""
            _gnu = b"GNU findutils" in out
        return _gnu


def find_files(root: str, folders: list[str], processes: int) -> Found | None:
    """Every regular file and link under ``folders`` (names of folders directly under ``root``, none
    hidden), with ``processes`` ``find`` processes at once; ``None`` without GNU ``find``.

    Raises:
        OSError: a ``find`` failed (a folder unreadable, or gone while it was listed), with its message.
    """
    if not gnu_find():
        return None
    groups = [folders[k::processes] for k in range(min(processes, len(folders)))]
    outputs: list[bytes] = [b""] * len(groups)
    errors: list[str] = []

    def run(k: int) -> None:
        args = ["find", *("./" + name for name in groups[k]), "-mindepth", "1"]
        args += ["(", "-name", ".*", "-prune", ")", "-o", "(", "-type", "f", "-o", "-type", "l", ")"]
        done = subprocess.run([*args, "-printf", FORMAT], cwd=root, capture_output=True, check=False)
        if done.returncode != 0:
            errors.append(done.stderr.decode("utf-8", "replace").strip().splitlines()[0] if done.stderr else "")
        outputs[k] = done.stdout

    threads = [threading.Thread(target=run, args=(k,), name="kspeed-find") for k in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise OSError(f"listing {root}: find: {errors[0] or 'failed'}")
    parts = [_parse(out, root) for out in outputs]
    offsets = np.cumsum([0] + [len(p.keys) for p in parts])
    return Found(
        keys=[k for p in parts for k in p.keys],
        sizes=np.concatenate([p.sizes for p in parts]) if parts else np.zeros(0, np.int64),
        stamps=np.concatenate([p.stamps for p in parts]) if parts else np.zeros(0, np.float64),
        linked=np.concatenate([p.linked for p in parts]) if parts else np.zeros(0, bool),
        links=np.concatenate([p.links + o for p, o in zip(parts, offsets.tolist(), strict=False)])
        if parts
        else np.zeros(0, np.int64),
    )


def _parse(out: bytes, root: str) -> Found:
    """One ``find``'s records (``FORMAT``) as a :class:`Found`."""
    data = np.frombuffer(out, dtype=np.uint8)
    nuls = np.flatnonzero(data == 0)
    if len(nuls) % FIELDS:
        raise OSError(f"listing {root}: find printed {len(nuls)} fields, not records of {FIELDS}")
    flat_starts = np.concatenate(([0], nuls[:-1] + 1)).astype(np.int64)
    starts, ends = flat_starts.reshape(-1, FIELDS), nuls.reshape(-1, FIELDS).astype(np.int64)
    kind = data[starts[:, 0]] if len(starts) else np.zeros(0, np.uint8)
    keys = [out[a + 2 : b] for a, b in zip(starts[:, 1].tolist(), ends[:, 1].tolist(), strict=True)]  # "./" off
    sizes = _integers(data, starts[:, 2], ends[:, 2], root)
    if len(starts) and (data[starts[:, 3]] == ord("-")).any():
        raise OSError(f"listing {root}: a file's mtime is before 1970 (find's text of it is not parsed)")
    point = _first(data, starts[:, 3], ends[:, 3], ord("."))
    seconds = _integers(data, starts[:, 3], point, root)
    fraction = _integers(data, np.minimum(point + 1, ends[:, 3]), np.minimum(point + 10, ends[:, 3]), root)
    digits = np.minimum(ends[:, 3] - point - 1, 9)
    nanoseconds = fraction * 10 ** (9 - np.maximum(digits, 0))
    nlink = _integers(data, starts[:, 4], ends[:, 4], root)
    return Found(
        keys=keys,
        sizes=sizes,
        stamps=seconds.astype(np.float64) + nanoseconds.astype(np.float64) * 1e-9,
        linked=nlink > 1,
        links=np.flatnonzero(kind == ord("l")).astype(np.int64),
    )


def _first(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, byte: int) -> np.ndarray:
    """In each field, the position of its first ``byte`` (its end where it has none)."""
    found = np.flatnonzero(data == byte)
    at = np.searchsorted(found, starts)
    hit = found[np.minimum(at, len(found) - 1)] if len(found) else ends
    return np.where((at < len(found)) & (hit < ends), hit, ends)


def _integers(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, root: str) -> np.ndarray:
    """Each field's decimal digits as an int64 (0 for an empty field; no sign: the caller refuses
    negative numbers).

    Raises:
        OSError: a field holds something else (the caller then walks the tree in Python).
    """
    if not len(starts):
        return np.zeros(0, dtype=np.int64)
    width = int((ends - starts).max())
    if width > 18:
        raise OSError(f"listing {root}: find printed a number of {width} digits")
    if width <= 0:
        return np.zeros(len(starts), dtype=np.int64)
    # The digits right-aligned in rows of `width` (zeros before the shorter ones), one dot product.
    at = ends[:, None] - width + np.arange(width)
    digits = data[np.maximum(at, 0)].astype(np.int64) - ord("0")
    digits[at < starts[:, None]] = 0
    if ((digits < 0) | (digits > 9)).any():
        raise OSError(f"listing {root}: find printed a field that is not a number")
    return digits @ (10 ** np.arange(width - 1, -1, -1, dtype=np.int64))
