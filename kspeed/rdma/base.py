"""The data-plane seam: registered regions, one-sided writes with immediates, completions.

A **receiver** owns memory and listens; a **writer** dials it and writes. In KSpeed the training
process is the receiver (its receive ring) and servers are writers::

    rail = get_rail("shm")                                  # kspeed.rdma.rails
    rx = rail.listen(options)                               # receiver side
    ring = rx.register(64 << 20)                            # Region: memfd-backed ring
    blob = rx.material                                      # -> control plane -> server
    key = ring.key.slice(offset, length)                    # a grant, sent as key.to_bytes()
    wr = rail.connect(blob, options)                        # writer side, once per peer
    wr.write(key, [header, payload], offset=0, imm=7)       # gathered write + one completion
    wr.write_many(key, [(src, off, imm), ...])              # many writes, one notification syscall
    wr.write_batch(key, pool, src_offs, lens, dst_offs, imms)  # arrays: checked in numpy, copied in C
    done = rx.poll(timeout=1.0)                             # Completions(imm=array, conn=array)
    rx.send(done.conn[0], b"grant ...") / wr.recv(timeout)  # small messages, both directions

Contract every rail keeps (the conformance suite in ``tests/conformance`` checks it):

* a write lands byte-exact at ``key.addr + offset``; a write outside ``[0, key.length)`` raises
  :class:`RangeError` on the writer and sends nothing; the receiver also refuses it;
* an immediate raises exactly one completion, after every byte of its write is visible to the
  receiver; completions carry the writer's connection id;
* messages travel beside the bulk path and never wait behind bulk bytes;
* a dead, hung or unreachable peer becomes :class:`PeerLostError` within ``io_timeout``;
* connections are authenticated (``kspeed.rdma.auth``) before any region is exposed.

How ``verbs`` fits behind the same classes: :meth:`Rail.register` is ``ibv_reg_mr`` (local
access for writer pools; ``LOCAL_WRITE|REMOTE_WRITE`` for rings, per connected server so that
fencing one server deregisters only its MR); the :class:`RegionKey` carries ``handle = rkey`` and
``addr =`` the virtual address (or GPU IOVA) of the region, and the NIC enforces the range exactly
as :meth:`RegionKey.slice` narrows it here. :attr:`Receiver.material` is the QPN, GID, PSN and
MTU of a fresh RC QP plus the handshake nonce; :meth:`Rail.connect` moves the writer's QP through
INIT/RTR/RTS and returns its own material through the small-message exchange. ``write`` posts
``IBV_WR_RDMA_WRITE_WITH_IMM`` (``RDMA_WRITE`` without an immediate) with one SGE per source
slice (lkeys found by address in the registered pools); ``write_many`` chains the work requests
into one ``ibv_post_send``. ``write_batch`` is the same chain built straight from its arrays, with
no Python object per op: WR ``i`` is an ``RDMA_WRITE`` of ``lengths[i]`` bytes from
``source_addr + src_offsets[i]`` (the source's lkey, found once per batch) to
``key.addr + dst_offsets[i]`` with ``key.handle`` as rkey; the last WR carries the first immediate
(``RDMA_WRITE_WITH_IMM``) and each further immediate is a zero-length ``RDMA_WRITE_WITH_IMM``
chained after it, so RC ordering makes every completion follow every byte of the batch.
:meth:`Receiver.poll` drains the receive CQ (``imm_data`` and the
QP number mapped to a connection id) after refilling the shared receive queue; messages are
``SEND``/``RECV`` on the same QP or a second QP. A UCX/NIXL rail maps the same way (``ucp_put``
plus an active message for the immediate, rkeys packed into the material).

The region types (:class:`RegionKey`, :class:`Region`, :class:`Memory`, the buffer aliases) are
defined in :mod:`kspeed.rdma.regions`, below both this seam and :mod:`kspeed.rdma.write_batch`,
and re-exported here as part of the seam.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .device_memory import DeviceMemory

from kspeed.errors import RailUnavailableError, RangeError, TransportError

from .options import RailOptions
from .regions import Buffer, Ints, Memory, Region, RegionKey, as_bytes_view
from .write_batch import WriteBatch, check_batch, source_array

__all__ = [
    "MAX_MESSAGE",
    "Buffer",
    "Completions",
    "Ints",
    "Memory",
    "Rail",
    "RailCapabilities",
    "Receiver",
    "Region",
    "RegionKey",
    "Sources",
    "WriteOp",
    "Writer",
    "as_bytes_view",
]

#: Largest small message (grant, credit, reply) in bytes.
MAX_MESSAGE = 64 * 1024

#: One buffer, or a list of buffers gathered in order into one contiguous destination range.
Sources = Buffer | list[Buffer] | tuple[Buffer, ...]
#: ``(sources, offset, immediate or None)``.
WriteOp = tuple[Sources, int, int | None]


_U32 = 1 << 32


@dataclass(frozen=True)
class Completions:
    """Completions gathered by one :meth:`Receiver.poll`, in arrival order per writer.

    Attributes:
        imm: ``uint32`` immediates.
        conn: ``uint32`` connection id of the writer of each immediate.
    """

    imm: np.ndarray
    conn: np.ndarray

    def __len__(self) -> int:
        return len(self.imm)

    @staticmethod
    def empty() -> Completions:
        return Completions(np.empty(0, np.uint32), np.empty(0, np.uint32))

    @staticmethod
    def concat(parts: list[Completions]) -> Completions:
        if not parts:
            return Completions.empty()
        if len(parts) == 1:
            return parts[0]
        return Completions(np.concatenate([p.imm for p in parts]), np.concatenate([p.conn for p in parts]))


def check_imm(imm: int | None) -> None:
    """Refuse immediates that do not fit in 32 bits."""
    if imm is not None and not 0 <= imm < _U32:
        raise TransportError(f"immediate {imm!r} does not fit in 32 bits")


def check_range(key: RegionKey, offset: int, nbytes: int) -> None:
    """Writer-side guard: ``[offset, offset + nbytes)`` must lie inside ``key``."""
    if offset < 0 or offset + nbytes > key.length:
        raise RangeError(
            f"write of {nbytes} bytes at offset {offset} outside granted range of {key.length} bytes "
            f"(region {key.handle} on {key.node})"
        )


class Receiver(ABC):
    """The side that owns regions, listens for writers and collects their completions."""

    rail: str

    @abstractmethod
    def register(self, nbytes: int) -> Region:
        """Allocate and register a shared-memory region (a receive ring) writers may write into."""

    def register_device(self, memory: DeviceMemory) -> Region:
        """Register a device ring (GPU memory exported as a dma-buf) writers may write into; its
        key addresses it from 0. Only rails whose capabilities say ``device_memory`` can.

        Raises:
            RailUnavailableError: this rail cannot write into device memory.
        """
        raise RailUnavailableError(f"rail {self.rail} cannot write into device memory (no GPUDirect)")

    @property
    @abstractmethod
    def material(self) -> bytes:
        """Opaque connection material to hand to writers over the control plane."""

    @abstractmethod
    def poll(self, timeout: float | None = 0.0) -> Completions:
        """Return the completions that arrived, waiting up to ``timeout`` s for the first one.

        ``timeout=0`` never blocks; ``None`` waits until something arrives. Small messages that
        arrive meanwhile are kept for :meth:`messages`.

        Raises:
            PeerLostError: a writer died, stalled mid-write or broke the protocol; the error's
                ``conn`` attribute names it. Completions gathered before the loss are returned
                first; the error is raised by the next call.
        """

    @abstractmethod
    def messages(self) -> list[tuple[int, bytes]]:
        """Small messages from writers received so far, as ``(conn, payload)``; drains them."""

    @abstractmethod
    def send(self, conn: int, message: bytes) -> None:
        """Send a small message (a grant, a credit) to writer ``conn``."""

    @property
    @abstractmethod
    def connections(self) -> frozenset[int]:
        """Ids of the writers currently connected."""

    @property
    def helper_pids(self) -> tuple[int, ...]:
        """Processes doing this receiver's I/O (the ``tcp`` receiver process), so callers can pin them."""
        return ()

    @abstractmethod
    def disconnect(self, conn: int) -> None:
        """Cut writer ``conn`` off (fencing); its later writes fail and it gets no completions."""

    def writer_gone(self, conn: int) -> bool:
        """Whether no write of writer ``conn`` can land in the regions any more, so a range it was
        granted may be handed out again. A rail that revokes writers (the receiver does every copy,
        or deregisters the memory) says so once ``conn`` is disconnected; one whose writers map the
        regions themselves must also know they no longer do."""
        return conn not in self.connections

    @abstractmethod
    def close(self) -> None:
        """Drop every connection and release every region and helper."""

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Writer(ABC):
    """The side that writes into a receiver's regions."""

    rail: str
    #: The id the receiver sees in completions and messages from this writer.
    conn: int

    @abstractmethod
    def write(self, key: RegionKey, srcs: Sources, offset: int = 0, imm: int | None = None) -> None:
        """Write ``srcs`` (gathered, in order) at ``key.addr + offset``; notify ``imm`` after the bytes.

        Raises:
            RangeError: the write does not fit the key; nothing was sent.
            PeerLostError: the receiver is gone or stalled for ``io_timeout``.
        """

    @abstractmethod
    def write_many(self, key: RegionKey, ops: Iterable[WriteOp]) -> None:
        """Issue many writes; their immediates are notified together after all their bytes.

        The whole batch is range-checked before any byte is written.
        """

    def write_batch(
        self,
        key: RegionKey,
        source: Region | Memory | Buffer,
        src_offsets: Ints,
        lengths: Ints,
        dst_offsets: Ints,
        imms: Ints | None = None,
    ) -> None:
        """Write many slices of one source into ``key``, described by arrays; the fast path.

        Op ``i`` copies ``lengths[i]`` bytes from ``source[src_offsets[i]:]`` to
        ``key.addr + dst_offsets[i]``. The whole batch is range-checked with numpy before a byte
        moves (:func:`kspeed.rdma.write_batch.check_batch`); then the immediates are notified in order,
        each exactly once, after every byte of the batch is visible to the receiver.

        Args:
            key: the granted destination range.
            source: a registered region, a ``uint8`` array (e.g. over a server's pool mapping) or
                any C-contiguous buffer; its base address is taken once per batch.
            src_offsets: ``int64`` offsets into ``source``, one per op.
            lengths: ``int64`` byte counts, one per op (or one int for every op).
            dst_offsets: ``int64`` offsets into ``key``'s range, one per op.
            imms: ``uint32`` immediates raised after the batch (any number; ``None`` for none).

        Raises:
            RangeError: an op lies outside ``source`` or ``key`` (the message names the first);
                nothing was written.
            PeerLostError: the receiver is gone or stalled for ``io_timeout``.
        """
        src = source_array(source)
        self.write_checked(key, src, check_batch(key, src.nbytes, src_offsets, lengths, dst_offsets, imms))

    @abstractmethod
    def write_checked(self, key: RegionKey, source: np.ndarray, batch: WriteBatch) -> None:
        """Write a batch that :meth:`write_batch` checked against ``source`` and ``key``; the rail's hot loop."""

    @abstractmethod
    def send(self, message: bytes) -> None:
        """Send a small message to the receiver (never queued behind bulk data)."""

    @abstractmethod
    def recv(self, timeout: float | None = 0.0) -> bytes | None:
        """Next small message from the receiver, or ``None`` if none came within ``timeout`` s."""

    @abstractmethod
    def fileno(self) -> int:
        """The descriptor that turns readable when a message, or the receiver's end, arrives.

        For waiting on many writers with one poller (:class:`kspeed.server.feeder.doorbell.Doorbell`);
        only :meth:`recv` reads from it.
        """

    @abstractmethod
    def close(self) -> None:
        """Close the connection and unmap whatever was mapped.

        Only the thread that writes may close: a write in progress in another thread would touch
        released memory. To stop a writing thread, call :meth:`interrupt` and let it close.
        """

    @abstractmethod
    def interrupt(self) -> None:
        """Make I/O blocked in another thread fail soon with :class:`PeerLostError`, releasing nothing.

        Safe from any thread, any number of times; the writing thread then closes the writer.
        """

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class RailCapabilities:
    """What a rail can do. Every choice or listing of rails derives from these, never from names.

    Attributes:
        host_local: writer and receiver must run on one host (a shared-memory rail).
        needs_pacing: writes cross a network link that many writers at once can overrun (incast),
            so a receiver paces its grants (docs/feeding.md, Pacing).
        revokes_writer: the receiver can cut one writer's access to its regions while that writer
            lives (a closed socket, a deregistered memory region), so a fenced range may be reused
            once the cut is done; a rail that cannot (a writer keeps its mapping) quarantines it.
        device_memory: can write straight into GPU memory (GPUDirect).
        preference: among the rails that reach every server of a feed, the highest is chosen.
    """

    host_local: bool
    needs_pacing: bool
    revokes_writer: bool
    device_memory: bool
    preference: int


class Rail(ABC):
    """A transport: makes receivers and writers of one kind.

    Attributes:
        name: the rail's name in the registry, in connection material and in region keys.
        capabilities: what it can do (how it is chosen and paced).
        receiver: makes its receivers from the rail options.
        writer: makes its writers from a receiver's connection material and the rail options.
    """

    name: str
    capabilities: RailCapabilities
    receiver: Callable[[RailOptions], Receiver]
    writer: Callable[[bytes, RailOptions], Writer]

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """Why this rail cannot be used on this host, or ``None`` if it can."""

    def listen(self, options: RailOptions) -> Receiver:
        """Start a receiver; publish its :attr:`Receiver.material` to writers."""
        return self.receiver(options)

    def connect(self, material: bytes, options: RailOptions) -> Writer:
        """Dial a receiver described by ``material`` and authenticate."""
        return self.writer(material, options)

    def register(self, nbytes: int) -> Region:
        """Allocate page-aligned host memory registered as a write source (a server pool)."""
        from .memory import HostBuffer

        memory = HostBuffer(nbytes)
        return Region(RegionKey(self.name, "local", 0, 0, nbytes), memory)
