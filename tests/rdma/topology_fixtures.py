"""Sysfs-like trees for topology tests, laid out as the kernel lays out ``/sys`` (real symlinks).

``devices/pci0000:xx/<root port>/<switch up>/<switch down>/<endpoint>`` holds the PCI tree;
``bus/pci/devices/<bus id>`` links into it; ``class/infiniband/<dev>`` and ``class/net/<if>`` link
to directories under their PCI device whose ``device`` link points back up to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

NODE0_CORES = "0-23,48-71"
NODE1_CORES = "24-47,72-95"


class SysfsTree:
    """Builds a sysfs-like tree under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("devices/system/node", "devices/virtual/net", "bus/pci/devices", "class/infiniband", "class/net"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))

    def pci(self, *chain: str, numa_node: int = -1, pci_class: str = "0x060400") -> Path:
        """``devices/<chain>``: a host bridge then PCI functions, each with ``numa_node`` and a bus link."""
        path = self.root / "devices"
        for i, part in enumerate(chain):
            path = path / part
            path.mkdir(exist_ok=True)
            if i == 0:
                continue
            if not (path / "numa_node").exists():
                (path / "numa_node").write_text(f"{numa_node}\n")
                (path / "class").write_text(f"{pci_class}\n")
            link = self.root / "bus" / "pci" / "devices" / part
            if not link.is_symlink():
                self._link(link, path)
        return path

    def gpu(self, *chain: str, numa_node: int) -> str:
        """A GPU at the end of ``chain``; returns its bus id."""
        self.pci(*chain[:-1], numa_node=numa_node)
        self.pci(*chain, numa_node=numa_node, pci_class="0x030200")
        return chain[-1]

    def rdma_nic(self, name: str, *chain: str, numa_node: int, netdev: str | None = None) -> str:
        """An RDMA device (and optionally its IPoIB/RoCE interface) at the end of ``chain``."""
        self.pci(*chain[:-1], numa_node=numa_node)
        dev = self.pci(*chain, numa_node=numa_node, pci_class="0x020700")
        ib = dev / "infiniband" / name
        ib.mkdir(parents=True)
        self._link(ib / "device", dev)
        self._link(self.root / "class" / "infiniband" / name, ib)
        if netdev:
            self._netdev(netdev, dev)
        return chain[-1]

    def net_nic(self, name: str, *chain: str, numa_node: int) -> str:
        """A plain Ethernet NIC at the end of ``chain``."""
        self.pci(*chain[:-1], numa_node=numa_node)
        self._netdev(name, self.pci(*chain, numa_node=numa_node, pci_class="0x020000"))
        return chain[-1]

    def _netdev(self, name: str, dev: Path) -> None:
        net = dev / "net" / name
        net.mkdir(parents=True)
        self._link(net / "device", dev)
        self._link(self.root / "class" / "net" / name, net)

    def virtual_net(self, name: str) -> None:
        """An interface without a device (``lo``, bridges): not a NIC."""
        path = self.root / "devices" / "virtual" / "net" / name
        path.mkdir(parents=True)
        self._link(self.root / "class" / "net" / name, path)

    def soft_rdma(self, name: str) -> None:
        """An RDMA device without a PCI device (soft RoCE)."""
        (self.root / "class" / "infiniband" / name).mkdir(parents=True)

    def node(self, number: int, cpulist: str) -> None:
        """NUMA node ``number`` with its cores."""
        path = self.root / "devices" / "system" / "node" / f"node{number}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(cpulist + "\n")


@dataclass
class Host:
    """A built tree and what a correct placement on it is."""

    root: str
    gpus: list[str] = field(default_factory=list)
    nic_of: dict[str, str] = field(default_factory=dict)
    node_of: dict[str, int] = field(default_factory=dict)


def _bdf(bus: int, dev: int = 0, fn: int = 0) -> str:
    return f"0000:{bus:02x}:{dev:02x}.{fn}"


# (host bridge bus, NUMA node) of the four PCIe switches of the 8-GPU server, one per CPU PCIe stack.
DGX_SWITCHES = [(0x17, 0), (0x3A, 0), (0x85, 1), (0xAE, 1)]


def dgx_like(path: Path) -> Host:
    """An 8-GPU / 4-NIC server (paper Fig. 8, DGX-style): 2 sockets, 4 PCIe switches.

    Each switch hangs off its own host bridge and root port and has three downstream ports: two
    GPUs and one mlx5 NIC (with its IPoIB interface ``ib<n>``). Switches 0-1 are on NUMA node 0,
    2-3 on node 1. An onboard management NIC ``eno1`` sits on socket 0's first host bridge, and
    ``lo`` has no device.
    """
    tree = SysfsTree(path)
    host = Host(str(path))
    for n, (hb, node) in enumerate(DGX_SWITCHES):
        up = (f"pci0000:{hb:02x}", _bdf(hb), _bdf(hb + 1))
        for port, kind in enumerate(("gpu", "gpu", "nic")):
            chain = (*up, _bdf(hb + 2, 4 * port), _bdf(hb + 3 + port))
            if kind == "gpu":
                gpu = tree.gpu(*chain, numa_node=node)
                host.gpus.append(gpu)
                host.nic_of[gpu] = f"mlx5_{n}"
                host.node_of[gpu] = node
            else:
                tree.rdma_nic(f"mlx5_{n}", *chain, numa_node=node, netdev=f"ib{n}")
    tree.net_nic("eno1", "pci0000:00", _bdf(0, 0x1F, 6), numa_node=0)
    tree.virtual_net("lo")
    tree.node(0, NODE0_CORES)
    tree.node(1, NODE1_CORES)
    return host


def two_socket(path: Path, *, socket1_nic: bool = False, bridge_nic: bool = False) -> Host:
    """A 2-socket host whose one GPU is on socket 1 and whose NICs are on socket 0.

    The GPU sits directly on a root port of host bridge ``pci0000:85`` (no switch). ``mlx5_0`` and
    ``mlx5_1`` are on socket 0. With ``socket1_nic``, ``mlx5_2`` is on socket 1 behind another host
    bridge (same NUMA node, no shared switch). With ``bridge_nic``, ``mlx5_3`` is on another root
    port of the GPU's own host bridge.
    """
    tree = SysfsTree(path)
    gpu = tree.gpu("pci0000:85", _bdf(0x85), _bdf(0x86), numa_node=1)
    tree.rdma_nic("mlx5_1", "pci0000:3a", _bdf(0x3A), _bdf(0x3B), numa_node=0)
    tree.rdma_nic("mlx5_0", "pci0000:17", _bdf(0x17), _bdf(0x18), numa_node=0)
    nic = "mlx5_0"
    if socket1_nic:
        tree.rdma_nic("mlx5_2", "pci0000:ae", _bdf(0xAE), _bdf(0xAF), numa_node=1)
        nic = "mlx5_2"
    if bridge_nic:
        tree.rdma_nic("mlx5_3", "pci0000:85", _bdf(0x85, 2), _bdf(0x87), numa_node=1)
        nic = "mlx5_3"
    tree.node(0, "0-15")
    tree.node(1, "16-31")
    return Host(str(path), [gpu], {gpu: nic}, {gpu: 1})


def bare(path: Path) -> Host:
    """A host with no GPU and no NIC: one NUMA node, a SATA controller and ``lo``."""
    tree = SysfsTree(path)
    tree.pci("pci0000:00", _bdf(0, 0x17), numa_node=-1, pci_class="0x010601")
    tree.virtual_net("lo")
    tree.node(0, "0-3")
    return Host(str(path))
