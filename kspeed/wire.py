"""Packed arrays in control-plane messages: one home for their dtypes and their packing.

Sample IDs, sizes, labels and offsets within a batch travel as little-endian ``int64``; lengths
and plan positions as little-endian ``uint32`` (a sample is smaller than a region, a plan shorter
than 2**32). Packing and unpacking are one numpy call each, never a Python object per sample.
"""

from __future__ import annotations

import numpy as np

from kspeed.errors import ProtocolError

__all__ = ["I64", "U32", "pack_i64", "pack_u32", "unpack_i64", "unpack_u32"]

#: IDs, sizes and labels.
I64 = np.dtype("<i8")
#: Lengths and positions.
U32 = np.dtype("<u4")


def pack_i64(values: np.ndarray) -> bytes:
    """``values`` as packed little-endian int64."""
    return np.asarray(values).astype(I64, copy=False).tobytes()


def pack_u32(values: np.ndarray) -> bytes:
    """``values`` as packed little-endian uint32 (the caller keeps them in range)."""
    return np.asarray(values).astype(U32, copy=False).tobytes()


def unpack_i64(data: bytes, what: str) -> np.ndarray:
    """Packed int64 values as an ``int64`` array (read-only, no copy).

    Raises:
        ProtocolError: the bytes are not whole int64 values (``what`` names them).
    """
    if len(data) % I64.itemsize:
        raise ProtocolError(f"{what} must be packed int64 ({len(data)} bytes given)")
    return np.frombuffer(data, dtype=I64)


def unpack_u32(data: bytes, what: str) -> np.ndarray:
    """Packed uint32 values as an ``int64`` array.

    Raises:
        ProtocolError: the bytes are not whole uint32 values (``what`` names them).
    """
    if len(data) % U32.itemsize:
        raise ProtocolError(f"{what} must be packed uint32 ({len(data)} bytes given)")
    return np.frombuffer(data, dtype=U32).astype(np.int64)
