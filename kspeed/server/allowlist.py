"""The operator's allow-list of backend protocols and path prefixes.

A server opens a backend URI only if it lies under one of the operator's rules, so a client cannot
make it read ``file:///etc/shadow``. With no rules everything is refused. Local paths are resolved
with :func:`os.path.realpath` (rules too) before the check, so neither ``..`` nor a symlink can
lead outside an allowed tree; remote paths are normalized and refused if they contain ``..``.

Rules look like ``/data/imgs`` or ``file:///data/imgs`` (a local tree), ``s3://bucket/prefix``
(objects under that prefix) or ``s3://`` (the whole protocol). A prefix matches whole path
components: ``/data/imgs`` admits ``/data/imgs/a.jpg`` but not ``/data/imgs2``.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Iterable

from kspeed.errors import AccessDeniedError, ConfigError

__all__ = ["LOCAL_PROTOCOLS", "AllowList", "Rule", "split_uri"]

#: Protocols whose paths are local file-system paths (resolved with realpath). ``slowfile`` is the
#: throttled local file system of :mod:`kspeed.server.backend`.
LOCAL_PROTOCOLS = frozenset({"file", "local", "slowfile"})


def split_uri(uri: str) -> tuple[str, str]:
    """Split ``uri`` into ``(protocol, path)``; a bare path is ``file``, ``local`` becomes ``file``."""
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"backend URI must be a non-empty string, got {uri!r}", value=uri)
    if "://" in uri:
        protocol, path = uri.split("://", 1)
        protocol = protocol.lower()
    else:
        protocol, path = "file", uri
    if protocol == "local":
        protocol = "file"
    return protocol, path


def _normalize(protocol: str, path: str) -> str | None:
    """The canonical form of ``path`` under ``protocol``, or ``None`` if it may not be trusted."""
    if protocol in LOCAL_PROTOCOLS:
        return os.path.realpath(path or "/")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        return None
    return posixpath.join(*parts) if parts else ""


def _under(path: str, prefix: str) -> bool:
    if not prefix or prefix == "/":
        return True
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One allow-list entry: a protocol and a normalized path prefix (empty = the whole protocol)."""

    protocol: str
    prefix: str
    text: str

    def admits(self, protocol: str, path: str) -> bool:
        """True if the normalized ``path`` under ``protocol`` lies under this rule."""
        return protocol == self.protocol and _under(path, self.prefix)


class AllowList:
    """A set of :class:`Rule` s checked before any backend is opened.

    Args:
        rules: rule strings as the operator wrote them.
        name: what the rule set is called in error messages (e.g. the flag ``--backend-allow``).

    Raises:
        ConfigError: a rule cannot be parsed.
    """

    def __init__(self, rules: Iterable[str] = (), *, name: str = "server backend allow-list") -> None:
        self.name = name
        parsed = []
        for text in rules:
            protocol, path = split_uri(text.strip())
            prefix = _normalize(protocol, path) if path else ""
            if prefix is None:
                raise ConfigError(f"allow-list rule {text!r} contains '..'", field="server.backend_allow")
            parsed.append(Rule(protocol, prefix, text))
        self.rules: tuple[Rule, ...] = tuple(parsed)

    def check(self, uri: str, *, dataset: str | None = None, sample: object = None) -> tuple[str, str]:
        """Return ``(protocol, normalized path)`` of ``uri`` if a rule admits it.

        Raises:
            AccessDeniedError: no rule admits it; the message names the rule set and lists its rules.
        """
        protocol, path = split_uri(uri)
        norm = _normalize(protocol, path)
        if norm is not None and any(rule.admits(protocol, norm) for rule in self.rules):
            return protocol, norm
        rules = ", ".join(repr(r.text) for r in self.rules) or "none: every URI is refused"
        what = f"dataset {dataset!r}" + (f" sample {sample}" if sample is not None else "")
        shown = f" (resolves to {protocol}://{norm})" if norm is not None and norm != path else ""
        if norm is None:
            shown = " (contains '..')"
        raise AccessDeniedError(
            f"{what}: URI {uri!r}{shown} refused by the {self.name}; rules: {rules}",
            dataset=dataset,
            sample=sample,
        )

    def check_resolved(self, protocol: str, path: str, *, dataset: str | None = None, sample: object = None) -> None:
        """Like :meth:`check` for a path already resolved (e.g. read back from an open descriptor).

        Raises:
            AccessDeniedError: no rule admits it.
        """
        if not self.admits_resolved(protocol, path):
            self.check(f"{protocol}://{path}", dataset=dataset, sample=sample)

    def admits_resolved(self, protocol: str, path: str) -> bool:
        """True if a rule admits the already resolved ``path``; everything under it is admitted too."""
        return any(rule.admits(protocol, path) for rule in self.rules)

    def admits(self, uri: str) -> bool:
        """True if :meth:`check` would accept ``uri``."""
        try:
            self.check(uri)
        except AccessDeniedError:
            return False
        return True

    def __repr__(self) -> str:
        return f"AllowList({[r.text for r in self.rules]!r})"
