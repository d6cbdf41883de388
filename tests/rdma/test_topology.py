"""Topology: GPU -> nearest NIC -> NUMA cores, on fixture sysfs trees and a fake NVML."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from kspeed.errors import ConfigError
from kspeed.rdma import topology
from kspeed.rdma.topology import find_nics, normalize_bus_id, parse_cpulist, pin, pinned, place, resolve_gpu
from tests.rdma.topology_fixtures import NODE0_CORES, NODE1_CORES, SysfsTree, bare, dgx_like, two_socket

ALL_CORES = range(96)


@pytest.fixture(autouse=True)
def _fresh_log_flag(monkeypatch):
    monkeypatch.setattr(topology, "_said_no_preference", False)


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """The slice of the pynvml API that topology uses. ``gpus``: (bus id, name, uuid) in NVML's order."""

    NVMLError = FakeNvmlError

    def __init__(self, gpus, *, fail_init=False, migs=None):
        self.gpus = gpus
        self.migs = migs or {}  # MIG uuid -> index of its parent GPU
        self.fail_init = fail_init
        self.open = 0

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNvmlError("NVML Shared Library Not Found")
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.migs:
            raise FakeNvmlError(f"no device {uuid}")
        return ("mig", self.migs[uuid])

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        return handle[1]

    def nvmlDeviceGetUUID(self, handle):
        return self.gpus[handle][2].encode()

    def nvmlDeviceGetName(self, handle):
        return self.gpus[handle][1]

    def nvmlDeviceGetPciInfo(self, handle):
        return type("PciInfo", (), {"busId": self.gpus[handle][0].encode()})()


# NVML's own index order need not be PCI order: here it is scrambled on purpose.
SAME_MODEL = [
    ("00000000:86:00.0", "A100", "GPU-cc"),
    ("00000000:18:00.0", "A100", "GPU-aa"),
    ("00000000:3B:00.0", "A100", "GPU-bb"),
    ("00000000:AF:00.0", "A100", "GPU-dd"),
]
MIXED = [("00000000:18:00.0", "T4", "GPU-aa"), ("00000000:3B:00.0", "A100", "GPU-bb")]


def cpus(text):
    return tuple(sorted(parse_cpulist(text)))


# --- the 8-GPU server of Fig. 8 -------------------------------------------------------------------


def test_each_gpu_picks_the_nic_on_its_switch_and_its_nodes_cores(tmp_path):
    host = dgx_like(tmp_path)
    assert len(host.gpus) == 8
    for gpu in host.gpus:
        p = place(host.root, gpu_bus_id=gpu, allowed_cores=ALL_CORES)
        assert p.nic == host.nic_of[gpu], p.reason
        assert p.rail == "verbs"
        assert p.numa_node == host.node_of[gpu]
        assert p.cores == cpus(NODE0_CORES if host.node_of[gpu] == 0 else NODE1_CORES)
        assert "shares PCIe switch" in p.reason and gpu in p.reason


def test_two_gpus_share_each_nic(tmp_path):
    host = dgx_like(tmp_path)
    chosen = [place(host.root, gpu_bus_id=g, allowed_cores=ALL_CORES).nic for g in host.gpus]
    assert chosen == ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1", "mlx5_2", "mlx5_2", "mlx5_3", "mlx5_3"]


