"""The one exception hierarchy of KSpeed.

Every error KSpeed raises to its users derives from :class:`KSpeedError`; errors of gRPC, the
operating system and the transports are converted at the boundary (``raise ... from``)::

    KSpeedError
    ├── ConfigError              a configuration value is missing or invalid
    ├── ProtocolError            a peer sent something this side cannot accept
    │   └── VersionMismatchError no protocol version in common
    ├── AuthError                missing or wrong credentials
    ├── UnavailableError         a daemon cannot be reached
    ├── NotFoundError            a named thing (server, dataset, sample) does not exist
    │   └── NotHeldError         a server holds no such share of a dataset (it moved, or never was there)
    ├── ConflictError            a name is taken by something defined otherwise
    ├── StateError               an operation in the wrong lifecycle state
    ├── CapacityError            not enough memory, ring space or regions
    │   └── BusyError            a server serves as many streams as it can at once (retry shortly)
    ├── StateFileError           a daemon's state file (registry, assignments, pool manifest, index) cannot be written
    ├── DatasetError             a dataset cannot be listed, loaded or served
    │   ├── BackendError         the backend storage refused or failed a read
    │   ├── AccessDeniedError    a URI outside the operator's allow-list
    │   ├── IntegrityError       a checksum mismatch
    │   ├── ChangedError         a backend file changed or vanished after it was listed
    │   └── PreprocessError      a preprocessing stage failed on a sample, or its output broke its declaration
    └── TransportError           the data plane failed
        ├── RailUnavailableError a rail is unknown or unusable on this host
        ├── RangeError           a write outside the granted range
        └── PeerLostError        the peer died or the link was cut
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "AuthError",
    "BackendError",
    "BusyError",
    "CapacityError",
    "ChangedError",
    "ConfigError",
    "ConflictError",
    "DatasetError",
    "IntegrityError",
    "KSpeedError",
    "NotFoundError",
    "NotHeldError",
    "PeerLostError",
    "PreprocessError",
    "ProtocolError",
    "RailUnavailableError",
    "RangeError",
    "StateError",
    "StateFileError",
    "TransportError",
    "UnavailableError",
    "VersionMismatchError",
]


class KSpeedError(Exception):
    """Base of every error KSpeed raises."""


class ConfigError(KSpeedError):
    """A configuration value is missing or invalid.

    Args:
        message: what is wrong.
        field: the configuration field, e.g. ``"server.memory"``.
        value: the offending value as given.
        source: where the value came from (file, environment variable, flag).
    """

    def __init__(
        self, message: str, *, field: str | None = None, value: object = None, source: str | None = None
    ) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.source = source


class ProtocolError(KSpeedError):
    """A peer sent a message this side cannot accept."""


class VersionMismatchError(ProtocolError):
    """The two sides share no protocol version."""

    def __init__(self, message: str, *, local: tuple[int, ...] = (), remote: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.local = tuple(local)
        self.remote = tuple(remote)


class AuthError(KSpeedError):
    """Missing or wrong credentials (token, TLS, data-plane handshake)."""


class UnavailableError(KSpeedError):
    """A daemon cannot be reached (down, wrong address, network)."""


class NotFoundError(KSpeedError):
    """A named object (server, dataset, sample) does not exist."""


class NotHeldError(NotFoundError):
    """A server was asked about a share of a dataset it does not hold: the manager moved the share
    elsewhere (a client follows it as it follows a lost server), or it never was there."""


class ConflictError(KSpeedError):
    """A name is already taken by an object defined differently."""


class StateError(KSpeedError):
    """An operation was attempted in a lifecycle state that does not allow it."""


class CapacityError(KSpeedError):
    """Not enough of a bounded resource: memory, regions, ring space."""


class BusyError(CapacityError):
    """A server has as many streams open as it serves at once: the same call succeeds shortly."""


class StateFileError(KSpeedError):
    """A daemon's state file (the manager's registry; a server's assignments, its pool's manifest, a
    share's sample index) cannot be written: the disk is full, or the directory is read-only. The
    previous version of the file stays whole.

    Args:
        message: which file, why, and what to do.
        path: the file.
        free_bytes: bytes left to unprivileged users on its file system, when they could be counted.
    """

    def __init__(self, message: str, *, path: str = "", free_bytes: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.free_bytes = free_bytes


class DatasetError(KSpeedError):
    """A dataset cannot be listed, loaded or served.

    Args:
        message: what is wrong.
        dataset: the dataset's name, when known.
        sample: the sample id or key concerned, when known.
    """

    def __init__(self, message: str, *, dataset: str | None = None, sample: object = None) -> None:
        super().__init__(message)
        self.dataset = dataset
        self.sample = sample


class BackendError(DatasetError):
    """The backend storage refused or failed a listing or a read."""


class AccessDeniedError(DatasetError):
    """A backend URI lies outside the operator's allow-list."""


class IntegrityError(DatasetError):
    """A sample's bytes do not match their checksum."""


class ChangedError(DatasetError):
    """A backend file changed or vanished after it was listed: its cached bytes are stale, never served.

    Args:
        message: what changed and what to do.
        dataset: the dataset's name.
        sample: the sample's ID.
        path: the sample's backend path.
        what: what differs (``"deleted"``, ``"size 10 -> 12 bytes"``, ``"modified ..."``).
    """

    sample: int | None

    def __init__(
        self, message: str, *, dataset: str | None = None, sample: int | None = None, path: str = "", what: str = ""
    ) -> None:
        super().__init__(message, dataset=dataset, sample=sample)
        self.path = path
        self.what = what


class PreprocessError(DatasetError):
    """A preprocessing stage failed on a sample, or produced what its declaration does not allow.

    Args:
        message: what failed, naming the sample and the stage.
        dataset: the dataset's name, when known.
        sample: the sample's ID, when known.
        stage: the failing stage's index in the pipeline, when known.
        op: the failing stage's op name, when known.
    """

    sample: int | None

    def __init__(
        self,
        message: str,
        *,
        dataset: str | None = None,
        sample: int | None = None,
        stage: int | None = None,
        op: str = "",
    ) -> None:
        super().__init__(message, dataset=dataset, sample=sample)
        self.stage = stage
        self.op = op


class TransportError(KSpeedError):
    """The data plane failed."""


class RailUnavailableError(TransportError):
    """A rail is unknown or cannot be used on this host."""


class RangeError(TransportError):
    """A write would land outside the region or range it was granted."""


class PeerLostError(TransportError):
    """The peer of a data-plane connection died or the link was cut.

    Args:
        message: what was lost and why.
        conn: the receiver's connection id of the lost peer, when one connection is concerned.
        server_id: the server that was lost, when a control-plane call to it failed.
        first_id: the share (its first sample) the failed call was about, when it was about one:
            only the path of that share is lost, not every path to the server.
    """

    def __init__(
        self, message: str, *, conn: int | None = None, server_id: str | None = None, first_id: int | None = None
    ) -> None:
        super().__init__(message)
        self.conn = conn
        self.server_id = server_id
        self.first_id = first_id
