"""Shared helpers of the benchmarks: machine description and the machine's own limits.

Every benchmark reports its figures next to limits measured in the same run (one-core memcpy from
a pool far larger than the caches, a raw loopback socket stream between two processes and, for
delivery into GPU memory, the host-to-device copy bandwidth from page-locked memory), so a result
reads as a ratio that survives a change of machine.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import sys
import time

import numpy as np

__all__ = [
    "GIB",
    "KIB",
    "MIB",
    "h2d_gbps",
    "machine_info",
    "memcpy_gbps",
    "pyplot",
    "random_starts",
    "socket_gbps",
    "write_files",
    "write_json",
]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """CPU model, cores, RAM, kernel and Python of this machine."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = None
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_bytes": ram,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "hostname": socket.gethostname(),
    }


def random_starts(pool_bytes: int, size: int, count: int, seed: int = 0, align: int = 4096) -> np.ndarray:
    """``count`` random, ``align``-aligned start offsets of ``size``-byte slices inside the pool."""
    rng = np.random.default_rng(seed)
    slots = max(1, (pool_bytes - size) // align)
    return rng.integers(0, slots, size=count, dtype=np.int64) * align


def memcpy_gbps(pool: np.ndarray, size: int = MIB, seconds: float = 1.0) -> float:
    """One-core memcpy bandwidth (GB/s) copying ``size``-byte slices drawn at random from ``pool``."""
    dst = np.empty(size, np.uint8)
    starts = random_starts(len(pool), size, 4096, seed=1).tolist()
    done = 0
    t0 = time.perf_counter()
    while True:
        for s in starts[:64]:
            dst[:] = pool[s : s + size]
        done += 64 * size
        starts = starts[64:] + starts[:64]
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return done / elapsed / 1e9


def h2d_gbps(size: int = 64 * MIB, seconds: float = 1.0, pool_bytes: int = GIB) -> float:
    """Host-to-device copy bandwidth (GB/s) of the current CUDA device from page-locked memory.

    ``size``-byte slices of a ``pool_bytes`` pinned tensor are copied in turn (``non_blocking``, on
    the current stream) into one device buffer; the clock stops after the ``torch.cuda.synchronize()``
    that ends each pass over the pool, so every byte counted has arrived. The pinned pool is freed
    and the host allocator's cache emptied before returning.
    """
    import torch

    try:
        pool = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
        pool.fill_(0x5A)  # resident before the clock starts
        return _h2d_passes(pool, size, seconds)
    finally:
        pool = None  # (dropped before the cache is emptied, so its block goes back to the system)
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:  # torch >= 2.9; older versions keep the pinned pool cached
            empty_host_cache()


def _h2d_passes(pool, size: int, seconds: float) -> float:
    """Whole passes of ``size``-byte copies over ``pool`` to the device until ``seconds`` have passed."""
    import torch

    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    slices = [pool[s : s + size] for s in range(0, len(pool) - size + 1, size)]
    for src in slices[:4]:  # warm-up: the copy engine's and the driver's first-use costs
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    done = 0
    t0 = time.perf_counter()
    while True:
        for src in slices:
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        done += len(slices) * size
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return done / elapsed / 1e9


def _sink(port: int, ring_bytes: int, queue) -> None:
    """Receive into a ring of ``ring_bytes`` (wrapping), as large a ``recv_into`` as the ring allows."""
    sock = socket.create_connection(("127.0.0.1", port))
    ring = memoryview(bytearray(ring_bytes))
    ring[:] = b"\0" * ring_bytes  # resident before the clock starts
    total = pos = 0
    t0 = None
    while True:
        n = sock.recv_into(ring[pos:])
        if n == 0:
            break
        if t0 is None:
            t0 = time.perf_counter()
        total += n
        pos = (pos + n) % ring_bytes
    queue.put((total, time.perf_counter() - (t0 or time.perf_counter())))


def socket_gbps(
    seconds: float = 1.0, pool: memoryview | None = None, size: int = MIB, ring_bytes: int = MIB, batch: int = 1
) -> float:
    """Raw loopback TCP stream (GB/s) from this process to a spawned reader process.

    With ``pool=None`` one hot ``size``-byte buffer is sent over and over into a ``ring_bytes``
    buffer (both stay in cache): the socket's best case. With a pool, each ``sendmsg`` gathers
    ``batch`` slices of ``size`` bytes drawn at random from it, and the reader receives into a ring
    of ``ring_bytes``: the same memory traffic as a rail writing from that pool into that ring, so
    the ratio of the two measures the rail and not the caches. Both ends use the kernel's default
    (autotuned) socket buffers, as the rail does.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    listener = socket.create_server(("127.0.0.1", 0))
    proc = ctx.Process(target=_sink, args=(listener.getsockname()[1], ring_bytes, queue))
    proc.start()
    conn, _ = listener.accept()
    listener.close()
    if pool is None:
        slices = [[memoryview(bytearray(os.urandom(size)))] * batch]
    else:
        starts = random_starts(len(pool), size, 8192, seed=2).tolist()
        flat = [pool[s : s + size] for s in starts]
        slices = [flat[i : i + batch] for i in range(0, len(flat) - batch + 1, batch)]
    total = size * batch
    t0 = time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
        bufs = slices[i % len(slices)]
        i += 1
        sent = conn.sendmsg(bufs)
        if sent < total:  # blocking socket: only a signal stops it short; send the rest
            conn.sendall(b"".join(bytes(b) for b in bufs)[sent:])
    conn.close()
    got, elapsed = queue.get()
    proc.join()
    del slices
    return got / elapsed / 1e9


def write_files(root, count: int, lo: int, hi: int, seed: int = 0) -> int:
    """Write ``count`` random files of ``lo..hi`` bytes in ten folders under ``root`` (a
    ``pathlib.Path``); returns their total bytes."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lo, hi + 1, count)
    blob = rng.bytes(int(hi))
    for i, n in enumerate(sizes.tolist()):
        folder = root / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.bin").write_bytes(blob[:n])
    return int(sizes.sum())


def pyplot():
    """matplotlib's ``pyplot`` on the file-only Agg backend, or ``None`` (said on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart", file=sys.stderr)
        return None
    return plt


def write_json(path: str | None, doc: dict) -> None:
    """Write ``doc`` as indented JSON to ``path`` (stdout when ``None``)."""
    text = json.dumps(doc, indent=2)
    if path is None:
        print(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def stop_on_sigterm() -> None:
    """Make SIGTERM (a scheduler's, ``timeout``'s) unwind like Ctrl-C: every ``finally`` and context
    manager on the way out stops its daemons and removes its files, where the default would end the
    process with them left behind."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
