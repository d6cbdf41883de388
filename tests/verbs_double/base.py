"""What every part of the double shares: pyverbs' enums and error class, C-style argument checks, PSN arithmetic.

Errors are pyverbs' own :class:`~pyverbs.pyverbs_error.PyverbsRDMAError` with an ``errno`` (its
``error_code``), as pyverbs raises them when a verb returns an error, so a rail catches the same
class on the double as on hardware. Arguments that pyverbs converts to C integers raise what Cython
raises for a value that does not fit (``OverflowError``) or is not an integer (``TypeError``).
"""

from __future__ import annotations

import ctypes
import importlib
import operator
from typing import Any, NoReturn

from pyverbs.pyverbs_error import PyverbsRDMAError


def _enums() -> Any:
    """pyverbs' enums: ``pyverbs.enums`` up to rdma-core 49, ``pyverbs.libibverbs_enums`` from 50."""
    try:
        return importlib.import_module("pyverbs.libibverbs_enums")
    except ImportError:
        return importlib.import_module("pyverbs.enums")


#: pyverbs' ``ibv_*`` enums (the same module the real ``Pyverbs`` API exposes as ``e``).
e: Any = _enums()

__all__ = [
    "PSN_MASK",
    "PyverbsRDMAError",
    "c_uint",
    "e",
    "fail",
    "memory",
    "psn_add",
    "psn_before",
    "state_name",
]


def fail(message: str, code: int) -> NoReturn:
    """Raise what pyverbs raises when a verb returns ``code`` (an errno)."""
    raise PyverbsRDMAError(message, code)


def c_uint(value: Any, bits: int, what: str) -> int:
    """``value`` converted as Cython converts a Python object to a C unsigned integer of ``bits`` bits."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: an integer is required, got {type(value).__name__}") from None
    if number < 0:
        raise OverflowError(f"{what}: can't convert negative value to unsigned {bits}-bit int")
    if number >> bits:
        raise OverflowError(f"{what}: value too large to convert to unsigned {bits}-bit int")
    return number


# Packet sequence numbers are 24 bits and compared in serial-number arithmetic (IBA 9.7.1: a PSN
# is "earlier" than another when it lies in the half of the PSN space behind it).
PSN_MASK = 0xFFFFFF
_PSN_HALF = 0x800000


def psn_add(psn: int, count: int) -> int:
    """``psn`` advanced by ``count`` packets."""
    return (psn + count) & PSN_MASK


def psn_before(a: int, b: int) -> bool:
    """Whether PSN ``a`` comes strictly before PSN ``b`` (24-bit serial arithmetic)."""
    return a != b and ((b - a) & PSN_MASK) < _PSN_HALF


_STATE_NAMES = {
    int(e.IBV_QPS_RESET): "RESET",
    int(e.IBV_QPS_INIT): "INIT",
    int(e.IBV_QPS_RTR): "RTR",
    int(e.IBV_QPS_RTS): "RTS",
    int(e.IBV_QPS_SQD): "SQD",
    int(e.IBV_QPS_SQE): "SQE",
    int(e.IBV_QPS_ERR): "ERR",
}


def state_name(state: int) -> str:
    """``RESET``, ``INIT``, ... for an ``IBV_QPS_*`` value."""
    return _STATE_NAMES.get(int(state), f"state {state}")


# One ctypes array type spanning any registered range: ``ctypes.c_char * n`` for every length would
# create (and cache forever) one type per distinct length.
_WINDOW = ctypes.c_char * (1 << 46)


def memory(address: int, length: int) -> memoryview:
    """A writable byte view of ``[address, address + length)`` of this process (no copy, no check)."""
    return memoryview(_WINDOW.from_address(address)).cast("B")[:length]
