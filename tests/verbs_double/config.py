"""The double's device limits, its test knobs (read once from the environment) and its timer scaling.

Device limits (:data:`LIMITS`, also ``api.limits``) are those of a modest ConnectX-class NIC;
``create_*`` calls that ask for more fail with ``EINVAL`` as ``ibv_create_qp(3)``,
``ibv_create_cq(3)`` and ``ibv_create_srq(3)`` say a device may. The double gives exactly what was
asked for (hardware may round queue sizes up; a rail that stays within what it asked for works on
both).

Knobs (``api.knobs``, a :class:`Knobs`), read once when the double is imported, so child processes
started with ``python -m ...`` see the parent's settings through their environment:

* ``KSPEED_VERBS_DOUBLE_DEVICES``: comma-separated device names, default ``dbl0,dbl1``; an entry
  ``name:MTU`` (256, 512, 1024, 2048 or 4096) sets that port's ``active_mtu`` (default 4096); an
  empty value means "no RDMA device on this host".
* ``KSPEED_VERBS_DOUBLE_SEED``: seed of the NICs' deliberate reordering between queue pairs (default 0).
* ``KSPEED_VERBS_DOUBLE_TIMER_CAP``: seconds, the cap on every transport and RNR timer (default 0.05).
* ``KSPEED_VERBS_DOUBLE_JITTER``: seconds, the most a new burst of one QP's requests is held at the
  responder's NIC before it is served (default 0.002; 0 turns the deliberate reordering off).

Timers. The transport (ACK) timeout of a QP is the IB exponent ``timeout``: 4.096 us x 2^timeout
(``ibv_modify_qp(3)``; 0 means infinite), and the RNR timer is the 5-bit code of IBA table 45
(9.7.5.2.8; code 0 is 655.36 ms, 1 is 0.01 ms, ... 31 is 491.52 ms). The double uses those real
values capped at ``timer_cap_s``, so a dead peer is declared after at most
``(retry_cnt + 1) x timer_cap_s`` (0.4 s with the default cap and ``retry_cnt`` 7) and tests stay
fast; an infinite timeout (0) stays infinite. The transport timer runs only when something was
really lost (see ``requester``): a slow, loaded machine never causes a retry.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

from .base import e

__all__ = [
    "LIMITS",
    "MTU_BYTES",
    "DeviceSpec",
    "Knobs",
    "Limits",
    "gids_for",
    "rnr_delay_s",
    "transport_timeout_s",
]


@dataclass(frozen=True)
class Limits:
    """What every simulated device supports (``ibv_query_device`` would report these)."""

    max_qp_wr: int = 4096
    max_sge: int = 4
    max_inline_data: int = 64  # accepted at create_qp; posting inline data is refused by the double
    max_cqe: int = 65536
    max_srq_wr: int = 16384
    max_srq_sge: int = 4
    max_msg_sz: int = 1 << 31
    max_mr_size: int = 1 << 46
    max_qp_rd_atom: int = 16
    max_qp_init_rd_atom: int = 16
    max_qp: int = 1 << 16
    pkey_tbl_len: int = 1
    gid_tbl_len: int = 8  # four entries in use (see gids_for), four empty
    phys_port_cnt: int = 1


LIMITS = Limits()

#: ``IBV_MTU_*`` -> bytes.
MTU_BYTES = {
    int(e.IBV_MTU_256): 256,
    int(e.IBV_MTU_512): 512,
    int(e.IBV_MTU_1024): 1024,
    int(e.IBV_MTU_2048): 2048,
    int(e.IBV_MTU_4096): 4096,
}
_MTU_ENUM = {size: code for code, size in MTU_BYTES.items()}


@dataclass(frozen=True)
class DeviceSpec:
    """One simulated NIC: its name, its position in the device list and its port's active MTU."""

    name: str
    index: int
    active_mtu: int = int(e.IBV_MTU_4096)


def _parse_devices(text: str) -> list[DeviceSpec]:
    specs: list[DeviceSpec] = []
    for index, item in enumerate(part.strip() for part in text.split(",") if part.strip()):
        name, _, mtu = item.partition(":")
        if mtu:
            if int(mtu) not in _MTU_ENUM:
                raise ValueError(f"KSPEED_VERBS_DOUBLE_DEVICES: MTU {mtu} of {name!r} is not an IB MTU")
            specs.append(DeviceSpec(name, index, _MTU_ENUM[int(mtu)]))
        else:
            specs.append(DeviceSpec(name, index))
    if len({spec.name for spec in specs}) != len(specs):
        raise ValueError(f"KSPEED_VERBS_DOUBLE_DEVICES names a device twice: {text!r}")
    return specs


