"""Where a training process should run: its GPU, the NIC nearest that GPU and its NUMA node's cores.

KSpeed binds each process's data plane to the NIC that shares a PCIe switch with the process's GPU
and pins its loader threads to that NUMA node's cores (paper §III-D, "interference-free mapping",
Fig. 8: two GPUs per PCIe switch share one NIC, so their traffic never crosses another switch).
Everything is read from a sysfs-like tree whose root is an argument, so fixture trees can stand in
for ``/sys``; the environment is passed in by the caller, never read here.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kspeed.errors import ConfigError

__all__ = [
    "Nic",
    "Placement",
    "find_nics",
    "normalize_bus_id",
    "parse_cpulist",
    "pin",
    "pinned",
    "place",
    "resolve_gpu",
]

logger = logging.getLogger(__name__)

VERBS = "verbs"
# Closeness of a NIC to the GPU, best first (nvidia-smi topo: PIX/PXB, PHB, NODE, SYS).
SAME_SWITCH, SAME_HOST_BRIDGE, SAME_NODE, REMOTE = range(4)
_CLOSENESS = {
    SAME_SWITCH: "shares PCIe switch {anchor} with the GPU",
    SAME_HOST_BRIDGE: "shares host bridge {anchor} with the GPU but no PCIe switch",
    SAME_NODE: "is on the GPU's NUMA node {node} but behind another host bridge",
    REMOTE: "is NUMA-remote from the GPU (on another node)",
}
_BUS_ID = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])")
_HOST_BRIDGE = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}")
_CPU_RANGE = re.compile(r"(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?")

# "No preference" is said once per process, not once per call (a module-level flag).
_said_no_preference = False

_T = TypeVar("_T")


@dataclass(frozen=True)
class Nic:
    """A network device found in sysfs.

    Attributes:
        name: RDMA device name (``mlx5_0``) or, for a plain Ethernet NIC, its interface name.
        rdma: whether it is an RDMA device (listed under ``class/infiniband``).
        bus_id: its PCI bus id; ``None`` for a device without one (soft RoCE).
        numa_node: the NUMA node its ``numa_node`` file names; ``None`` when unknown (-1).
        chain: the sysfs path components from the host bridge down to the device.
    """

    name: str
    rdma: bool
    bus_id: str | None
    numa_node: int | None
    chain: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Placement:
    """Where this process's data plane and loader threads should run.

    Attributes:
        gpu_bus_id: the PCI bus id of the process's GPU, ``None`` without one.
        nic: the NIC to bind the data plane to, ``None`` for no preference.
        rail: ``"verbs"`` when ``nic`` is an RDMA device; ``None`` otherwise (``tcp`` or ``shm`` is
            decided by the rail registry, not here).
        cores: the cores to pin loader threads to; all allowed cores when there is no preference.
        numa_node: the NUMA node of the GPU (or of a forced NIC when there is no GPU), if known.
        reason: why this NIC and these cores, for the log and for status pages.
    """

    gpu_bus_id: str | None
    nic: str | None
    rail: str | None
    cores: tuple[int, ...]
    numa_node: int | None
    reason: str


def normalize_bus_id(bus_id: str | bytes) -> str:
    """``dddd:bb:dd.f`` in lower case from sysfs (``0000:3b:00.0``) or NVML (``00000000:3B:00.0``) form.

    Raises:
        ConfigError: ``bus_id`` is not a PCI bus id.
    """
    text = (bus_id.decode("ascii", "replace") if isinstance(bus_id, bytes) else str(bus_id)).strip().lower()
    m = _BUS_ID.fullmatch(text)
    if m is None or int(m.group(3), 16) > 0x1F:
        raise ConfigError(
            f"{bus_id!r} is not a PCI bus id (expected like 0000:3b:00.0)", field="gpu_bus_id", value=bus_id
        )
    domain, bus, dev, fn = (int(g, 16) if g else 0 for g in m.groups())
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"


def parse_cpulist(text: str) -> frozenset[int]:
    """The cores of a kernel cpulist such as ``0-23,48-71`` (also ``0-31:2/8``: 2 of every 8).

    Raises:
        ConfigError: the text is not a cpulist.
    """
    cores: set[int] = set()
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        m = _CPU_RANGE.fullmatch(part)
        first = int(m.group(1)) if m else 0
        last = int(m.group(2)) if m and m.group(2) else first
        used, group = (int(m.group(3)), int(m.group(4))) if m and m.group(3) else (1, 1)
        if m is None or last < first or not 0 < used <= group:
            raise ConfigError(f"bad cpulist {text.strip()!r} at {part!r}", field="cpulist", value=text)
        cores.update(c for c in range(first, last + 1) if (c - first) % group < used)
    return frozenset(cores)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _chain(root: str, link: str) -> tuple[str, ...]:
    """Components from the host bridge down to the last PCI device on the way to ``link``'s target."""
    devices = os.path.realpath(os.path.join(root, "devices"))
    target = os.path.realpath(link)
    if not os.path.exists(target) or os.path.commonpath([devices, target]) != devices:
        return ()
    parts = os.path.relpath(target, devices).split(os.sep)
    start = next((i for i, p in enumerate(parts) if _HOST_BRIDGE.fullmatch(p)), None)
    if start is None:
        return ()
    parts = parts[start:]
    ends = [i for i, p in enumerate(parts) if _BUS_ID.fullmatch(p)]
    return tuple(parts[: ends[-1] + 1]) if ends else ()


