"""The device check's probes of the machine: what it is (``env``) and whether a device ring's
memory can be exported as a dma-buf, viewed, written and flushed (``dmabuf``). Each runs in its
own process (``device_check.py --probe NAME``) and returns a JSON-able dict."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["FAILED", "PASSED", "PROBES", "SKIPPED", "runtime"]

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


def probe_env() -> dict:
    """The GPU, driver and link, the runtime and the versions of what the parts use."""
    import torch

    found: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "runtime": runtime(),
        "dev_shm_bytes": shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None,
        "memlock": _memlock(),
    }
    for name in ("torchvision", "numpy", "cupy", "cuda.bindings", "pynvml", "grpc", "google.protobuf"):
        found[name] = _version(name)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found["gpu"] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
    found["nvml"] = _nvml()
    return found


def runtime() -> dict:
    """What the machine runs in, with the evidence (kernel, virtualisation, container)."""
    evidence = {"kernel": platform.release()}
    for name, path in (("hypervisor", "/sys/hypervisor/type"), ("product", "/sys/class/dmi/id/product_name")):
        with contextlib.suppress(OSError):
            evidence[name] = Path(path).read_text().strip()
    if shutil.which("systemd-detect-virt"):
        out = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True, check=False)
        evidence["systemd-detect-virt"] = out.stdout.strip() or out.stderr.strip()
    kernel = evidence["kernel"]
    if "-fc-" in kernel:
        kind = "Firecracker microVM (its kernel's name)"
    elif kernel == "4.4.0":
        kind = "gVisor (the kernel version it reports)"
    else:
        kind = evidence.get("systemd-detect-virt") or "not recognised"
    return {"kind": kind, "evidence": evidence}


def _memlock() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def _version(module: str) -> str | None:
    try:
        imported = __import__(module, fromlist=["_"])
    except Exception as exc:  # a missing or broken module is a finding, not a crash
        return f"not importable: {type(exc).__name__}: {exc}"
    return str(getattr(imported, "__version__", "present"))


def _nvml() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return {
                "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "pcie_gen": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle),
                "pcie_width": pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle),
                "pcie_max_gen": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML may be refused in a sandbox: recorded
        return {"error": f"{type(exc).__name__}: {exc}"}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def probe_dmabuf() -> dict:
    """Export a device ring's memory as a dma-buf, view it through cupy, write, flush and read it back."""
    import torch

    from kspeed.client.delivery.device_ring import CupyRingViews
    from kspeed.rdma.device_memory import DeviceMemory, gpudirect_unavailable

    found: dict = {"runtime": runtime()}
    why = gpudirect_unavailable(0)
    if why:
        return {**found, "status": SKIPPED, "reason": why}
    t0 = time.perf_counter()
    memory = DeviceMemory.allocate(0, 3 << 20)
    try:
        found["allocated_bytes"] = memory.nbytes
        found["dmabuf_fd_size"] = os.fstat(memory.fd).st_size
        found["flush_calls_driver"] = memory.flushes
        views = CupyRingViews(memory)
        tensor, lease = views.view(4096, 1 << 20)
        pattern = torch.arange(1 << 20, device=tensor.device).remainder(251).to(torch.uint8)
        tensor.copy_(pattern)
        t1 = time.perf_counter()
        views.flush()
        found["flush_us"] = round((time.perf_counter() - t1) * 1e6, 1)
        again, _ = views.view(4096, 1 << 20)
        found["bytes_equal_after_flush"] = bool(torch.equal(again, pattern))
        del tensor, again, lease
        torch.cuda.synchronize()
    finally:
        memory.close()
    found["seconds"] = round(time.perf_counter() - t0, 3)
    found["status"] = PASSED if found["bytes_equal_after_flush"] else FAILED
    return found


PROBES = {"env": probe_env, "dmabuf": probe_dmabuf}
