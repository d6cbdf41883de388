"""The operator's allow-list of backend protocols and path prefixes.

A server opens a backend URI only if it lies under one of the operator's rules, so a client cannot
make it read ``file:///etc/shadow`` or reach a host the operator did not name. With no rules
everything is refused. Local paths are resolved with :func:`os.path.realpath` (rules too) before
the check, so neither ``..`` nor a symlink can lead outside an allowed tree; remote paths are
normalized and refused if they contain ``..``, percent-encoded or not.

Refused whatever the rules say: a URI that carries credentials (:mod:`kspeed.uris`; they belong to
the server's ``backend_options``), a chained URL (``simplecache::http://...``,
``zip://a::http://...``: a server opens a backend itself, never through a protocol a URI names),
and a local path that is not absolute (``data/x``, or ``file://host/x``, which fsspec would read
relative to the daemon's working directory).

Rules look like ``/data/imgs`` or ``file:///data/imgs`` (a local tree), ``s3://bucket/prefix``
(objects under that prefix) or ``s3://`` (the whole protocol). A prefix matches whole path
components: ``/data/imgs`` admits ``/data/imgs/a.jpg`` but not ``/data/imgs2``. A rule that is not
absolute (``http``, ``data/imgs``) is refused with what was probably meant.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Iterable
from urllib.parse import unquote

import fsspec

from kspeed import uris
from kspeed.errors import AccessDeniedError, ConfigError

__all__ = ["LOCAL_PROTOCOLS", "AllowList", "Rule", "split_uri"]

#: Protocols whose paths are local file-system paths (resolved with realpath). ``slowfile`` is the
#: throttled local file system of :mod:`kspeed.server.backend.access`.
LOCAL_PROTOCOLS = frozenset({"file", "local", "slowfile"})
_FIELD = "server.backend_allow"


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


def _never(uri: str, protocol: str, path: str) -> str:
    """Why ``uri`` is refused whatever the rules say, or ``""``."""
    if "::" in uri:
        return (
            "is a chained URL (a::b): a server opens a backend URL itself, never through another protocol a URI "
            "names (caches and archives are its operator's configuration)"
        )
    if protocol in LOCAL_PROTOCOLS and not path.startswith("/"):
        return (
            "is not an absolute local path (a relative path, or a file URL naming a host, file://host/...): "
            "write /data/x or file:///data/x"
        )
    return ""


def _dotdot(part: str) -> bool:
    """Whether a remote path component is ``..`` once percent-decoded (an HTTP client or server decodes it)."""
    for _ in range(3):  # double encoding (%252e) decoded by two hops
        part = unquote(part)
    return any(piece == ".." for piece in part.split("\\"))


def _normalize(protocol: str, path: str) -> str | None:
    """The canonical form of ``path`` under ``protocol``, or ``None`` if it may not be trusted."""
    if protocol in LOCAL_PROTOCOLS:
        return os.path.realpath(path or "/")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(_dotdot(p) for p in parts):
        return None
    return posixpath.join(*parts) if parts else ""


def _under(path: str, prefix: str) -> bool:
    if not prefix or prefix == "/":
        return True
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def _meant(text: str) -> str:
    """What an operator probably meant by a rule that is not absolute (``http``, ``s3:``, ``data``)."""
    word = text.split(":", 1)[0].strip("/").lower()
    known = set(fsspec.available_protocols()) | set(fsspec.registry)
    if word in known:
        return f"'{word}://' (every URI of that protocol) or a prefix under it such as '{word}://host/path'"
    return f"an absolute path such as {os.path.abspath(text)!r}"


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
        ConfigError: a rule cannot be parsed, is not absolute, or carries credentials (the message
            names the entry and what was probably meant).
    """

    def __init__(self, rules: Iterable[str] = (), *, name: str = "server backend allow-list") -> None:
        self.name = name
        parsed = []
        for text in rules:
            text = text.strip()
            uris.check(text, ConfigError, what=f"{name} entry", field=_FIELD, value=uris.redact(text))
            protocol, path = split_uri(text)
            if "://" not in text and not text.startswith("/"):
                raise ConfigError(
                    f"{name} entry {text!r} is a relative path, which would name a directory under the daemon's "
                    f"working directory; did you mean {_meant(text)}?",
                    field=_FIELD,
                    value=text,
                )
            never = _never(text, protocol, path) if path else ""  # (an empty path: the whole protocol)
            if never:
                raise ConfigError(f"{name} entry {text!r} {never}", field=_FIELD, value=text)
            prefix = _normalize(protocol, path) if path else ""
            if prefix is None:
                raise ConfigError(f"{name} entry {text!r} contains '..'", field=_FIELD, value=text)
            parsed.append(Rule(protocol, prefix, text))
        self.rules: tuple[Rule, ...] = tuple(parsed)

    def check(self, uri: str, *, dataset: str | None = None, sample: object = None) -> tuple[str, str]:
        """Return ``(protocol, normalized path)`` of ``uri`` if a rule admits it.

        Raises:
            AccessDeniedError: no rule admits it, or it is refused whatever the rules say (see the
                module docstring); the message names the rule set and lists its rules.
        """
        what = f"dataset {dataset!r}" + (f" sample {sample}" if sample is not None else "")
        uris.check(uri, AccessDeniedError, what=f"{what}: URI", dataset=dataset, sample=sample)
        protocol, path = split_uri(uri)
        never = _never(uri, protocol, path)
        if never:
            raise AccessDeniedError(f"{what}: URI {uri!r} {never}", dataset=dataset, sample=sample)
        norm = _normalize(protocol, path)
        if norm is not None and self.admits_resolved(protocol, norm):
            return protocol, norm
        rules = ", ".join(repr(r.text) for r in self.rules) or "none: every URI is refused"
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

    def admits_request(self, url: str) -> bool:
        """True if a rule admits the URL a backend client is about to request.

        For the requests a remote file system makes on the server's behalf (each redirect, each
        link a listing follows): only where they go counts, so a redirect to a presigned URL under
        an allowed prefix is admitted, though a dataset's URI may not carry one.
        """
        protocol, path = split_uri(url)
        if _never(url, protocol, path):
            return False
        norm = _normalize(protocol, path)
        return norm is not None and self.admits_resolved(protocol, norm)

    def __repr__(self) -> str:
        return f"AllowList({[r.text for r in self.rules]!r})"
