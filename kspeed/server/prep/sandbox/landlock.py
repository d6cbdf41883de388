"""Landlock (Linux 5.13+): a process gives up filesystem, TCP and signal rights it does not need.

Landlock needs no privilege (only ``no_new_privs``, set by the caller) and applies to the process
and everything it starts, for good. :func:`restrict` handles every right the running kernel knows
(its ABI version), so what a rule does not grant is refused: here the preprocessing workers keep
read access to what they must import and nothing else, never execute a file, and write only where
the operator allows. From ABI 4 TCP ``bind``/``connect`` are refused too (UDP is not covered: the
seccomp filter refuses other sockets), from ABI 6 the process can neither signal nor connect to the
abstract Unix sockets of processes outside its domain (the server, clients' ``shm`` receivers).

The structures and constants are those of ``<linux/landlock.h>``; the system calls are made through
:mod:`ctypes` (their numbers are the same on every architecture since they were added after the
tables were unified).
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Iterable

__all__ = ["READ", "WRITE", "LandlockUnavailable", "abi_version", "restrict"]

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
_REMOVE_DIR, _REMOVE_FILE, _MAKE_CHAR, _MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
_MAKE_REG, _MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

#: Filesystem rights each ABI version handles (ABI 2 added REFER, 3 TRUNCATE, 5 IOCTL_DEV).
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
#: The rights that apply to a file (a rule on a file may grant only these).
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | _TRUNCATE | _IOCTL_DEV

#: Read a file, list a directory.
READ = READ_FILE | READ_DIR
#: Read, and create, change and remove files and directories (never execute).
WRITE = READ | WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_DIR | _MAKE_REG | _MAKE_SYM | _REFER | _TRUNCATE


class LandlockUnavailable(OSError):
    """The kernel has no Landlock (or it is disabled, or a system call filter refuses it)."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is packed: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _call(number: int, *args: object) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return int(result)


def abi_version() -> int:
    """The Landlock ABI version of the running kernel.

    Raises:
        LandlockUnavailable: no Landlock (not built in, disabled at boot, or refused by a filter).
    """
    try:
        return _call(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except OSError as exc:
        raise LandlockUnavailable(exc.errno, f"Landlock is not available: {exc.strerror}") from exc


def restrict(read: Iterable[str], write: Iterable[str], *, network: bool) -> int:
    """Restrict this process (and its future children) to reading ``read`` and reading and
    writing ``write`` (files or directories, with everything beneath them); without ``network``,
    TCP bind and connect are refused too where the kernel can (ABI 4). Paths that do not exist
    are skipped. ``no_new_privs`` must be set already. Returns the ABI version enforced.

    Raises:
        LandlockUnavailable: no Landlock.
        OSError: the ruleset could not be built or enforced.
    """
    abi = abi_version()
    attr = _RulesetAttr(handled_access_fs=_FS_BY_ABI.get(abi, _FS_BY_ABI[5]))
    size = 8  # struct landlock_ruleset_attr grew with the ABI: pass only the fields this kernel knows
    if abi >= 4:
        attr.handled_access_net = 0 if network else _NET_BIND_TCP | _NET_CONNECT_TCP
        size = 16
    if abi >= 6:
        attr.scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL
        size = 24
    ruleset = _call(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for paths, rights in ((read, READ), (write, WRITE)):
            for path in paths:
                _allow(ruleset, path, rights & attr.handled_access_fs)
        _call(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return abi


def _allow(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # absent (or not reachable by this process): nothing to grant
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FILE_RIGHTS
        rule = _PathBeneathAttr(allowed_access=rights, parent_fd=fd)
        _call(
            _ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0)
        )
    finally:
        os.close(fd)
