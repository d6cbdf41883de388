"""The server's memory pool: operator-granted memory carved into fixed-size, file-backed regions.

Each region is a file in the pool directory (normally on tmpfs, e.g. ``/dev/shm/kspeed-pool-<id>``),
allocated with ``posix_fallocate`` and mapped with ``MAP_POPULATE`` so every page exists before the
first sample lands. Because regions are files, feeder processes started with ``spawn`` can map the
same memory by path (:func:`map_region`) and a restarted server re-adopts what it had loaded.

On-disk layout of a pool directory::

    pool.json                 manifest: region size and, per region, state, dataset, virtual index
    region-00000.bin ...      one file per region, exactly ``region_size`` bytes
    ds-<dataset>.<name>       side files of a dataset (e.g. its sample index), removed on release

The manifest is rewritten whole at every change, from a snapshot taken under the pool's lock and
written after it is let go, in order (:class:`~kspeed.server.memory.statefile.OrderedFile`): the
sync of a write can take seconds on a disk, and a heartbeat's region counts need that lock. When
it cannot be written (a full disk) the pool goes on as this process knows it and the manifest
keeps its last version: a restart then reloads what was filled since, and finds the regions
released since still given to their dataset (whose saved index went with them, so they are
reloaded if it is assigned here again, never served as they are). Only a dataset's allocation is
refused (:class:`~kspeed.errors.StateFileError`): its regions would not be re-adopted. The next
change that can be written brings the manifest up to date.

Region lifecycle (:class:`RegionState`)::

    FREE --allocate--> ALLOCATED --begin_fill--> FILLING --seal--> SEALED
      ^                    ^                         |                |
      |                    +------- unseal ----------+----------------+
      +----------------------------- release (any state) -------------+
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import mmap
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kspeed import names
from kspeed.errors import CapacityError, ConfigError, DatasetError, StateError, StateFileError
from kspeed.server.memory.statefile import OrderedFile, Snapshot

__all__ = [
    "DEFAULT_REGION_SIZE",
    "SHARED_OWNER",
    "WINDOW_OWNER",
    "MemoryPool",
    "RegionInfo",
    "RegionState",
    "check_dataset_name",
    "map_region",
]

log = logging.getLogger(__name__)

DEFAULT_REGION_SIZE = 128 << 20
MANIFEST_NAME = "pool.json"
_MANIFEST_VERSION = 1
_REGION_RE = re.compile(r"^region-(\d{5})\.bin$")


class RegionState(enum.Enum):
    """Lifecycle of one region; see the module docstring for the allowed transitions."""

    FREE = "free"
    ALLOCATED = "allocated"
    FILLING = "filling"
    SEALED = "sealed"


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """A snapshot of one region.

    Attributes:
        index: position of the region in the pool (``region-<index>.bin``).
        state: its lifecycle state.
        dataset: the dataset holding it, ``None`` when free.
        vindex: its index in the dataset's virtual address space (region index x region size +
            offset addresses a byte of the dataset), ``None`` when free.
        path: the region's file, for processes that map it by path.
    """

    index: int
    state: RegionState
    dataset: str | None
    vindex: int | None
    path: Path


#: The owner of the regions reserved for the production window (:mod:`kspeed.server.memory.window`); no
#: dataset can take this name (dataset names start with a letter or digit).
WINDOW_OWNER = "_window"
#: The owner of the regions small datasets share (:mod:`kspeed.server.memory.slices`).
SHARED_OWNER = "_shared"


def check_dataset_name(name: str) -> str:
    """Return ``name`` if it can own regions (a dataset's name, :data:`WINDOW_OWNER` or
    :data:`SHARED_OWNER`), else raise DatasetError."""
    if name in (WINDOW_OWNER, SHARED_OWNER):
        return name
    return names.DATASET.check(name, DatasetError, what="invalid dataset name", dataset=str(name))


def map_region(path: str | os.PathLike[str], *, writable: bool = False) -> mmap.mmap:
    """Map one region file (e.g. in a feeder process) and return the mapping.

    Args:
        path: the region file, from :attr:`RegionInfo.path`.
        writable: map read-write instead of read-only.
    """
    flags = os.O_RDWR if writable else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, 0, access=access)
    finally:
        os.close(fd)


@dataclasses.dataclass
class _Region:
    state: RegionState = RegionState.FREE
    dataset: str | None = None
    vindex: int | None = None


class MemoryPool:
    """Fixed-size, page-aligned, pre-faulted regions backed by files in one directory.

    Create with :meth:`open` (adopt what the directory holds, carve the rest), :meth:`create`
    (always start empty) or :meth:`adopt`. All methods are thread-safe; every state change is
    persisted atomically to the manifest before the call returns (its sync outside the lock).

    Args:
        directory: the pool directory (created if missing).
        region_count: number of regions.
        region_size: bytes per region, a multiple of the page size.
        huge_pages: advise the kernel to back regions with transparent huge pages.
    """

    def __init__(self, directory: Path, region_count: int, region_size: int, *, huge_pages: bool = False) -> None:
        self.directory = Path(directory)
        self.region_size = region_size
        self.huge_pages = huge_pages
        self._lock = threading.RLock()
        self._regions = [_Region() for _ in range(region_count)]
        self._maps: list[mmap.mmap | None] = [None] * region_count
        self._arrays: list[np.ndarray | None] = [None] * region_count
        self._closed = False
        self._manifest = OrderedFile(self.directory / MANIFEST_NAME)
        self._saving = threading.Lock()  # a write of the manifest and what it says of the outcome
        self._unsaved: StateFileError | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        memory_bytes: int,
        *,
        region_size: int = DEFAULT_REGION_SIZE,
        huge_pages: bool = False,
    ) -> MemoryPool:
        """Carve a fresh pool, discarding whatever the directory held.

        Args:
            directory: the pool directory.
            memory_bytes: memory the operator grants; rounded down to whole regions.
            region_size: bytes per region, a positive multiple of the page size.
            huge_pages: see the class docstring.

        Raises:
            ConfigError: bad sizes.
            CapacityError: the file system cannot hold the regions (nothing is left behind).
        """
        count = _region_count(memory_bytes, region_size)
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # the server's alone, whatever the umask: no other user may open a region
        _remove_pool_files(directory)
        pool = cls(directory, count, region_size, huge_pages=huge_pages)
        pool._materialize(range(count))
        pool._save(pool._snapshot())
        log.info("pool %s: carved %d regions of %d bytes", directory, count, region_size)
        return pool

    @classmethod
    def adopt(
        cls,
        directory: str | os.PathLike[str],
        memory_bytes: int | None = None,
        *,
        region_size: int = DEFAULT_REGION_SIZE,
        huge_pages: bool = False,
    ) -> MemoryPool:
        """Re-adopt the regions a previous server process left in ``directory``.

        The manifest and each region file are validated: a region whose file is missing or of the
        wrong size is discarded (re-created FREE); files the manifest does not know are removed;
        regions caught FILLING are reset to ALLOCATED, since their content is incomplete. With
        ``memory_bytes`` the pool grows or shrinks (FREE regions only) to that size.

        Raises:
            StateError: no readable manifest, or it was written with another region size.
        """
        directory = Path(directory)
        manifest = _read_manifest(directory)
        if manifest is None:
            raise StateError(f"pool {directory}: no readable {MANIFEST_NAME}; create the pool instead")
        if manifest["region_size"] != region_size:
            raise StateError(
                f"pool {directory}: manifest has region size {manifest['region_size']}, asked {region_size}; "
                "destroy the pool to change the region size"
            )
        os.chmod(directory, 0o700)  # (as :meth:`create`: a pool left by an older build may be open to others)
        entries = manifest["regions"]
        count = len(entries) if memory_bytes is None else _region_count(memory_bytes, region_size)
        pool = cls(directory, max(count, len(entries)), region_size, huge_pages=huge_pages)
        for i, entry in enumerate(entries):
            path = pool.path(i)
            state = RegionState(entry["state"])
            if state is not RegionState.FREE and not _file_ok(path, region_size):
                log.warning("pool %s: region %d file missing or wrong size; discarding it", directory, i)
                state = RegionState.FREE
            if state is RegionState.FILLING:
                state = RegionState.ALLOCATED
            if state is not RegionState.FREE:
                pool._regions[i] = _Region(state, entry["dataset"], int(entry["vindex"]))
        known = {pool.path(i).name for i in range(len(pool._regions))}
        for child in directory.iterdir():
            if _REGION_RE.match(child.name) and child.name not in known:
                child.unlink()
        pool._shrink_to(count)
        pool._materialize(range(len(pool._regions)))
        pool._save(pool._snapshot())
        log.info("pool %s: adopted %s", directory, pool.counts())
        return pool

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        memory_bytes: int,
        *,
        region_size: int = DEFAULT_REGION_SIZE,
        huge_pages: bool = False,
    ) -> MemoryPool:
        """Adopt the pool in ``directory`` if it has a compatible manifest, otherwise create one."""
        manifest = _read_manifest(Path(directory))
        if manifest is not None and manifest["region_size"] == region_size:
            return cls.adopt(directory, memory_bytes, region_size=region_size, huge_pages=huge_pages)
        return cls.create(directory, memory_bytes, region_size=region_size, huge_pages=huge_pages)

    # ------------------------------------------------------------------ queries

    @property
    def region_count(self) -> int:
        """Number of regions in the pool."""
        return len(self._regions)

    def path(self, index: int) -> Path:
        """The file of region ``index``."""
        return self.directory / f"region-{index:05d}.bin"

    def side_path(self, dataset: str, name: str) -> Path:
        """A file beside the data for ``dataset`` (e.g. its index); removed by :meth:`release`."""
        return self.directory / f"ds-{check_dataset_name(dataset)}.{name}"

    def region(self, index: int) -> RegionInfo:
        """A snapshot of region ``index``."""
        with self._lock:
            self._check_index(index)
            r = self._regions[index]
            return RegionInfo(index, r.state, r.dataset, r.vindex, self.path(index))

    def regions(self, dataset: str | None = None) -> list[RegionInfo]:
        """Snapshots of all regions, or of ``dataset``'s regions sorted by virtual index."""
        with self._lock:
            infos = [self.region(i) for i in range(len(self._regions))]
        if dataset is None:
            return infos
        return sorted((r for r in infos if r.dataset == dataset), key=lambda r: r.vindex or 0)

    def counts(self) -> dict[RegionState, int]:
        """Number of regions per state, for metrics."""
        with self._lock:
            out = dict.fromkeys(RegionState, 0)
            for r in self._regions:
                out[r.state] += 1
            return out

    def array(self, index: int) -> np.ndarray:
        """The whole region ``index`` as a writable uint8 array over the shared mapping."""
        with self._lock:
            self._check_index(index)
            arr = self._arrays[index]
            if arr is None:
                raise StateError(f"pool {self.directory}: closed; open the pool again")
            return arr

    # ------------------------------------------------------------------ transitions

    def allocate(self, dataset: str, vindices: Iterable[int]) -> list[RegionInfo]:
        """Give FREE regions to ``dataset`` at the given virtual indices (all or nothing).

        Raises:
            CapacityError: fewer FREE regions than requested; nothing is allocated.
            StateError: the dataset already holds one of the virtual indices.
            StateFileError: the manifest cannot record a dataset's regions; nothing is allocated.
        """
        check_dataset_name(dataset)
        wanted = [int(v) for v in vindices]
        with self._lock:
            if len(set(wanted)) != len(wanted) or any(v < 0 for v in wanted):
                raise StateError(f"dataset {dataset!r}: virtual region indices must be distinct and >= 0")
            held = {r.vindex for r in self._regions if r.dataset == dataset and r.vindex is not None}
            dup = sorted(held.intersection(wanted))
            if dup:
                raise StateError(f"dataset {dataset!r} already holds virtual regions {dup}; release it first")
            free = [i for i, r in enumerate(self._regions) if r.state is RegionState.FREE]
            if len(free) < len(wanted):
                raise CapacityError(
                    f"dataset {dataset!r}: requested {len(wanted)} regions of {self.region_size} bytes, "
                    f"{len(free)} free of {len(self._regions)} in pool {self.directory}"
                )
            taken = free[: len(wanted)]
            for i, v in zip(taken, wanted, strict=True):
                self._regions[i] = _Region(RegionState.ALLOCATED, dataset, v)
            snapshot = self._snapshot()
        try:
            # A dataset's regions are re-adopted after a restart only if the manifest says whose
            # they are; the window's and the shared regions never outlive this process.
            self._save(snapshot, strict=dataset not in (WINDOW_OWNER, SHARED_OWNER))
        except StateFileError:
            with self._lock:
                for i, v in zip(taken, wanted, strict=True):
                    if self._regions[i] == _Region(RegionState.ALLOCATED, dataset, v):
                        self._regions[i] = _Region()
                undone = self._snapshot()
            if self._manifest.written > snapshot.number:  # a change made meanwhile wrote the allocation
                self._save(undone)
            raise
        return [self.region(i) for i in taken]

    def begin_fill(self, index: int) -> None:
        """ALLOCATED -> FILLING: the preloader starts writing the region."""
        self._transition(index, (RegionState.ALLOCATED,), RegionState.FILLING, "allocate it first")

    def seal(self, index: int) -> None:
        """FILLING -> SEALED: every sample of the region is written and checksummed."""
        self._transition(index, (RegionState.FILLING,), RegionState.SEALED, "call begin_fill first")

    def unseal(self, index: int) -> None:
        """FILLING or SEALED -> ALLOCATED: the content can no longer be trusted and must be reloaded."""
        self._transition(
            index,
            (RegionState.FILLING, RegionState.SEALED, RegionState.ALLOCATED),
            RegionState.ALLOCATED,
            "allocate it first",
        )

    def release(self, dataset: str, vindices: Iterable[int] | None = None) -> int:
        """Return the regions of ``dataset`` to FREE: every one, with its side files; or only
        those at ``vindices`` (one of its shares). Returns the count."""
        check_dataset_name(dataset)
        only = None if vindices is None else set(vindices)
        with self._lock:
            n = 0
            for i, r in enumerate(self._regions):
                if r.dataset == dataset and (only is None or r.vindex in only):
                    self._regions[i] = _Region()
                    n += 1
            snapshot = self._snapshot()
        self._save(snapshot)
        if only is None:
            with self._lock:
                if not any(r.dataset == dataset for r in self._regions):  # (not given to it again meanwhile)
                    for child in self.directory.glob(f"ds-{dataset}.*"):
                        child.unlink(missing_ok=True)
        log.info("pool %s: released %d regions of dataset %s", self.directory, n, dataset)
        return n

    def close(self) -> None:
        """Unmap the regions; the files (and so the data) stay for the next adopt."""
        with self._lock:
            self._closed = True
            self._arrays = [None] * len(self._arrays)
            for i, m in enumerate(self._maps):
                if m is not None:
                    with contextlib.suppress(BufferError):
                        m.close()
                    self._maps[i] = None

    def destroy(self) -> None:
        """Unmap and delete every file of the pool, and the directory if it is then empty."""
        self.close()
        _remove_pool_files(self.directory)
        with contextlib.suppress(OSError):
            self.directory.rmdir()
        log.info("pool %s: destroyed", self.directory)

    def __enter__(self) -> MemoryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._regions):
            raise StateError(f"pool {self.directory}: no region {index} (pool has {len(self._regions)})")

    def _transition(self, index: int, allowed: tuple[RegionState, ...], target: RegionState, hint: str) -> None:
        with self._lock:
            self._check_index(index)
            r = self._regions[index]
            if r.state not in allowed:
                raise StateError(
                    f"region {index} (dataset {r.dataset!r}) is {r.state.value}, cannot become {target.value}; {hint}"
                )
            r.state = target
            snapshot = self._snapshot()
        self._save(snapshot)

    def _materialize(self, indices: Iterable[int]) -> None:
        """Create (if needed), allocate and map the region files; all or nothing."""
        created: list[Path] = []
        try:
            for i in indices:
                path = self.path(i)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    if os.fstat(fd).st_size != self.region_size:
                        created.append(path)
                        os.ftruncate(fd, self.region_size)
                    os.posix_fallocate(fd, 0, self.region_size)
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    m = mmap.mmap(fd, self.region_size, flags=flags)
                finally:
                    os.close(fd)
                if self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
                    with contextlib.suppress(OSError):
                        m.madvise(mmap.MADV_HUGEPAGE)
                self._maps[i] = m
                self._arrays[i] = np.frombuffer(m, dtype=np.uint8)
        except OSError as exc:
            self.close()
            for path in created:
                path.unlink(missing_ok=True)
            raise CapacityError(
                f"pool {self.directory}: cannot back {len(self._regions)} regions of {self.region_size} bytes: {exc}"
            ) from exc

    def _shrink_to(self, count: int) -> None:
        while len(self._regions) > count and self._regions[-1].state is RegionState.FREE:
            self._regions.pop()
            self._maps.pop()
            self._arrays.pop()
            self.path(len(self._regions)).unlink(missing_ok=True)
        if len(self._regions) > count:
            log.warning(
                "pool %s: keeping %d regions (asked %d) because the extra ones hold data",
                self.directory,
                len(self._regions),
                count,
            )

    @property
    def unsaved(self) -> StateFileError | None:
        """Why the last write of the manifest failed (``None``: the manifest is up to date)."""
        return self._unsaved

    def _snapshot(self) -> Snapshot:
        """The manifest as the regions are now; taken under the lock."""
        doc = {
            "version": _MANIFEST_VERSION,
            "region_size": self.region_size,
            "regions": [{"state": r.state.value, "dataset": r.dataset, "vindex": r.vindex} for r in self._regions],
        }
        return self._manifest.snapshot(json.dumps(doc).encode())

    def _save(self, snapshot: Snapshot, *, strict: bool = False) -> None:
        """Write ``snapshot`` (or a newer one) as the manifest, outside the lock; a failure is logged
        and the pool goes on (see the module docstring), or with ``strict`` raised.

        Raises:
            StateFileError: with ``strict``, the manifest cannot be written.
        """
        with self._saving:
            try:
                self._manifest.write(snapshot)
            except StateFileError as exc:
                if strict:
                    raise
                if self._unsaved is None:
                    log.error(
                        "pool %s: %s; the manifest keeps its last version until it can be written",
                        self.directory,
                        exc,
                    )
                self._unsaved = exc
                return
            if self._unsaved is not None:
                log.info("pool %s: manifest written again", self.directory)
                self._unsaved = None