def _numa(root: str, chain: tuple[str, ...]) -> int | None:
    """The device's NUMA node; ``None`` when unknown (the kernel writes -1)."""
    text = _read(os.path.join(root, "devices", *chain, "numa_node")) if chain else None
    return int(text) if text and text.isdigit() else None


def find_nics(root: str = "/sys") -> list[Nic]:
    """RDMA devices of ``<root>/class/infiniband``, then PCI Ethernet NICs of ``<root>/class/net``.

    A net interface whose PCI device is also an RDMA device (IPoIB, RoCE) is listed once, under its
    RDMA name; interfaces without a PCI device (``lo``, bridges, veth) are not NICs and are skipped.
    """
    nics: list[Nic] = []
    for rdma, cls in ((True, "infiniband"), (False, "net")):
        base = os.path.join(root, "class", cls)
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            chain = _chain(root, os.path.join(base, name, "device"))
            bus_id = chain[-1] if chain else None
            if not rdma and (bus_id is None or any(n.bus_id == bus_id for n in nics)):
                continue
            nics.append(Nic(name, rdma, bus_id, _numa(root, chain), chain))
    return nics


def _visible_devices(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: ``None`` when unset; entries up to the first invalid one."""
    if value is None:
        return None
    visible = []
    for entry in (e.strip() for e in value.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        visible.append(entry)
    return visible


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def _bus_id_by_entry(nvml: Any, entry: str, order: str) -> tuple[str | None, str]:
    """Bus id of one CUDA_VISIBLE_DEVICES entry: a CUDA device index or a GPU/MIG UUID."""
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    if entry.startswith("MIG-"):
        handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvml.nvmlDeviceGetHandleByUUID(entry))
        return normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId), f"MIG instance {entry}"
    if entry.startswith("GPU-"):  # CUDA accepts any unambiguous UUID prefix
        matches = [h for h in handles if _text(nvml.nvmlDeviceGetUUID(h)).startswith(entry)]
        if len(matches) != 1:
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(matches)} GPUs",
                field="CUDA_VISIBLE_DEVICES",
                value=entry,
            )
        return normalize_bus_id(nvml.nvmlDeviceGetPciInfo(matches[0]).busId), f"GPU {entry}"
    if not handles:
        return None, "NVML sees no GPU"
    index = int(entry)
    if index >= count:
        raise ConfigError(
            f"CUDA device {index} does not exist: this host has {count} GPUs", field="CUDA_VISIBLE_DEVICES", value=entry
        )
    # CUDA numbers devices in its own order; NVML's index order is not promised to be anything, so
    # both CUDA orders are rebuilt from bus ids. PCI_BUS_ID is bus-id order. FASTEST_FIRST (the
    # default) puts the fastest device first and leaves the rest unspecified: for GPUs of one model
    # that is bus-id order; for mixed models it cannot be derived from NVML, so we refuse to guess.
    bus_ids = sorted(normalize_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId) for h in handles)
    if order != "PCI_BUS_ID" and len({_text(nvml.nvmlDeviceGetName(h)) for h in handles}) > 1:
        logger.warning(
            "GPUs of mixed models and CUDA_DEVICE_ORDER=%s: CUDA's device order is unknown here; set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID or pass gpu_bus_id for a NIC and core preference",
            order or "FASTEST_FIRST",
        )
        return None, "CUDA's FASTEST_FIRST order is ambiguous on a host with mixed GPU models"
    return bus_ids[index], f"CUDA device {index} in {'PCI_BUS_ID' if order == 'PCI_BUS_ID' else 'FASTEST_FIRST'} order"


def resolve_gpu(environ: Mapping[str, str], *, device: int | None = None, nvml: Any = None) -> tuple[str | None, str]:
    """The PCI bus id of the GPU this process uses, and how it was found (or why there is none).

    The process's device ordinal is ``device`` (e.g. ``torch.cuda.current_device()``), else
    ``LOCAL_RANK``, else 0. It indexes ``CUDA_VISIBLE_DEVICES`` when set; a list of exactly one
    device means that device whatever the rank (launchers that give each rank one GPU). Indices in
    that list follow ``CUDA_DEVICE_ORDER`` over all GPUs of the host.

    Args:
        environ: the process environment (the caller passes ``os.environ``).
        device: the CUDA device ordinal inside this process, overriding ``LOCAL_RANK``.
        nvml: an object with the ``pynvml`` API; ``pynvml`` itself when ``None``.

    Raises:
        ConfigError: the ordinal, ``LOCAL_RANK`` or ``CUDA_VISIBLE_DEVICES`` names no device.
    """
    visible = _visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if visible == []:
        return None, "CUDA_VISIBLE_DEVICES hides every GPU"
    if device is None:
        rank = environ.get("LOCAL_RANK", "0").strip() or "0"
        if not rank.isdigit():
            raise ConfigError(
                f"LOCAL_RANK must be a non-negative integer, not {rank!r}",
                field="LOCAL_RANK",
                value=rank,
                source="environment",
            )
        device = int(rank)
    if not isinstance(device, int) or device < 0:
        raise ConfigError(f"device must be a non-negative integer, not {device!r}", field="device", value=device)
    if visible is None:
        entry = str(device)
    elif len(visible) == 1 or device < len(visible):
        entry = visible[0 if len(visible) == 1 else device]
    else:
        raise ConfigError(
            f"device {device} is not among the {len(visible)} of CUDA_VISIBLE_DEVICES",
            field="CUDA_VISIBLE_DEVICES",
            value=environ.get("CUDA_VISIBLE_DEVICES"),
        )
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")  # here: hosts without the NVIDIA stack still import this module
        except ImportError:
            return None, "nvidia-ml-py is not installed"
    nvml_error = getattr(nvml, "NVMLError", OSError)
    try:
        nvml.nvmlInit()
    except (nvml_error, OSError) as exc:
        return None, f"NVML is unavailable ({exc})"
    try:
        return _bus_id_by_entry(nvml, entry, environ.get("CUDA_DEVICE_ORDER", "").strip().upper())
    except (nvml_error, OSError) as exc:
        return None, f"NVML cannot resolve GPU {entry} ({exc})"
    finally:
        try:
            nvml.nvmlShutdown()
        except (nvml_error, OSError):
            logger.debug("nvmlShutdown failed", exc_info=True)


def _closeness(gpu_chain: tuple[str, ...], gpu_node: int | None, nic: Nic) -> tuple[int, int, str]:
    """(tier, -depth of the deepest common ancestor, anchor) of ``nic`` seen from the GPU."""
    common = 0
    for a, b in zip(gpu_chain, nic.chain):
        if a != b:
            break
        common += 1
    if common >= 2:  # a shared PCI bridge below the host bridge: the same switch tree
        return SAME_SWITCH, -common, gpu_chain[common - 1]
    if common == 1:
        return SAME_HOST_BRIDGE, -1, gpu_chain[0]
    if gpu_node is not None and nic.numa_node == gpu_node:
        return SAME_NODE, 0, ""
    return REMOTE, 0, ""


def _cores(root: str, node: int | None, allowed: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    if node is None:
        return allowed, "all allowed cores (NUMA node unknown)"
    path = os.path.join(root, "devices", "system", "node", f"node{node}", "cpulist")
    text = _read(path)
    if text is None:
        return allowed, f"all allowed cores ({path} is unreadable)"
    mine = tuple(sorted(parse_cpulist(text).intersection(allowed)))
    if not mine:
        return allowed, f"all allowed cores (none of NUMA node {node}'s cores {text} is allowed to this process)"
    return mine, f"cores of NUMA node {node}"


def _say_no_preference(reason: str) -> None:
    global _said_no_preference
    if not _said_no_preference:
        _said_no_preference = True
        logger.debug("topology: no NIC or core preference: %s", reason)


def place(
    root: str = "/sys",
    *,
    environ: Mapping[str, str] | None = None,
    device: int | None = None,
    gpu_bus_id: str | None = None,
    nic: str | None = None,
    allowed_cores: Iterable[int] | None = None,
    nvml: Any = None,
) -> Placement:
    """Choose the NIC and cores for this process from its GPU's place in the PCIe tree.

    NICs rank by closeness to the GPU: same PCIe switch (deepest common bridge first), then same host
    bridge, then same NUMA node, then the rest; ties go to the first name. RDMA NICs are the
    candidates when there are any, plain Ethernet NICs otherwise. Without a GPU or a NIC there is
    no preference, said once in the log; that is not an error.

    Args:
        root: the sysfs root.
        environ: the process environment, for :func:`resolve_gpu` (the caller passes ``os.environ``).
        device: the CUDA device ordinal inside this process, see :func:`resolve_gpu`.
        gpu_bus_id: the GPU's PCI bus id, instead of asking NVML.
        nic: a NIC forced by the operator; used whatever its distance from the GPU.
        allowed_cores: the cores this process may use; ``os.sched_getaffinity(0)`` when ``None``.
        nvml: an object with the ``pynvml`` API, for tests.

    Raises:
        ConfigError: a forced NIC or a given GPU bus id is not on this host, or the environment
            names no device (see :func:`resolve_gpu`).
    """
    allowed = tuple(sorted(set(os.sched_getaffinity(0) if allowed_cores is None else allowed_cores)))
    nics = find_nics(root)
    forced = None
    if nic is not None:
        forced = next((n for n in nics if n.name == nic), None)
        if forced is None:
            found = ", ".join(n.name for n in nics) or "none"
            raise ConfigError(
                f"NIC {nic!r} is not on this host (NICs found under {root}: {found})", field="rdma.nic", value=nic
            )
    gpu: str | None
    if gpu_bus_id is not None:
        gpu, how = normalize_bus_id(gpu_bus_id), "given"
        if not os.path.exists(os.path.join(root, "bus", "pci", "devices", gpu)):
            raise ConfigError(f"GPU {gpu} is not in {root}/bus/pci/devices", field="gpu_bus_id", value=gpu_bus_id)
    else:
        gpu, how = resolve_gpu(environ or {}, device=device, nvml=nvml)
    gpu_chain = _chain(root, os.path.join(root, "bus", "pci", "devices", gpu)) if gpu else ()
    if gpu and not gpu_chain:
        how = f"GPU {gpu} ({how}) has no PCI device under {root}"
    gpu_node = _numa(root, gpu_chain)
    candidates = [n for n in nics if n.rdma] or nics
    chosen, why = forced, ""
    if gpu_chain and candidates:
        ranked = sorted(candidates, key=lambda n: (_closeness(gpu_chain, gpu_node, n)[:2], n.name))
        chosen = forced or ranked[0]
        tier, _, anchor = _closeness(gpu_chain, gpu_node, chosen)
        why = f"{chosen.name} {_CLOSENESS[tier].format(anchor=anchor, node=gpu_node)}"
        why = f"{why}; forced by the operator (nearest: {ranked[0].name})" if forced else f"nearest NIC {why}"
    elif forced is not None:
        why = f"{forced.name} forced by the operator"
    else:
        missing = how if not gpu_chain else f"no NIC under {root}/class"
        _say_no_preference(missing)
        why = "no NIC preference" if not gpu_chain else f"no NIC preference: {missing}"
    node = gpu_node if gpu_chain else (forced.numa_node if forced else None)
    cores, cores_why = _cores(root, node, allowed)
    placement = Placement(
        gpu,
        chosen.name if chosen else None,
        VERBS if chosen and chosen.rdma else None,
        cores,
        node,
        f"{f'GPU {gpu} ({how})' if gpu_chain else f'no GPU: {how}'}; {why}; {cores_why}",
    )
    if chosen is not None or gpu_chain:
        logger.debug(
            "topology: nic=%s rail=%s cores=%s: %s",
            placement.nic,
            placement.rail,
            _format_cores(cores),
            placement.reason,
        )
    return placement


def _format_cores(cores: Iterable[int]) -> str:
    """``0-23,48-71`` for logs: the cpulist form of ``cores``."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin(cores: Iterable[int], *, all_threads: bool = False) -> None:
    """Restrict the calling thread (or every thread of this process) to ``cores``.

    On Linux ``sched_setaffinity(0, ...)`` applies to the calling thread only, and threads inherit
    their creator's mask: pin from the main thread before starting loader threads, use
    :func:`pinned` inside a thread, or pass ``all_threads=True`` to pin the threads already running.
    An empty ``cores`` means no preference and changes nothing.

    Raises:
        ConfigError: the kernel refuses the mask (cores that do not exist or are not allowed).
    """
    mask = set(cores)
    if not mask:
        return
    tids = [0]
    if all_threads:
        tids = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            continue  # the thread exited meanwhile
        except (OSError, ValueError, OverflowError) as exc:
            raise ConfigError(
                f"cannot pin to cores {_format_cores(mask)}: {exc}", field="cores", value=sorted(mask)
            ) from exc


def pinned(cores: Iterable[int], target: Callable[..., _T]) -> Callable[..., _T]:
    """``target`` wrapped to pin its thread to ``cores`` first: ``Thread(target=pinned(cores, loop))``."""
    mask = tuple(cores)

    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> _T:
        pin(mask)
        return target(*args, **kwargs)

    return run
