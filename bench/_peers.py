"""The peers KSpeed is compared with, each as a source for :mod:`_loop`.

- ``DataLoaderSource``: a plain ``torch.utils.data.DataLoader`` over the files (page cache warm);
  with ``device="cuda"``, the usual recipe for a GPU: ``pin_memory=True`` and each batch moved with
  ``.to("cuda", non_blocking=True)``.
- ``RedisServer`` + ``RedisSource``: a pull cache of the same samples in a private ``redis-server``
  (no persistence), read with pipelined GETs per batch and hiredis parsing: the Alluxio-like baseline.
- ``GrpcPullSource``: KSpeed's own ``Read`` RPC, packed (one call per server and batch, split
  below the message limit) with several batches in flight from a thread pool: a fair pull.

Every source shuffles each epoch with a seed derived from the epoch, like a ``RandomSampler``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch
from _datasets import SampleSet
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from kspeed.control.rpc import channel_options
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc

if TYPE_CHECKING:
    import redis

__all__ = ["DataLoaderSource", "GrpcPullSource", "RedisServer", "RedisSource"]

# Pulled bytes arrive as immutable ``bytes``; the loop only reads them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

READ_CALL_BYTES = 16 << 20  # bytes per Read call: well below the 64 MiB message limit, several per batch
PULL_DEPTH = 4  # batches in flight for the gRPC pull ...
PULL_BYTES = 128 << 20  # ... or fewer, so that at most about this many bytes are in flight
REDIS_LOAD_BYTES = 64 << 20  # bytes per pipelined SET round while loading


@dataclass
class PulledBatch:
    """A batch as the peers hand it to the loop (KSpeed's batches have the same fields)."""

    ids: np.ndarray
    samples: list[torch.Tensor]
    labels: torch.Tensor
    extra: dict = field(default_factory=dict)

    def release(self) -> None:
        """Nothing to give back: the tensors own their memory."""


def epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled sample IDs of one epoch."""
    return np.random.default_rng((seed, epoch)).permutation(count)


# ---- DataLoader ------------------------------------------------------------------------------


class FileDataset(Dataset):
    """Map-style dataset: sample ``i`` is the bytes of file ``i`` in a uint8 tensor, with its label."""

    def __init__(self, paths: list[str], sizes: np.ndarray, labels: np.ndarray) -> None:
        self.paths, self.sizes, self.labels = paths, sizes.tolist(), labels.tolist()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, int]:
        out = torch.empty(self.sizes[i], dtype=torch.uint8)
        with open(self.paths[i], "rb", buffering=0) as fh:
            fh.readinto(out.numpy())  # one copy, page cache -> tensor
        return i, out, self.labels[i]


def collate_list(items: list[tuple[int, torch.Tensor, int]]) -> PulledBatch:
    """Samples stay a list of tensors (as KSpeed's ``batch.samples``); IDs and labels are collated."""
    ids, samples, labels = zip(*items)
    return PulledBatch(np.asarray(ids), list(samples), default_collate(list(labels)))


class PackedBatch:
    """A batch packed in one tensor (shared memory when it crossed from a worker, page-locked once
    pinned, or on a GPU once moved); ``samples`` are views of it."""

    def __init__(self, ids: np.ndarray, packed: torch.Tensor, lengths: list[int], labels: torch.Tensor) -> None:
        self.ids, self.packed, self.lengths, self.labels = ids, packed, lengths, labels

    @property
    def samples(self) -> list[torch.Tensor]:
        return list(torch.split(self.packed, self.lengths))

    def pin_memory(self) -> PackedBatch:
        """The batch copied into page-locked memory (what ``DataLoader(pin_memory=True)`` calls)."""
        return PackedBatch(self.ids, self.packed.pin_memory(), self.lengths, self.labels)

    def to(self, device: str, non_blocking: bool = False) -> PackedBatch:
        """The batch on ``device``: one copy of the packed tensor (labels stay, as KSpeed's do)."""
        return PackedBatch(self.ids, self.packed.to(device, non_blocking=non_blocking), self.lengths, self.labels)

    def release(self) -> None:
        """Nothing to give back: the views keep the packed tensor alive."""


def collate_packed(items: list[tuple[int, torch.Tensor, int]]) -> PackedBatch:
    """Copy a batch into one tensor, as ``default_collate`` stacks equal-size tensors: in a worker
    into shared memory, in the main process into ordinary memory.

    Sent one by one, every sample tensor gets its own shared-memory segment and file descriptor
    on its way to the main process, which costs ~0.6 ms a sample on the reference machine: a
    strawman at 32 KiB. One segment per batch is what ``default_collate`` itself does.
    """
    ids, samples, labels = zip(*items)
    lengths = [len(t) for t in samples]
    if get_worker_info() is not None:
        # As default_collate does: allocate straight in shared memory (share_memory_() would copy, 4x slower).
        packed = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(sum(lengths)))
    else:
        packed = torch.empty(sum(lengths), dtype=torch.uint8)
    torch.cat(samples, out=packed)
    return PackedBatch(np.asarray(ids), packed, lengths, default_collate(list(labels)))


class DataLoaderSource:
    """A ``DataLoader`` with ``num_workers`` workers (persistent, so epochs do not respawn them).

    On the host (``device=None``), without workers a batch is the list of sample tensors; with
    workers it crosses to the main process packed in one shared-memory tensor (:func:`collate_packed`).

    With a ``device`` (``"cuda"``), what a competent user does to feed a GPU: every batch is packed
    in one tensor (also without workers: one copy per batch, where a copy per sample would cost a
    launch each, ~64 per batch), ``pin_memory=True`` has the loader copy it into page-locked memory
    (in its pinning thread with workers, inline without), and ``next()`` moves it with ONE
    ``.to(device, non_blocking=True)`` on the current stream; the samples are views (splits) of the
    device tensor. The copy is asynchronous: the loop's touch of the samples waits for it, as a
    training step would. Labels stay on the host, as KSpeed's do.

    Args:
        samples: the sample set.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        seed: seed of the shuffle.
        device: ``None`` for host batches, or the device each batch is moved to.
    """

    def __init__(
        self, samples: SampleSet, batch_size: int, num_workers: int, seed: int = 0, device: str | None = None
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.device = device
        self.loader = DataLoader(
            FileDataset(samples.paths, samples.sizes, samples.labels),
            batch_size=batch_size,
            shuffle=True,
            generator=generator,
            num_workers=num_workers,
            collate_fn=collate_packed if num_workers or device else collate_list,
            pin_memory=device is not None,
            persistent_workers=num_workers > 0,
        )

    def epoch(self, epoch: int):
        if self.device is None:
            return self.loader
        batches = iter(self.loader)  # started here, as the host loader's iterator is, not in the first next()
        return (batch.to(self.device, non_blocking=True) for batch in batches)

    def close(self) -> None:
        # Persistent workers stop when the loader and its iterator are collected: now, not at exit.
        self.loader = None


# ---- Redis -----------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A private ``redis-server`` on a free loopback port, without persistence; ``stop()`` ends it."""

    def __init__(self, binary: str = "redis-server") -> None:
        self.binary = shutil.which(binary) or binary
        self.dir = tempfile.mkdtemp(prefix="kspeed-bench-redis-")
        self.process: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING (retrying once on a port race)."""
        import redis  # here, not at import: the benchmark runs without the Redis client (GPU machines)

        for _ in range(3):
            self.port = free_port()
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self.dir,
                    "--protected-mode",
                    "yes",
                    "--loglevel",
                    "warning",
                    "--logfile",
                    "",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.process.poll() is None:
                with contextlib.suppress(redis.ConnectionError):
                    if self.client().ping():
                        return self
                time.sleep(0.05)
            self.stop()
        raise RuntimeError(f"{self.binary} did not start on loopback")

    def client(self) -> redis.Redis:
        """A client of this server (hiredis parses replies when installed)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)

    def load(self, samples: SampleSet) -> None:
        """Drop what the server holds and SET every sample under key ``s:<id>``, in pipelined rounds."""
        conn = self.client()
        try:
            conn.flushall()
            pipe = conn.pipeline(transaction=False)
            pending = 0
            for i, path in enumerate(samples.paths):
                with open(path, "rb") as fh:
                    pipe.set(f"s:{i}", fh.read())
                pending += int(samples.sizes[i])
                if pending >= REDIS_LOAD_BYTES:
                    pipe.execute()
                    pending = 0
            pipe.execute()
        finally:
            conn.close()

    def stop(self) -> None:
        """Terminate the server and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisSource:
    """Pull each batch from Redis: one pipelined round of GETs, parsed by hiredis, in ``next()``."""

    def __init__(self, server: RedisServer, samples: SampleSet, batch_size: int, seed: int = 0) -> None:
        self.client = server.client()
        self.count, self.labels, self.batch_size, self.seed = samples.count, samples.labels, batch_size, seed
        self.keys = [f"s:{i}" for i in range(samples.count)]

    def _get_many(self, ids: np.ndarray) -> list[bytes]:
        conn = self.client.connection_pool.get_connection("GET")
        try:
            conn.send_packed_command(conn.pack_commands([("GET", self.keys[i]) for i in ids.tolist()]))
            return [conn.read_response() for _ in range(len(ids))]
        finally:
            self.client.connection_pool.release(conn)

    def epoch(self, epoch: int):
        order = epoch_order(self.count, self.seed, epoch)
        for start in range(0, len(order), self.batch_size):
            ids = order[start : start + self.batch_size]
            values = self._get_many(ids)
            yield PulledBatch(
                ids, [torch.frombuffer(v, dtype=torch.uint8) for v in values], torch.from_numpy(self.labels[ids])
            )

    def close(self) -> None:
        self.client.close()


# ---- gRPC pull ---------------------------------------------------------------------------------


class GrpcPullSource:
    """Pull batches with the servers' ``Read`` RPC, up to ``PULL_DEPTH`` batches ahead of the loop.

    Each batch is split by owner (the shares' contiguous ID ranges) and, within an owner, into
    calls of at most ``READ_CALL_BYTES``; a pool thread issues the calls of a batch and cuts the
    replies into per-sample tensors (views of the reply buffer), so the loop only reorders them.
    """

    def __init__(self, info: kspeed_pb2.DatasetInfo, samples: SampleSet, batch_size: int, seed: int = 0) -> None:
        self.name = info.spec.name
        shares = sorted(info.shares, key=lambda s: s.first_id)
        self.bounds = np.array([s.end_id for s in shares], dtype=np.int64)
        self.channels = [
            grpc.insecure_channel(info.server_addresses[s.server_id], options=channel_options()) for s in shares
        ]
        self.stubs = [kspeed_pb2_grpc.ServerStub(c) for c in self.channels]
        self.sizes, self.labels, self.count = samples.sizes, samples.labels, samples.count
        self.batch_size, self.seed = batch_size, seed
        self.depth = max(2, min(PULL_DEPTH, PULL_BYTES // (batch_size * int(samples.sizes.max()))))
        self.pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="pull")

    def _calls(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(server index, batch positions) of each Read call of a batch."""
        owner = np.searchsorted(self.bounds, ids, side="right")
        calls = []
        for server in np.unique(owner).tolist():
            positions = np.flatnonzero(owner == server)
            cut = np.cumsum(self.sizes[ids[positions]]) // READ_CALL_BYTES
            for part in np.unique(cut).tolist():
                calls.append((server, positions[cut == part]))
        return calls

    def _fetch(self, ids: np.ndarray) -> PulledBatch:
        samples: list[torch.Tensor | None] = [None] * len(ids)
        futures = [
            (
                positions,
                self.stubs[server].Read.future(
                    kspeed_pb2.ReadRequest(dataset=self.name, ids=ids[positions].astype("<i8").tobytes()), timeout=60
                ),
            )
            for server, positions in self._calls(ids)
        ]
        for positions, future in futures:
            reply = future.result()
            lengths = np.frombuffer(reply.lengths, "<u4").tolist()
            parts = torch.split(torch.frombuffer(reply.data, dtype=torch.uint8), lengths)
            for pos, part in zip(positions.tolist(), parts):
                samples[pos] = part
        return PulledBatch(ids, samples, torch.from_numpy(self.labels[ids]))

    def epoch(self, epoch: int):
        order = epoch_order(self.count, self.seed, epoch)
        batches = (order[s : s + self.batch_size] for s in range(0, len(order), self.batch_size))
        inflight: deque = deque()
        try:
            for ids in batches:
                inflight.append(self.pool.submit(self._fetch, ids))
                if len(inflight) >= self.depth:
                    yield inflight.popleft().result()
            while inflight:
                yield inflight.popleft().result()
        finally:
            for future in inflight:
                future.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for channel in self.channels:
            channel.close()