@dataclass
class Knobs:
    """Test settings of the double (see the module's docstring); may be changed at run time in-process."""

    devices: list[DeviceSpec] = field(default_factory=lambda: _parse_devices("dbl0,dbl1"))
    seed: int = 0
    timer_cap_s: float = 0.05
    #: Bytes one inbound connection may move per turn of the NIC loop before another gets its turn
    #: (this, with the seeded shuffling of ready connections, is what interleaves queue pairs).
    service_quantum: int = 256 << 10
    #: A new burst of requests on a connection (i.e. from one requester QP) waits a random moment of
    #: up to this many seconds before the responder's NIC serves it: what reorders QPs (0: never).
    reorder_jitter_s: float = 0.002
    #: Bytes of payload a requester queue pair hands to its socket per transmit step.
    transmit_batch: int = 4 << 20

    @classmethod
    def from_env(cls) -> Knobs:
        env = os.environ
        knobs = cls()
        if "KSPEED_VERBS_DOUBLE_DEVICES" in env:
            knobs.devices = _parse_devices(env["KSPEED_VERBS_DOUBLE_DEVICES"])
        if env.get("KSPEED_VERBS_DOUBLE_SEED"):
            knobs.seed = int(env["KSPEED_VERBS_DOUBLE_SEED"])
        if env.get("KSPEED_VERBS_DOUBLE_TIMER_CAP"):
            knobs.timer_cap_s = float(env["KSPEED_VERBS_DOUBLE_TIMER_CAP"])
        if env.get("KSPEED_VERBS_DOUBLE_JITTER"):
            knobs.reorder_jitter_s = float(env["KSPEED_VERBS_DOUBLE_JITTER"])
        return knobs

    def device(self, name: str) -> DeviceSpec | None:
        return next((spec for spec in self.devices if spec.name == name), None)


def transport_timeout_s(timeout: int, knobs: Knobs) -> float | None:
    """The local ACK timeout of ``ibv_qp_attr.timeout`` in seconds, capped; ``None`` for 0 (infinite)."""
    if timeout == 0:
        return None
    return min(4.096e-6 * (1 << timeout), knobs.timer_cap_s)


# IBA vol. 1, table 45 "Encoding for RNR NAK Timer Field" (milliseconds), indexed by the 5-bit code.
_RNR_TIMER_MS = (
    655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28, 1.92,
    2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88, 163.84, 245.76,
    327.68, 491.52,
)  # fmt: skip


def rnr_delay_s(code: int, knobs: Knobs) -> float:
    """How long a requester waits after an RNR NAK carrying timer ``code``, capped."""
    return min(_RNR_TIMER_MS[code & 31] / 1e3, knobs.timer_cap_s)


def gids_for(pid: int, spec: DeviceSpec) -> list[tuple[str, int]]:
    """The populated GID table entries of device ``spec`` opened by process ``pid``: ``(text, sysfs type)``.

    Laid out as mlx5 lays out a RoCE port with one IPv6 address: a link-local ``fe80::`` GID as
    RoCEv1 (index 0) and RoCEv2 (index 1), then the address itself as RoCEv1 (2) and RoCEv2 (3).
    The interface id holds the pid and a hash of the device name, so every (process, device) has
    its own GIDs (also across differently configured ``VerbsDouble`` instances in one process).
    Types are ``ibv_query_gid_type``'s: ``IBV_GID_TYPE_SYSFS_IB_ROCE_V1`` (0) or
    ``IBV_GID_TYPE_SYSFS_ROCE_V2`` (1) -- *not* ``IBV_GID_TYPE_ROCE_V2`` (2), which is
    ``ibv_query_gid_ex``'s enum (rdma-core ``libibverbs/verbs.c``, ``ibv_query_gid_type``).
    """
    name_hash = zlib.crc32(spec.name.encode()) & 0xFFFF
    iid = f"6b73:{pid >> 16 & 0xFFFF:04x}:{pid & 0xFFFF:04x}:{name_hash:04x}"
    v1, v2 = int(e.IBV_GID_TYPE_SYSFS_IB_ROCE_V1), int(e.IBV_GID_TYPE_SYSFS_ROCE_V2)
    link_local = f"fe80:0000:0000:0000:{iid}"
    ula = f"fd6b:7370:6565:6400:{iid}"
    return [(link_local, v1), (link_local, v2), (ula, v1), (ula, v2)]
