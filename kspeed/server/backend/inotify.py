"""Linux inotify through ctypes: the change events of a set of directories on a local file system.

A :class:`DirectoryEvents` watches directories for what can change a file's bytes or replace it
(written, closed after writing, attributes such as the mtime, created, deleted, moved in or out)
and hands the names it saw, by directory, to whoever drains it. It does not decide what a change
is: that is a comparison with the listing (:mod:`kspeed.server.backend.tree_watch`).

inotify is trusted only on file systems whose every change passes through this kernel
(:func:`local_file_system`): a network file system changed from another host, or a FUSE or overlay
mount changed beneath it, sends no events. Events can be lost when the kernel's queue overflows;
:attr:`DirectoryEvents.intact` is then false for good.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import threading

__all__ = ["DirectoryEvents", "local_file_system"]

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000

WATCHED = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_DONT_FOLLOW
)
_LOST = IN_Q_OVERFLOW | IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF  # the watch no longer sees everything
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event, then the name)

# statfs(2) f_type of file systems whose changes all pass through the local kernel.
_LOCAL_TYPES = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0xF2F52010: "f2fs",
    0x2FC12FC1: "zfs",
    0xCA451A4E: "bcachefs",
}

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def local_file_system(path: str) -> str:
    """The name of ``path``'s file system when every change to it passes through this kernel, else ``""``."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type first
    try:
        if _lib().statfs(os.fsencode(path), buf) != 0:
            return ""
    except (OSError, AttributeError):
        return ""
    f_type = struct.unpack_from("l", buf.raw)[0] & 0xFFFFFFFF
    return _LOCAL_TYPES.get(f_type, "")


class DirectoryEvents:
    """inotify watches on directories and the entry names their events named since the last drain.

    Raises:
        OSError: inotify is not available (not Linux, or the per-user instance limit is reached).
    """

    def __init__(self) -> None:
        fd = _lib().inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        self._lock = threading.Lock()
        self._dirs: dict[int, bytes] = {}  # watch descriptor -> directory
        self._names: dict[bytes, set[bytes]] = {}  # directory -> names seen since the last drain
        self.intact = True
        self.why = ""

    def watch(self, directory: bytes) -> None:
        """Start watching ``directory`` (an absolute path).

        Raises:
            OSError: it cannot be watched (ENOSPC: the user's inotify watch limit is reached).
        """
        wd = _lib().inotify_add_watch(self._fd, directory, WATCHED)
        if wd < 0:
            err = ctypes.get_errno()
            limit = " (fs.inotify.max_user_watches)" if err == errno.ENOSPC else ""
            raise OSError(err, f"inotify_add_watch {os.fsdecode(directory)}: {os.strerror(err)}{limit}")
        self._dirs[wd] = directory

    def drain(self) -> dict[bytes, set[bytes]]:
        """The names each directory's events named since the last drain (reads what is queued)."""
        with self._lock:
            while True:
                try:
                    data = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    break
                self._parse(data)
            names, self._names = self._names, {}
        return names

    def _parse(self, data: bytes) -> None:
        at = 0
        while at + _EVENT.size <= len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, at)
            name = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0")
            at += _EVENT.size + length
            if mask & _LOST and self.intact:
                self.intact = False
                where = os.fsdecode(self._dirs.get(wd, b"?"))
                self.why = "the event queue overflowed" if mask & IN_Q_OVERFLOW else f"{where} was removed or moved"
            directory = self._dirs.get(wd)
            if directory is not None and name:
                self._names.setdefault(directory, set()).add(name)

    def close(self) -> None:
        """Stop watching (idempotent)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
