"""Listings made at registration, kept a while for the servers that will hold the dataset's shares.

The manager asks one server to describe a new dataset; that server lists the backend and keeps
the listing here under a name (:meth:`Listings.keep`). Each server then assigned a share is told
where the listing is (``AssignShareRequest.listing``): the lister itself takes it from here, the
others fetch it over ``FetchListing`` (:mod:`kspeed.server.backend.transfer`). A listing is kept for
:data:`KEEP_FOR` seconds and at most :data:`KEPT` at once; a holder that cannot get it (gone,
expired, the lister unreachable) lists the backend itself, as every holder did before.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import grpc

from kspeed.config import SecurityConfig
from kspeed.control import rpc
from kspeed.errors import KSpeedError, NotFoundError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from kspeed.server.backend.access import Backend
from kspeed.server.backend.sources import Source, source_of
from kspeed.server.backend.transfer import listing_chunks, listing_from_chunks

__all__ = ["KEEP_FOR", "KEPT", "Listings"]

log = logging.getLogger(__name__)

KEEP_FOR = 300.0  # seconds a listing is kept for the holders to fetch
KEPT = 4  # listings kept at once (the oldest goes first)
FETCH_TIMEOUT = 300.0  # seconds a fetch of a listing may take in all
MAX_LISTING_BYTES = 64 << 30  # the most a fetched listing may hold


def listing_name(spec: kspeed_pb2.DatasetSpec, source: Source) -> str:
    """The name a listing is kept under: its dataset, URI, kind and fingerprint."""
    text = "\0".join((spec.name, spec.uri, source.kind, source.fingerprint.digest))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Listings:
    """The listings this server made, by name, and fetching one from another server.

    Args:
        backend: this server's backend (a fetched listing is read through it).
        security: how to reach another server (TLS, token).
    """

    def __init__(self, backend: Backend, security: SecurityConfig) -> None:
        self._backend = backend
        self._security = security
        self._metadata = rpc.call_metadata(security)
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[float, Source]] = OrderedDict()

    def keep(self, spec: kspeed_pb2.DatasetSpec, source: Source) -> str:
        """Keep ``source`` for the dataset's holders; returns its name."""
        name = listing_name(spec, source)
        with self._lock:
            self._expire()
            self._kept[name] = (time.monotonic() + KEEP_FOR, source)
            self._kept.move_to_end(name)
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)
        return name

    def get(self, name: str) -> Source | None:
        """The listing kept under ``name``, if it still is."""
        with self._lock:
            self._expire()
            kept = self._kept.get(name)
        return None if kept is None else kept[1]

    def chunks(self, name: str) -> Iterator[kspeed_pb2.ListingChunk]:
        """The listing kept under ``name`` as a ``FetchListing`` stream.

        Raises:
            NotFoundError: no listing of that name is kept (never made here, or expired).
        """
        source = self.get(name)
        if source is None:
            raise NotFoundError(f"no listing {name!r} is kept here (listings are kept {KEEP_FOR:.0f} s)")
        return listing_chunks(source)

    def fetch(self, spec: kspeed_pb2.DatasetSpec, where: kspeed_pb2.ListingSource) -> Source:
        """The dataset's listing from the server that made it (or from here, when that is this one).

        Raises:
            KSpeedError: the lister cannot be reached, no longer keeps it, or sent something else.
            AccessDeniedError: the dataset's URI is not under this server's allow-list.
        """
        _, _, protocol = self._backend.resolve(spec.uri, dataset=spec.name)
        kept = self.get(where.listing_id)
        if kept is not None:
            return kept
        started = time.monotonic()
        channel = rpc.open_channel(where.address, self._security)
        try:
            stub = kspeed_pb2_grpc.ServerStub(channel)
            request = kspeed_pb2.FetchListingRequest(listing_id=where.listing_id)
            with rpc.map_rpc_errors(f"server {where.server_id} at {where.address}"):
                stream = stub.FetchListing(request, timeout=FETCH_TIMEOUT, metadata=self._metadata)
                found, fingerprint = listing_from_chunks(stream, dataset=spec.name, max_bytes=MAX_LISTING_BYTES)
        finally:
            channel.close()
        source = source_of(self._backend, spec.name, spec.uri, protocol, found, fingerprint)
        log.info(
            "dataset %s: fetched the listing from %s in %.2f s: %s",
            spec.name,
            where.server_id,
            time.monotonic() - started,
            source.fingerprint,
        )
        return source

    def _expire(self) -> None:
        now = time.monotonic()
        for name in [n for n, (until, _) in self._kept.items() if until < now]:
            del self._kept[name]


def fetch_failed(
    spec: kspeed_pb2.DatasetSpec, where: kspeed_pb2.ListingSource, exc: KSpeedError | grpc.RpcError
) -> None:
    """Log why a holder lists the backend itself after all."""
    log.warning(
        "dataset %s: cannot fetch the listing from %s (%s); listing the backend here", spec.name, where.server_id, exc
    )
