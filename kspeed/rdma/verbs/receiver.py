"""Consumer side of the ``verbs`` rail: rings in the training process, verbs in a helper process.

As on ``tcp`` (:class:`~kspeed.rdma.tcp.receiver.TcpReceiver`, whose control protocol this
shares), the rings are memfd segments of the training process; the receiver process
(:mod:`kspeed.rdma.verbs.receiver_process`) maps them, registers them with the NIC for each
connected writer, owns the queue pairs, the shared receive queue and the completion queue, and
forwards completions, so no receive loop runs under the training process's GIL. A device ring
(:meth:`VerbsReceiver.register_device`) is GPU memory exported as a dma-buf: the receiver process
registers the dma-buf, never maps it, and the NIC writes straight into the GPU (GPUDirect RDMA).
"""

from __future__ import annotations

from kspeed.rdma import framing
from kspeed.rdma.base import Region, RegionKey
from kspeed.rdma.device_memory import DeviceMemory
from kspeed.rdma.options import RailOptions
from kspeed.rdma.tcp.receiver import TcpReceiver

__all__ = ["VerbsReceiver"]


class VerbsReceiver(TcpReceiver):
    """Consumer side of the ``verbs`` rail."""

    rail = "verbs"
    process = "kspeed.rdma.verbs.receiver_process"

    def __init__(self, options: RailOptions, api: str | None) -> None:
        self._api_spec = api
        super().__init__(options)

    def _process_config(self) -> dict:
        return {"verbs_api": self._api_spec, "nic": self._options.nic}

    def _material(self) -> dict:
        return {**super()._material(), "nic": self._attached["nic"], "gid": self._attached["gid"]}

    def register_device(self, memory: DeviceMemory) -> Region:
        """Register a device ring: its dma-buf goes to the receiver process, which registers it with
        the NIC for each writer (``ibv_reg_dmabuf_mr``, IOVA 0); the key addresses it from 0.

        Raises:
            TransportError: the receiver process refused it (the NIC cannot register a dma-buf).
        """
        handle = next(self._handles)
        desc = {"handle": handle, "length": memory.nbytes, "dmabuf": True}
        self._call(desc, [memory.fd], kind=framing.REGION)
        region = Region(RegionKey(self.rail, self._options.public_host, handle, 0, memory.nbytes), memory)
        self._regions[handle] = region
        return region

    @property
    def nic(self) -> str:
        """The NIC the writers reach this receiver through."""
        return str(self._attached["nic"])
