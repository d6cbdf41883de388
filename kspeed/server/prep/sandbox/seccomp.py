"""A seccomp filter, built by hand: the system calls a preprocessing worker never needs are refused.

The filter is a classic BPF program installed with ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``
(no libseccomp needed; ``no_new_privs`` must be set). Everything is allowed except:

- ``execve``, ``execveat``: no program (a shell) can be started;
- ``socket`` of any family but ``AF_UNIX``, unless the operator allows the network (the worker's
  own pipe to the server is a Unix socket, created before the filter);
- ``io_uring_*``: its operations (sockets, opens) would bypass the checks above;
- ``ptrace``, ``process_vm_readv``/``writev``: no reading or writing another process's memory;
- ``unshare``, ``setns``, ``clone`` with a namespace flag, ``clone3`` (whose flags a filter cannot
  read: libc falls back to ``clone`` on ``ENOSYS``): no new user namespace, in which a process
  holds capabilities and reaches more of the kernel;
- ``bpf``, ``perf_event_open``, ``userfaultfd``, ``keyctl``, ``add_key``, ``request_key``: kernel
  interfaces with a history of exploits that preprocessing has no use for.

A refused call fails with ``EPERM`` (``ENOSYS`` for ``io_uring_*`` and ``clone3``), so the user
code sees an ordinary ``OSError``; a call from another architecture's ABI (x32, a 32-bit
personality) kills the process. Only x86-64 and AArch64 are described here; on another machine
:func:`install` raises and the caller reports the filter as missing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import socket
import struct

__all__ = ["SeccompUnavailable", "install", "program"]

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR, _ARCH, _ARG0 = 0, 4, 16

# BPF instructions.
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000

_X32_SYSCALL_BIT = 0x40000000
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

#: Per machine: the audit architecture, then the numbers of the calls refused.
_TABLES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "execve": 59, "execveat": 322, "socket": 41, "ptrace": 101, "process_vm_readv": 310,
            "process_vm_writev": 311, "unshare": 272, "setns": 308, "clone": 56, "clone3": 435,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321,
            "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "execve": 221, "execveat": 281, "socket": 198, "ptrace": 117, "process_vm_readv": 270,
            "process_vm_writev": 271, "unshare": 97, "setns": 268, "clone": 220, "clone3": 435,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 280,
            "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219, "add_key": 217, "request_key": 218,
        },
    ),
}  # fmt: skip
_DENIED = (
    "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "bpf",
    "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
)  # fmt: skip
_MISSING = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")


class SeccompUnavailable(OSError):
    """This machine has no seccomp filter here (an architecture not described, or the kernel refused it)."""


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str, *, network: bool) -> bytes:
    """The filter for ``machine`` (``platform.machine()``) as packed ``struct sock_filter`` entries.

    Raises:
        SeccompUnavailable: the machine is not one this module describes.
    """
    if machine not in _TABLES:
        raise SeccompUnavailable(errno.ENOSYS, f"no seccomp filter is described for {machine}")
    arch, numbers = _TABLES[machine]
    deny = _ERRNO | errno.EPERM
    ops = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, arch, jt=1), _op(_RET_K, _KILL_PROCESS), _op(_LD_W_ABS, _NR)]
    if machine == "x86_64":  # the x32 ABI shares the architecture: refuse its numbers
        ops += [_op(_JGE_K, _X32_SYSCALL_BIT, jf=1), _op(_RET_K, _KILL_PROCESS)]
    for name in _DENIED:
        ops += [_op(_JEQ_K, numbers[name], jf=1), _op(_RET_K, deny)]
    for name in _MISSING:
        ops += [_op(_JEQ_K, numbers[name], jf=1), _op(_RET_K, _ERRNO | errno.ENOSYS)]
    # clone(flags, ...): flags (the first argument on both machines) must name no namespace.
    ops += [
        _op(_JEQ_K, numbers["clone"], jf=3),
        _op(_LD_W_ABS, _ARG0),
        _op(_JSET_K, _CLONE_NAMESPACES, jf=1),
        _op(_RET_K, deny),
        _op(_LD_W_ABS, _NR),  # (reload the number: the clone branch replaced it)
    ]
    if not network:  # socket(domain, ...): only AF_UNIX
        ops += [
            _op(_JEQ_K, numbers["socket"], jf=3),
            _op(_LD_W_ABS, _ARG0),
            _op(_JEQ_K, socket.AF_UNIX, jt=1),
            _op(_RET_K, deny),
        ]
    ops.append(_op(_RET_K, _ALLOW))
    return b"".join(ops)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(*, network: bool) -> None:
    """Install the filter on this process (and every thread and child it makes from now on).

    Raises:
        SeccompUnavailable: no filter for this machine, or the kernel refused it.
    """
    code = program(platform.machine(), network=network)
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        number = ctypes.get_errno()
        raise SeccompUnavailable(number, f"the kernel refused the seccomp filter: {os.strerror(number)}")
