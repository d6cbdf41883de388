"""Backend storage through fsspec, gated by the operator's allow-list.

:class:`Backend` is the only way server code opens backend storage: it checks every URI against
an :class:`~kspeed.server.allowlist.AllowList` and builds file systems with the storage options
(credentials, endpoints) from the server's own configuration, one dict per protocol; nothing a
client sends reaches those options. Protocols ``slowfile`` and ``throttled``
(:mod:`kspeed.server.throttle`: latency per request, a bandwidth cap) stand in for remote storage
in tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec

from kspeed.errors import BackendError, ConfigError
from kspeed.server import throttle  # noqa: F401  (registers the slowfile and throttled protocols)
from kspeed.server.allowlist import LOCAL_PROTOCOLS, AllowList

__all__ = ["Backend"]

log = logging.getLogger(__name__)

URL_PROTOCOLS = frozenset({"http", "https"})  # paths on these file systems are whole URLs


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
            try:
                fs = fsspec.filesystem(protocol, **self._options.get(protocol, {}))
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
        except (OSError, ValueError, RuntimeError) as exc:
            raise self.error(exc, what, dataset=dataset, sample=sample) from exc

    @staticmethod
    def error(exc: BaseException, what: str, *, dataset: str, sample: object = None) -> BackendError:
        """The :class:`BackendError` for ``exc`` raised while doing ``what`` (see :meth:`errors`)."""
        where = f"dataset {dataset!r}" + (f" sample {sample}" if sample is not None else "")
        err = BackendError(f"{where}: cannot {what}: {type(exc).__name__}: {exc}", dataset=dataset, sample=sample)
        err.__cause__ = exc
        return err