def _region_count(memory_bytes: int, region_size: int) -> int:
    page = mmap.PAGESIZE
    if region_size <= 0 or region_size % page:
        raise ConfigError(
            f"region size {region_size} must be a positive multiple of the page size {page}",
            field="server.region_size",
            value=region_size,
        )
    count = memory_bytes // region_size
    if count < 1:
        raise ConfigError(
            f"pool memory {memory_bytes} bytes is smaller than one region of {region_size} bytes",
            field="server.memory",
            value=memory_bytes,
        )
    return count


def _file_ok(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _read_manifest(directory: Path) -> dict | None:
    try:
        with open(directory / MANIFEST_NAME, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("version") != _MANIFEST_VERSION or not isinstance(doc.get("regions"), list):
            raise ValueError("unknown manifest version")
        for entry in doc["regions"]:
            RegionState(entry["state"])
        int(doc["region_size"])
        return doc
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("pool %s: ignoring unreadable manifest: %s", directory, exc)
        return None


def _remove_pool_files(directory: Path) -> None:
    for child in directory.iterdir():
        if (
            _REGION_RE.match(child.name)
            or child.name.startswith("ds-")
            or child.name in (MANIFEST_NAME, f".{MANIFEST_NAME}.tmp")
        ):
            child.unlink(missing_ok=True)


def discard_pool(directory: str | os.PathLike[str]) -> int:
    """Delete the files of the pool in ``directory`` (not mapped by any process: a server that is
    not running), and the directory once empty; returns the bytes they took."""
    path = Path(directory)
    if not path.is_dir():
        return 0
    freed = sum(child.stat().st_blocks * 512 for child in path.iterdir() if child.is_file())
    _remove_pool_files(path)
    with contextlib.suppress(OSError):
        path.rmdir()
    return freed
