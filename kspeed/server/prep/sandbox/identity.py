"""A root server's preprocessing workers become an unprivileged user, in namespaces of their own.

Run by the worker itself, as root, before any user code (:func:`become`): a new mount namespace
(and a new network namespace, with only a loopback interface that is down, unless the operator
allows the network), then ``setgroups([])``, ``setresgid`` and ``setresuid`` to the preprocessing
user, which drops every capability. In the new mount namespace, directories the worker must read
(the Python installation, the allowed modules, the operator's paths) are made reachable when an
ancestor is closed to that user (a virtualenv under ``/root``, mode 0700): the ancestor is covered
with an empty tmpfs in which only those directories are bound again, read-only unless the
operator made them writable. Nothing else of the ancestor (``/root/.ssh``, a token beside the
installation) is then visible at all. Mounts stay private to the worker (``MS_PRIVATE``).
"""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kspeed.errors import ConfigError

__all__ = ["User", "become", "resolve_user"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class User:
    """An identity the workers take: its name (for messages), uid and gid."""

    name: str
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.name} (uid {self.uid}, gid {self.gid})"


def resolve_user(spec: str, field: str = "server.preprocess_user") -> User:
    """The user named by ``spec``: a user name, or ``uid[:gid]`` (a number needs no account).

    Raises:
        ConfigError: no such user, or it is root.
    """
    name, _, group = spec.partition(":")
    try:
        if name.isdigit():
            uid = int(name)
            try:
                entry = pwd.getpwuid(uid)
                shown, gid = entry.pw_name, entry.pw_gid
            except KeyError:
                shown, gid = f"uid {uid}", uid
        else:
            entry = pwd.getpwnam(name)
            shown, uid, gid = name, entry.pw_uid, entry.pw_gid
        if group:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise ConfigError(
            f"{field}: no user or group {spec!r} on this host; create it (e.g. a system user kspeed-prep) or "
            "give uid:gid numbers",
            field=field,
            value=spec,
        ) from exc
    if uid == 0 or gid == 0:
        raise ConfigError(
            f"{field}: {spec!r} is root; the preprocessing workers must run as an unprivileged user",
            field=field,
            value=spec,
        )
    return User(shown, uid, gid)


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _traversable(path: str, user: User) -> bool:
    """Whether ``user`` may search the directory ``path`` (its mode bits; root-owned dirs are the case here)."""
    try:
        info = os.stat(path)
    except OSError:
        return True  # absent: nothing to expose
    if info.st_uid == user.uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid == user.gid:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def _closed_ancestor(path: str, user: User) -> str | None:
    """The outermost directory above ``path`` that ``user`` cannot search, or ``None``."""
    parts = os.path.abspath(path).split(os.sep)[1:-1]
    current = ""
    for part in parts:
        current += os.sep + part
        if not _traversable(current, user):
            return current
    return None


def _expose(paths: Sequence[tuple[str, bool]], user: User) -> None:
    """Make each ``(path, writable)`` reachable by ``user``: cover each closed ancestor with a
    tmpfs in which only the paths beneath it are bound again (in this mount namespace)."""
    while True:
        pending = [(p, w, a) for p, w in paths if os.path.exists(p) and (a := _closed_ancestor(p, user))]
        if not pending:
            return
        ancestor = min((a for _, _, a in pending), key=len)
        beneath = [(p, w) for p, w, a in pending if a == ancestor]
        kept = [(p, w, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p, w in beneath]
        try:
            _mount("tmpfs", ancestor, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
            for path, writable, fd in kept:
                for parent in _parents_between(ancestor, path):
                    os.makedirs(parent, mode=0o755, exist_ok=True)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.makedirs(path, mode=0o755, exist_ok=True)
                else:
                    open(path, "a").close()  # a file's mount point
                _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
                if not writable:
                    _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        finally:
            for _, _, fd in kept:
                os.close(fd)


def _parents_between(ancestor: str, path: str) -> Iterable[str]:
    relative = os.path.relpath(os.path.dirname(path), ancestor)
    current = ancestor
    for part in [] if relative == "." else relative.split(os.sep):
        current = os.path.join(current, part)
        yield current


def become(user: User, *, network: bool, read: Sequence[str], write: Sequence[str]) -> list[str]:
    """Enter new mount (and, without ``network``, network) namespaces, expose ``read`` and ``write``
    to ``user`` and become it, for good. Must run as root. Returns what is in force, for the report.

    Raises:
        OSError: a step failed (the process must not go on to run user code).
    """
    flags = _CLONE_NEWNS | (0 if network else _CLONE_NEWNET)
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here reaches the host
    _expose([*((p, False) for p in read), *((p, True) for p in write)], user)
    os.setgroups([])
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)
    return [f"user {user}", "mount namespace", *([] if network else ["network namespace (no interface up)"])]
