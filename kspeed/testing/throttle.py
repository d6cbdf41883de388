"""A throttled fsspec file system: any file system, slowed like remote storage.

:class:`ThrottledFileSystem` wraps a target fsspec file system and adds a fixed **latency per
read request** (each open or whole-file read; requests in flight at once overlap their latencies,
as a store's do; the ranged reads of one ``cat_ranges`` call are in flight together), optionally one
per listing request (``ls``, ``info``), and a **bandwidth cap**
shared by every read through the instance (a token bucket:
readers take turns for the bytes they read, so the total never exceeds the cap). It counts the
requests and bytes it served. Tests, benchmarks and the analyzer stand it in for object storage:

- protocol ``slowfile`` wraps the local file system (paths are local paths, checked like
  ``file``'s by the allow-list), e.g. ``slowfile:///data/train``;
- protocol ``throttled`` wraps any protocol named by ``target_protocol`` (with ``target_options``).

Options come from the server's backend options, e.g.
``{"slowfile": {"latency": 0.005, "bandwidth": 100e6}}``; fsspec caches one instance per set of
options, so every reader of a server process shares one cap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

__all__ = ["Bucket", "ThrottledFileSystem"]


class Bucket:
    """A bandwidth cap: :meth:`take` returns once ``n`` more bytes fit under ``rate`` bytes/s.

    Callers take turns: each reserves the next ``n / rate`` seconds of the link and sleeps until
    its bytes would have arrived, outside the lock. ``rate`` 0 means no cap.
    """

    def __init__(self, rate: float) -> None:
        if rate < 0:
            raise ValueError(f"bandwidth {rate} must be >= 0 bytes/s (0: no cap)")
        self.rate = float(rate)
        self._free_at = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0 or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + n / self.rate
            until = self._free_at
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _ThrottledFile:
    """A file of the target file system whose reads pass the cap (everything else is the file's)."""

    def __init__(self, f: Any, fs: ThrottledFileSystem) -> None:
        self._f = f
        self._fs = fs

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._fs.charge(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        readinto = getattr(self._f, "readinto", None)
        if readinto is None:
            data = self._f.read(len(memoryview(buf)))
            memoryview(buf).cast("B")[: len(data)] = data
            got = len(data)
        else:
            got = readinto(buf) or 0
        self._fs.charge(got)
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _ThrottledFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class ThrottledFileSystem(AbstractFileSystem):
    """A target fsspec file system with ``latency`` seconds per request and ``bandwidth`` bytes/s.

    Args:
        latency: seconds each read request (open, ``cat_file``) waits before it is answered.
        bandwidth: bytes per second all reads share (0: no cap).
        list_latency: seconds each listing request (``ls``, ``info``) waits (default none: tests
            and benchmarks time reads, and a listing is made once).
        target_protocol: the wrapped file system's protocol (``file`` for ``slowfile``).
        target_options: its options (endpoint, credentials...).
        pause_every: every this many seconds (0: never) the store stops answering reads for
            ``pause`` seconds, as a store that throttles its callers (S3's SlowDown and the
            clients' back-off) or a failing-over front end does: a read that arrives during a
            pause waits until it ends, then its latency.
        pause: seconds each pause lasts.

    Raises:
        ValueError: a negative latency, bandwidth or pause, or a pause as long as its period.
    """

    protocol = ("throttled",)
    root_marker = ""
    #: Over a local target, paths are spoken as an object store's ("dir/key", no leading slash),
    #: so that ``throttled`` over the local file system stands for a bucket (``slowfile`` keeps
    #: local paths, checked as the local file system's).
    store_paths = True

    def __init__(
        self,
        latency: float = 0.005,
        bandwidth: float = 0.0,
        target_protocol: str = "file",
        target_options: Mapping[str, Any] | None = None,
        list_latency: float = 0.0,
        pause_every: float = 0.0,
        pause: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if latency < 0 or list_latency < 0:
            raise ValueError(f"latency {latency} and list_latency {list_latency} must be >= 0 seconds")
        if pause_every < 0 or pause < 0 or (pause_every and pause >= pause_every):
            raise ValueError(f"pause {pause} s every {pause_every} s: both >= 0, the pause shorter than its period")
        self.pause_every, self.pause = float(pause_every), float(pause)
        self._born = time.monotonic()
        self.latency = float(latency)
        self.list_latency = float(list_latency)
        self.bucket = Bucket(bandwidth)
        self.target = fsspec.filesystem(target_protocol, **dict(target_options or {}))
        self._rooted = self.store_paths and target_protocol in ("file", "local")
        self.requests = 0
        self.bytes_read = 0
        self._count = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        for name in ("throttled", "slowfile"):
            if path.startswith(f"{name}://"):
                return path[len(name) + 3 :]
        return path

    def _in(self, path: str) -> str:
        """The target's path for a path of ours."""
        return "/" + path.lstrip("/") if self._rooted else path

    def _out(self, entry: Any) -> Any:
        """A listing entry (a name, or an info dict) of the target, in our paths."""
        if not self._rooted:
            return entry
        if isinstance(entry, str):
            return entry.lstrip("/")
        return {**entry, "name": str(entry["name"]).lstrip("/")}

    def request(self, latency: float | None = None, count: int = 1) -> None:
        """``count`` requests in flight at once: count them and wait one latency (a read's, unless given)."""
        with self._count:
            self.requests += count
        wait = self.latency if latency is None else latency
        if self.pause_every and latency is None:  # reads wait out the store's pause they arrive in
            into = (time.monotonic() - self._born) % self.pause_every
            wait += max(self.pause - into, 0.0)
        if wait:
            time.sleep(wait)

    def charge(self, n: int) -> None:
        """Bytes read: count them and let them through the cap."""
        with self._count:
            self.bytes_read += n
        self.bucket.take(n)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.request(self.list_latency)
        return [self._out(e) for e in self.target.ls(self._in(path), detail=detail, **kwargs)]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self.request(self.list_latency)
        return self._out(self.target.info(self._in(path), **kwargs))

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        if mode != "rb":
            raise PermissionError(f"{self.protocol[0]}://{path}: read-only (mode {mode!r})")
        self.request()
        return _ThrottledFile(self.target.open(self._in(path), mode, block_size=block_size, **kwargs), self)

    def cat_ranges(
        self,
        paths: list[str],
        starts: list[int] | int | None,
        ends: list[int] | int | None,
        max_gap: int | None = None,
        on_error: str = "return",
        **kwargs: Any,
    ) -> list[Any]:
        """Ranged reads of several files in one call, as an object store's client makes them: all
        requests are in flight at once (one latency for the lot), and their bytes pass the cap."""
        self.request(count=len(paths))
        out = self.target.cat_ranges(
            [self._in(p) for p in paths], starts, ends, max_gap=max_gap, on_error=on_error, **kwargs
        )
        self.charge(sum(len(d) for d in out if isinstance(d, (bytes, bytearray, memoryview))))
        return list(out)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self.request()
        data = self.target.cat_file(self._in(path), start=start, end=end, **kwargs)
        self.charge(len(data))
        return bytes(data)


class SlowFileSystem(ThrottledFileSystem):
    """:class:`ThrottledFileSystem` over the local file system (protocol ``slowfile``)."""

    protocol = ("slowfile",)
    store_paths = False

    def __init__(
        self, latency: float = 0.005, bandwidth: float = 0.0, list_latency: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(latency, bandwidth, "file", None, list_latency, **kwargs)


fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)
fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)
