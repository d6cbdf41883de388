"""Regions and their keys: the memory a rail writes into and how a writer addresses it.

The data-plane seam (:mod:`kspeed.rdma.base`, which re-exports every name here) and the batch
checks (:mod:`kspeed.rdma.write_batch`) both take these types, and the seam's
``Writer.write_batch`` calls the batch checks: kept in the seam, the two modules would import each
other. No process of its own runs this module: it is loaded wherever a rail is, in the training
process (rings), the servers' feeders (pools, granted keys) and the receiver processes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kspeed.errors import RangeError, TransportError

__all__ = ["Buffer", "Ints", "Memory", "Region", "RegionKey", "as_bytes_view"]

#: A C-contiguous buffer a write's bytes come from.
Buffer = bytes | bytearray | memoryview | np.ndarray
#: Per-op integers of a batch (an array, a sequence, or one int for every op).
Ints = npt.ArrayLike


class Memory(Protocol):
    """What owns a region's bytes (``HostBuffer``, ``MemfdSegment``, a device allocation)."""

    @property
    def view(self) -> memoryview:
        """The bytes (no copy)."""

    def array(self) -> np.ndarray:
        """The bytes as a ``uint8`` array (no copy)."""

    def close(self) -> None:
        """Release the memory (deferred while views are alive)."""


@dataclass(frozen=True)
class RegionKey:
    """What a writer needs to address a remote region; serializable, no secret inside.

    Attributes:
        rail: the rail that registered the region.
        node: host (or device) that owns the region.
        handle: the receiver's id of the region (the rkey on ``verbs``).
        addr: remote address of byte 0 of this key's range (an offset on ``shm``/``tcp``; a
            virtual address or IOVA on ``verbs``).
        length: bytes covered by this key, starting at ``addr``.
    """

    rail: str
    node: str
    handle: int
    addr: int
    length: int

    def __post_init__(self) -> None:
        for name in ("handle", "addr", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise TransportError(f"region key field {name} must be a non-negative integer, got {value!r}")

    def slice(self, offset: int, length: int) -> RegionKey:
        """A narrower key for ``[offset, offset + length)`` of this one (a grant).

        Raises:
            RangeError: the sub-range does not lie inside this key.
        """
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RangeError(f"sub-range [{offset}, {offset + length}) outside region key of {self.length} bytes")
        return RegionKey(self.rail, self.node, self.handle, self.addr + offset, length)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegionKey:
        """Rebuild a key from :meth:`to_dict` output.

        Raises:
            TransportError: a field is missing or malformed.
        """
        try:
            return cls(str(data["rail"]), str(data["node"]), data["handle"], data["addr"], data["length"])
        except (KeyError, TypeError) as exc:
            raise TransportError(f"malformed region key {data!r}: {exc}") from exc

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> RegionKey:
        """Rebuild a key from :meth:`to_bytes` output.

        Raises:
            TransportError: the blob is not a region key.
        """
        try:
            data = json.loads(blob)
        except (ValueError, UnicodeDecodeError) as exc:
            raise TransportError(f"malformed region key: {exc}") from exc
        if not isinstance(data, dict):
            raise TransportError("malformed region key: not an object")
        return cls.from_dict(data)


class Region:
    """A registered local buffer and the key that describes it to peers.

    Args:
        key: the region's key (whole region).
        memory: the object owning the memory.
    """

    def __init__(self, key: RegionKey, memory: Memory) -> None:
        self.key = key
        self.memory = memory

    @property
    def view(self) -> memoryview:
        """The region's bytes (no copy)."""
        return self.memory.view

    def array(self) -> np.ndarray:
        """The region as a ``uint8`` array (no copy)."""
        return self.memory.array()

    def close(self) -> None:
        self.memory.close()


def as_bytes_view(src: Buffer) -> memoryview:
    """A flat byte view of a C-contiguous buffer (no copy)."""
    view = src.data if isinstance(src, np.ndarray) else src if isinstance(src, memoryview) else memoryview(src)
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise TransportError(f"write source must be C-contiguous: {exc}") from exc
    return view