def test_nics_found_once_each_with_their_numa_node(tmp_path):
    host = dgx_like(tmp_path)
    SysfsTree(tmp_path).soft_rdma("rxe0")
    nics = {n.name: n for n in find_nics(host.root)}
    # ib0..ib3 are the mlx5 devices' own interfaces and lo has no device: neither is listed.
    assert sorted(nics) == ["eno1", "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "rxe0"]
    assert (nics["mlx5_2"].numa_node, nics["mlx5_2"].bus_id, nics["mlx5_2"].rdma) == (1, "0000:8a:00.0", True)
    assert (nics["eno1"].rdma, nics["rxe0"].bus_id, nics["rxe0"].numa_node) == (False, None, None)
    assert os.path.islink(os.path.join(host.root, "bus", "pci", "devices", host.gpus[0]))


def test_allowed_cores_narrow_the_nodes_cores(tmp_path):
    host = dgx_like(tmp_path)
    p = place(host.root, gpu_bus_id=host.gpus[7], allowed_cores=[0, 1, 30, 31, 95])
    assert p.cores == (30, 31, 95)
    # None of node 1's cores allowed: keep what the process may use, and say so.
    p = place(host.root, gpu_bus_id=host.gpus[7], allowed_cores=[0, 1])
    assert p.cores == (0, 1) and p.nic == "mlx5_3"
    assert "none of NUMA node 1's cores" in p.reason


def test_bus_id_forms_are_normalized(tmp_path):
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id(b"00000000:3B:00.0\n") == "0000:3b:00.0"
    assert normalize_bus_id("3b:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0001:0A:1F.7") == "0001:0a:1f.7"
    for bad in ("", "3b:00", "0000:3b:20.0", "0000:3b:00.8", "gpu0", "0000:3bb:00.0"):
        with pytest.raises(ConfigError):
            normalize_bus_id(bad)
    host = dgx_like(tmp_path)
    nvml_form = "00000000:" + host.gpus[2][5:].upper()
    assert place(host.root, gpu_bus_id=nvml_form, allowed_cores=ALL_CORES).nic == "mlx5_1"


def test_given_gpu_that_is_not_on_the_host_is_an_error(tmp_path):
    host = dgx_like(tmp_path)
    with pytest.raises(ConfigError, match=r"0000:99:00\.0"):
        place(host.root, gpu_bus_id="0000:99:00.0", allowed_cores=ALL_CORES)


# --- forced NIC ----------------------------------------------------------------------------------


def test_forced_nic_is_used_and_the_reason_says_so(tmp_path):
    host = dgx_like(tmp_path)
    p = place(host.root, gpu_bus_id=host.gpus[0], nic="mlx5_3", allowed_cores=ALL_CORES)
    assert (p.nic, p.rail, p.numa_node) == ("mlx5_3", "verbs", 0)
    assert p.cores == cpus(NODE0_CORES)  # cores still follow the GPU
    assert "forced by the operator (nearest: mlx5_0)" in p.reason
    p = place(host.root, gpu_bus_id=host.gpus[0], nic="eno1", allowed_cores=ALL_CORES)
    assert (p.nic, p.rail) == ("eno1", None)


def test_forced_nic_that_does_not_exist_lists_the_nics_found(tmp_path):
    host = dgx_like(tmp_path)
    with pytest.raises(ConfigError) as err:
        place(host.root, gpu_bus_id=host.gpus[0], nic="mlx5_9", allowed_cores=ALL_CORES)
    assert "mlx5_9" in str(err.value) and "mlx5_0, mlx5_1, mlx5_2, mlx5_3, eno1" in str(err.value)
    assert err.value.field == "rdma.nic"
    with pytest.raises(ConfigError, match=r"found under .*: none"):
        place(bare(tmp_path / "bare").root, nic="mlx5_0", allowed_cores=ALL_CORES)


def test_forced_nic_without_gpu_takes_its_nodes_cores(tmp_path):
    host = dgx_like(tmp_path)
    p = place(host.root, environ={"CUDA_VISIBLE_DEVICES": ""}, nic="mlx5_2", allowed_cores=ALL_CORES)
    assert (p.gpu_bus_id, p.nic, p.numa_node) == (None, "mlx5_2", 1)
    assert p.cores == cpus(NODE1_CORES)


# --- ranking on a two-socket host ----------------------------------------------------------------


def test_only_remote_nics_fall_back_to_the_first_by_name(tmp_path):
    host = two_socket(tmp_path)
    p = place(host.root, gpu_bus_id=host.gpus[0], allowed_cores=range(32))
    assert p.nic == "mlx5_0" and p.rail == "verbs"
    assert "nearest NIC mlx5_0 is NUMA-remote" in p.reason
    assert p.cores == tuple(range(16, 32)) and p.numa_node == 1


def test_same_numa_node_beats_remote(tmp_path):
    host = two_socket(tmp_path, socket1_nic=True)
    p = place(host.root, gpu_bus_id=host.gpus[0], allowed_cores=range(32))
    assert p.nic == "mlx5_2"
    assert "NUMA node 1 but behind another host bridge" in p.reason


def test_same_host_bridge_beats_same_numa_node(tmp_path):
    host = two_socket(tmp_path, socket1_nic=True, bridge_nic=True)
    p = place(host.root, gpu_bus_id=host.gpus[0], allowed_cores=range(32))
    assert p.nic == "mlx5_3"
    assert "host bridge pci0000:85" in p.reason


def test_without_rdma_nics_the_nearest_ethernet_nic_is_chosen(tmp_path):
    tree = SysfsTree(tmp_path)
    gpu = tree.gpu("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0", numa_node=0)
    tree.net_nic("eth1", "pci0000:40", "0000:40:01.0", "0000:41:00.0", numa_node=0)
    tree.net_nic("eth0", "pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:04.0", "0000:04:00.0", numa_node=0)
    tree.node(0, "0-1")
    p = place(str(tmp_path), gpu_bus_id=gpu, allowed_cores=[0, 1])
    assert (p.nic, p.rail) == ("eth0", None)
    assert "PCIe switch 0000:01:00.0" in p.reason


# --- no GPU, no NIC ------------------------------------------------------------------------------


def test_host_without_gpu_or_nic_says_no_preference_once(tmp_path, caplog):
    host = bare(tmp_path)
    caplog.set_level(logging.DEBUG, logger="kspeed.rdma.topology")
    nvml = FakeNvml([], fail_init=True)
    for _ in range(3):
        p = place(host.root, environ={}, nvml=nvml, allowed_cores=[0, 1, 2, 3])
        assert (p.gpu_bus_id, p.nic, p.rail, p.numa_node) == (None, None, None, None)
        assert p.cores == (0, 1, 2, 3)
        assert "NVML is unavailable" in p.reason
    said = [r for r in caplog.records if "no NIC or core preference" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG  # a library's detail: quiet at INFO


def test_gpu_without_nic_still_gets_its_nodes_cores(tmp_path):
    tree = SysfsTree(tmp_path)
    gpu = tree.gpu("pci0000:00", "0000:00:02.0", "0000:01:00.0", numa_node=0)
    tree.node(0, "0-3")
    p = place(str(tmp_path), gpu_bus_id=gpu, allowed_cores=range(8))
    assert (p.nic, p.rail, p.cores) == (None, None, (0, 1, 2, 3))
    assert "no NIC under" in p.reason


def test_the_real_host_places_without_error():
    p = place(environ={"LOCAL_RANK": "0"})  # real /sys and real nvidia-ml-py (NVML may be missing)
    if p.gpu_bus_id is None:
        assert p.cores == tuple(sorted(os.sched_getaffinity(0)))


# --- CUDA device order ---------------------------------------------------------------------------


def test_cuda_indices_map_through_bus_id_order_not_nvml_index_order():
    nvml = FakeNvml(SAME_MODEL)
    assert resolve_gpu({}, nvml=nvml)[0] == "0000:18:00.0"
    assert resolve_gpu({"LOCAL_RANK": "3"}, nvml=nvml)[0] == "0000:af:00.0"
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "LOCAL_RANK": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert resolve_gpu(env, nvml=nvml)[0] == "0000:af:00.0"
    assert resolve_gpu(env, device=0, nvml=nvml)[0] == "0000:86:00.0"
    assert nvml.open == 0  # every nvmlInit was paired with nvmlShutdown


def test_fastest_first_on_one_model_is_pci_order():
    nvml = FakeNvml(SAME_MODEL)
    gpu, how = resolve_gpu({"LOCAL_RANK": "1"}, nvml=nvml)
    assert (gpu, how) == ("0000:3b:00.0", "CUDA device 1 in FASTEST_FIRST order")


def test_fastest_first_on_mixed_models_refuses_to_guess(caplog):
    nvml = FakeNvml(MIXED)
    gpu, how = resolve_gpu({"LOCAL_RANK": "1"}, nvml=nvml)
    assert gpu is None and "ambiguous" in how
    assert any("CUDA_DEVICE_ORDER=PCI_BUS_ID" in r.getMessage() for r in caplog.records)
    env = {"LOCAL_RANK": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert resolve_gpu(env, nvml=nvml)[0] == "0000:3b:00.0"


def test_visible_devices_forms():
    nvml = FakeNvml(SAME_MODEL)
    # One visible device is this rank's GPU whatever its LOCAL_RANK (one-GPU-per-process launchers).
    assert resolve_gpu({"CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "5"}, nvml=nvml)[0] == "0000:3b:00.0"
    assert resolve_gpu({"CUDA_VISIBLE_DEVICES": "GPU-dd"}, nvml=nvml)[0] == "0000:af:00.0"
    for hidden in ("", "-1", "NoDevFiles"):
        gpu, how = resolve_gpu({"CUDA_VISIBLE_DEVICES": hidden}, nvml=nvml)
        assert (gpu, how) == (None, "CUDA_VISIBLE_DEVICES hides every GPU")
    # CUDA stops at the first invalid entry.
    with pytest.raises(ConfigError, match="not among the 2"):
        resolve_gpu({"CUDA_VISIBLE_DEVICES": "0,3,-1,2", "LOCAL_RANK": "2"}, nvml=nvml)
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        resolve_gpu({"LOCAL_RANK": "one"}, nvml=nvml)
    with pytest.raises(ConfigError, match="host has 4 GPUs"):
        resolve_gpu({"LOCAL_RANK": "4"}, nvml=nvml)
    with pytest.raises(ConfigError, match="matches 4 GPUs"):
        resolve_gpu({"CUDA_VISIBLE_DEVICES": "GPU-"}, nvml=nvml)
    assert resolve_gpu({}, nvml=FakeNvml([]))[0] is None
    gpu, how = resolve_gpu({"CUDA_VISIBLE_DEVICES": "MIG-0b"}, nvml=FakeNvml(SAME_MODEL, migs={"MIG-0b": 3}))
    assert (gpu, how) == ("0000:af:00.0", "MIG instance MIG-0b")
    gpu, how = resolve_gpu({"CUDA_VISIBLE_DEVICES": "MIG-0a"}, nvml=nvml)
    assert gpu is None and "NVML cannot resolve" in how
    assert nvml.open == 0


def test_place_through_nvml_on_the_dgx_tree(tmp_path):
    host = dgx_like(tmp_path)
    nvml = FakeNvml([("00000000:" + g[5:].upper(), "A100", f"GPU-{i}") for i, g in enumerate(host.gpus)])
    for rank in range(8):
        p = place(host.root, environ={"LOCAL_RANK": str(rank)}, nvml=nvml, allowed_cores=ALL_CORES)
        assert (p.gpu_bus_id, p.nic) == (host.gpus[rank], host.nic_of[host.gpus[rank]])
        assert f"CUDA device {rank}" in p.reason


# --- cpulist and pinning -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("", ()),
        ("\n", ()),
        ("0", (0,)),
        ("0-3", (0, 1, 2, 3)),
        ("3-3", (3,)),
        (" 1 , 4-5 \n", (1, 4, 5)),
        ("0-1,0-1", (0, 1)),
        ("0-7:2/4", (0, 1, 4, 5)),
        ("0-23,48-71", tuple([*range(24), *range(48, 72)])),
    ],
)
def test_cpulist(text, cores):
    assert tuple(sorted(parse_cpulist(text))) == cores


@pytest.mark.parametrize("text", ["3-1", "a", "1-", "-1", "0-3:0/4", "0-3:5/4", "1;2", "0x1"])
def test_bad_cpulist(text):
    with pytest.raises(ConfigError, match="cpulist"):
        parse_cpulist(text)


def test_pinned_thread_runs_on_its_cores_only():
    allowed = sorted(os.sched_getaffinity(0))
    seen = {}
    thread = threading.Thread(target=pinned([allowed[-1]], lambda: seen.update(mask=os.sched_getaffinity(0))))
    thread.start()
    thread.join()
    assert seen["mask"] == {allowed[-1]}
    assert sorted(os.sched_getaffinity(0)) == allowed  # the caller's thread is untouched
    pin([])  # no preference: nothing changes
    assert sorted(os.sched_getaffinity(0)) == allowed


def test_pin_all_threads_reaches_threads_already_running():
    allowed = sorted(os.sched_getaffinity(0))
    started, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), done.wait(5)))
    worker.start()
    started.wait(5)
    try:
        pin([allowed[0]], all_threads=True)
        assert os.sched_getaffinity(worker.native_id) == {allowed[0]}
        assert os.sched_getaffinity(0) == {allowed[0]}
    finally:
        pin(allowed, all_threads=True)
        done.set()
        worker.join()
    assert sorted(os.sched_getaffinity(0)) == allowed


def test_pin_refuses_cores_that_do_not_exist():
    with pytest.raises(ConfigError, match="cannot pin"):
        pin([1 << 20])
