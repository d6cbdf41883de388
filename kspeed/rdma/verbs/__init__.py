"""The ``verbs`` rail: servers write into training buffers with RDMA writes (pyverbs).

Writer side: :class:`~kspeed.rdma.verbs.writer.VerbsWriter`. Receiver side:
:class:`~kspeed.rdma.verbs.receiver.VerbsReceiver` in the consuming process and its receiver
process (:mod:`kspeed.rdma.verbs.receiver_process`). Every device call goes through a
:class:`~kspeed.rdma.verbs.api.VerbsApi`: pyverbs in production, a strict software double of the
same objects in the tests (``tests/verbs_double``), chosen by the ``rdma.verbs_api`` setting.
"""

from __future__ import annotations

from kspeed.errors import KSpeedError
from kspeed.rdma.base import Rail, RailCapabilities, Receiver, Writer
from kspeed.rdma.options import RailOptions

from .api import VerbsApi, load_api
from .nic import close_nics
from .receiver import VerbsReceiver
from .writer import VerbsWriter

__all__ = ["VerbsRail", "VerbsReceiver", "VerbsWriter"]


class VerbsRail(Rail):
    """Cross-host rail over RDMA (RoCEv2 or InfiniBand) through ``api`` (``None``: pyverbs).

    Args:
        api: ``None`` or ``"pyverbs"``, or ``"module:attribute"`` naming another
            :class:`~kspeed.rdma.verbs.api.VerbsApi` (the tests' double).
    """

    name = "verbs"
    capabilities = RailCapabilities(
        host_local=False, needs_pacing=True, revokes_writer=True, device_memory=True, preference=15
    )

    def __init__(self, api: str | None = None) -> None:
        self.api_spec = api
        self._api: VerbsApi | None = None

    def _loaded(self) -> VerbsApi:
        if self._api is None:
            self._api = load_api(self.api_spec)
        return self._api

    def close(self) -> None:
        """Close the NICs this process opened through the rail's API."""
        if self._api is not None:
            close_nics(self._api)

    def unavailable_reason(self) -> str | None:
        try:
            names = self._loaded().device_names()
        except KSpeedError as exc:
            return str(exc)
        return None if names else "no RDMA device on this host"

    def listen(self, options: RailOptions) -> Receiver:
        return VerbsReceiver(options, self.api_spec)

    def connect(self, material: bytes, options: RailOptions) -> Writer:
        return VerbsWriter(material, options, self._loaded())
