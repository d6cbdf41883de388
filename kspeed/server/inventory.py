"""What a server reports about itself: identity, memory it may pool, cores, NICs, rails."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from kspeed.config import ServerConfig
from kspeed.errors import ConfigError
from kspeed.preprocess.versions import libraries
from kspeed.proto import kspeed_pb2
from kspeed.rdma.rails import available_rails

ID_FILE = "server_id"


def server_id(config: ServerConfig, state_dir: str) -> str:
    """The configured id, else the one kept in ``state_dir``, else a new one kept there.

    A stable id lets a restarted server be recognized by the manager and re-adopt its regions.
    """
    path = os.path.join(state_dir, ID_FILE)
    if config.server_id:
        return config.server_id
    try:
        with open(path, encoding="utf-8") as fh:
            value = fh.read().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(
            f"server.state_dir: cannot read {path!r}: {exc.strerror}", field="server.state_dir", value=state_dir
        ) from exc
    value = f"srv-{secrets.token_hex(4)}"
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(value + "\n")
    os.replace(tmp, path)
    return value


def usable_cores(configured: int) -> int:
    """Cores this process may run on, capped by the operator's setting."""
    allowed = len(os.sched_getaffinity(0))
    return min(configured, allowed) if configured else allowed


def cpu_group() -> str:
    """Which CPUs this process may use, machine-wide: ``"<boot id>/<cpu ids>"`` (equal for servers
    that share their CPUs)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = str(os.cpu_count() or 1)
    return f"{boot}/{cpus}"


def rdma_nics(sysfs: str = "/sys") -> list[kspeed_pb2.Nic]:
    """RDMA devices under ``<sysfs>/class/infiniband`` with their PCI address and NUMA node."""
    root = os.path.join(sysfs, "class", "infiniband")
    nics = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        device = os.path.realpath(os.path.join(root, name, "device"))
        try:
            with open(os.path.join(device, "numa_node"), encoding="ascii") as fh:
                numa = int(fh.read().strip())
        except (OSError, ValueError):
            numa = -1
        nics.append(kspeed_pb2.Nic(name=name, pci_bus_id=os.path.basename(device), numa_node=numa))
    return nics


def inventory(config: ServerConfig, memory_used: int = 0) -> kspeed_pb2.ServerInventory:
    """This server's inventory as reported at registration and in heartbeats."""
    return kspeed_pb2.ServerInventory(
        hostname=socket.gethostname(),
        memory_bytes=config.memory,
        region_size=config.region_size,
        cores=usable_cores(config.cores),
        transports=list(config.transports or available_rails()),
        nics=rdma_nics(),
        memory_used_bytes=memory_used,
        libraries=libraries(),
        preprocess_workers=config.preprocess_workers or usable_cores(config.cores),
    )
