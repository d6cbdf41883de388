"""Backend storage through fsspec, gated by the operator's allow-list.

:class:`Backend` is the only way server code opens backend storage: it checks every URI against
an :class:`~kspeed.server.backend.allowlist.AllowList` and builds file systems with the storage options
(credentials, endpoints) from the server's own configuration, one dict per protocol; nothing a
client sends reaches those options. Protocols ``slowfile`` and ``throttled``
(:mod:`kspeed.testing.throttle`: latency per request, a bandwidth cap) stand in for remote storage
in tests and benchmarks.

HTTP file systems follow redirects and, when listing, the links of a page: every request one makes
passes :class:`RequestGuard` first, which refuses one outside the allow-list before it connects (a
redirect from an allowed host to ``169.254.169.254`` goes nowhere).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec

from kspeed import uris
from kspeed.errors import AccessDeniedError, BackendError, ConfigError, DatasetError
from kspeed.server.backend.allowlist import LOCAL_PROTOCOLS, AllowList

__all__ = ["Backend", "RequestGuard", "failures"]

log = logging.getLogger(__name__)

URL_PROTOCOLS = frozenset({"http", "https"})  # paths on these file systems are whole URLs


_FAILURES = (OSError, ValueError, RuntimeError)


def failures() -> tuple[type[BaseException], ...]:
    """What a backend's file system raises when it fails: OS and fsspec errors, and aiohttp's (an
    HTTP server that drops the connection) once an HTTP file system has imported it (only then can
    one be raised; importing aiohttp for this alone took a sixth of a second of each server start)."""
    aiohttp = sys.modules.get("aiohttp")
    client_error = getattr(aiohttp, "ClientError", None) if aiohttp is not None else None
    return (*_FAILURES, client_error) if isinstance(client_error, type) else _FAILURES


class RequestGuard:
    """An aiohttp client middleware that lets a request through only if the allow-list admits its URL.

    It sees every request a session sends, the redirects it follows included, just before the
    connection, with the URL as it goes on the wire (percent-decoding and ``..`` already applied).
    """

    def __init__(self, allow: AllowList) -> None:
        self.allow = allow

    async def __call__(self, request: Any, handler: Any) -> Any:
        url = str(request.url)
        if not self.allow.admits_request(url):
            raise AccessDeniedError(
                f"a request to {uris.redact(url)} was refused before connecting: it lies outside the "
                f"{self.allow.name} (a redirect or a link may lead there); rules: "
                + (", ".join(repr(r.text) for r in self.allow.rules) or "none")
            )
        return await handler(request)

    def __repr__(self) -> str:  # part of fsspec's cache key for the file system
        return f"RequestGuard({self.allow!r})"


def _guarded(options: Mapping[str, Any], allow: AllowList) -> dict[str, Any]:
    """HTTP storage options with :class:`RequestGuard` first among the session's middlewares.

    Raises:
        ConfigError: the installed aiohttp has no client middlewares (before 3.12).
    """
    import aiohttp

    if "middlewares" not in inspect.signature(aiohttp.ClientSession).parameters:
        raise ConfigError(
            f"HTTP backends need aiohttp 3.12 or later (installed: {aiohttp.__version__}): a server checks every "
            "request and redirect they make against its allow-list with a client middleware"
        )
    client = dict(options.get("client_kwargs") or {})
    client["middlewares"] = (RequestGuard(allow), *client.get("middlewares", ()))
    return {**options, "client_kwargs": client}


class Backend:
    """Opens backend file systems for URIs the allow-list admits.

    Args:
        allow: the operator's allow-list; an empty one refuses everything.
        storage_options: per protocol, the keyword arguments of its fsspec file system (taken
            from the server configuration, never from a request).
    """

    def __init__(self, allow: AllowList, storage_options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.allow = allow
        self._options = {k: dict(v) for k, v in (storage_options or {}).items()}
        self._fs: dict[str, fsspec.AbstractFileSystem] = {}

    def filesystem(self, protocol: str) -> fsspec.AbstractFileSystem:
        """The (cached) file system of ``protocol``, built with the configured storage options.

        Raises:
            ConfigError: fsspec does not know the protocol or its package is not installed.
        """
        fs = self._fs.get(protocol)
        if fs is None:
            options = self._options.get(protocol, {})
            try:
                if protocol in URL_PROTOCOLS:
                    options = _guarded(options, self.allow)
                fs = fsspec.filesystem(protocol, **options)
            except (ImportError, ValueError) as exc:
                raise ConfigError(f"backend protocol {protocol!r} is not available: {exc}") from exc
            self._fs[protocol] = fs
        return fs

    def resolve(self, uri: str, *, dataset: str, sample: object = None) -> tuple[fsspec.AbstractFileSystem, str, str]:
        """Check ``uri`` and return ``(file system, normalized path, protocol)``.

        Raises:
            AccessDeniedError: the allow-list refuses the URI.
        """
        protocol, path = self.allow.check(uri, dataset=dataset, sample=sample)
        if protocol in URL_PROTOCOLS:  # fsspec's HTTP file system takes whole URLs as paths
            path = f"{protocol}://{path}"
        return self.filesystem(protocol), path, protocol

    def is_local(self, protocol: str) -> bool:
        """True if paths of ``protocol`` are local paths (checked with realpath on every open)."""
        return protocol in LOCAL_PROTOCOLS

    @contextlib.contextmanager
    def errors(self, what: str, *, dataset: str, sample: object = None) -> Iterator[None]:
        """Convert OS and fsspec errors raised inside the block to :class:`BackendError`.

        Args:
            what: the operation and target, e.g. ``"read file:///data/a.jpg"``.
        """
        try:
            yield
        except failures() as exc:
            raise self.error(exc, what, dataset=dataset, sample=sample) from exc

    @staticmethod
    def error(exc: BaseException, what: str, *, dataset: str, sample: object = None) -> DatasetError:
        """The :class:`BackendError` for ``exc`` raised while doing ``what`` (see :meth:`errors`), or
        an :class:`AccessDeniedError` where :class:`RequestGuard` refused a request behind it (an
        HTTP file system reports that as a missing file)."""
        where = f"dataset {dataset!r}" + (f" sample {sample}" if sample is not None else "")
        cause: BaseException | None = exc
        for _ in range(8):  # (a chain is short; the bound keeps a cyclic one from looping)
            if cause is None or isinstance(cause, AccessDeniedError):
                break
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, AccessDeniedError):
            err: DatasetError = AccessDeniedError(f"{where}: cannot {what}: {cause}", dataset=dataset, sample=sample)
        else:
            err = BackendError(f"{where}: cannot {what}: {type(exc).__name__}: {exc}", dataset=dataset, sample=sample)
        err.__cause__ = exc
        return err
