"""The KSpeed side of the client benchmark: a private local cluster and the client library as a source.

``BenchCluster`` starts a :class:`kspeed.cli.cluster.LocalCluster` (one manager, two servers, auth off,
loopback only, metrics on their HTTP ports) with its state in a temporary directory and its pools
in a temporary directory under ``/dev/shm``; ``close()`` stops every daemon and removes both.
Sample sets are registered by the operator (so they stay until removed), preloaded, and removed
again after their size has been measured, so only one size occupies the pools at a time.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from _datasets import SampleSet

from kspeed.cli.cluster import LocalCluster, wait_for
from kspeed.config import ClientConfig, load_config
from kspeed.control.manager_client import ManagerClient
from kspeed.control.progress import follow_preload
from kspeed.proto import kspeed_pb2

__all__ = ["BenchCluster", "KSpeedSource"]

SERVERS = 2
SERVER_READY = kspeed_pb2.SERVER_STATE_READY
POOL_SLACK = 512 << 20  # per server, beyond its share: region rounding and the previous size's leftovers


class BenchCluster:
    """A local cluster of real daemons for the benchmark; use as a context manager.

    Args:
        backend_root: the directory the servers may read (their allow-list).
        dataset_bytes: bytes of the largest sample set, to size the servers' pools.
        keep: keep the state directory (logs) after stopping.
        server_args: more flags for every server (e.g. ``("--verify-served", "always")``).
    """

    def __init__(
        self, backend_root: str, dataset_bytes: int, keep: bool = False, server_args: tuple[str, ...] = ()
    ) -> None:
        self.keep = keep
        self.state_dir = tempfile.mkdtemp(prefix="kspeed-bench-cluster-")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.pool_root = tempfile.mkdtemp(prefix="kspeed-bench-pool-", dir=shm)
        memory = dataset_bytes // SERVERS + POOL_SLACK
        self.cluster = LocalCluster(
            self.state_dir,
            servers=SERVERS,
            pool_root=self.pool_root,
            server_args=[
                "--backend-allow",
                backend_root,
                "--memory",
                str(memory),
                "--keep-pool-on-exit",
                "false",
                *server_args,
            ],
        )
        self.manager: ManagerClient | None = None

    def __enter__(self) -> BenchCluster:
        try:
            self.cluster.start()
            self.manager = ManagerClient(
                load_config(
                    ClientConfig, environ={}, overrides={"manager": self.cluster.address, "security.auth": "none"}
                )
            )
            wait_for(
                lambda: sum(r.state == SERVER_READY for r in self.manager.servers()) == SERVERS,
                30,
                "both servers to be ready",
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        """The manager's gRPC address."""
        return self.cluster.address

    def load(self, samples: SampleSet) -> kspeed_pb2.DatasetInfo:
        """Register ``samples`` as an operator-owned dataset with class labels and preload it."""
        spec = kspeed_pb2.DatasetSpec(name=samples.name, uri=samples.root, labels="dirname")
        self.manager.create_dataset(spec, operator=True)
        return follow_preload(self.manager, samples.name, out=None, timeout=600)

    def unload(self, name: str) -> None:
        """Remove a dataset and wait until the servers freed its memory."""
        self.manager.remove_dataset(name)
        wait_for(  # (the production window's regions stay reserved)
            lambda: all(
                r.inventory.regions_free + r.inventory.regions_window == r.inventory.regions_total
                for r in self.manager.servers()
            ),
            60,
            f"the servers to free the memory of {name}",
        )

    def close(self) -> None:
        """Stop every daemon and remove the pools (and the state unless ``keep``)."""
        try:
            if self.manager is not None:
                self.manager.close()
            self.cluster.stop()
        finally:
            shutil.rmtree(self.pool_root, ignore_errors=True)
            if not self.keep:
                shutil.rmtree(self.state_dir, ignore_errors=True)


class KSpeedSource:
    """The KSpeed client library on one rail: servers write each batch into the client's receive ring.

    The dataset is attached with the same definition the benchmark registered (so nothing is
    loaded twice); the client plans each epoch with its own seeded shuffle. With ``device="cuda"``
    the client delivers every batch to the GPU itself (one asynchronous copy of its ring range,
    :mod:`kspeed.client.delivery.device`), so the samples arrive as CUDA tensors.
    """

    def __init__(
        self, address: str, samples: SampleSet, batch_size: int, rail: str, seed: int = 0, device: str = "cpu"
    ) -> None:
        from kspeed import DatasetSpec, KSpeedClient

        config = load_config(ClientConfig, environ={}, overrides={"manager": address, "security.auth": "none"})
        self.client = KSpeedClient(address, config=config)
        try:
            self.dataset = self.client.dataset(
                DatasetSpec(name=samples.name, uri=samples.root, labels="dirname"),
                batch_size=batch_size,
                sampler=None,
                seed=seed,
                drop_last=False,
                rail=rail,
                quiet=True,
                device=device,
            )
            self.dataset.preload()
        except BaseException:
            self.client.close()
            raise

    def epoch(self, epoch: int):
        self.dataset.set_epoch(epoch)
        return self.dataset

    def close(self) -> None:
        self.client.close()
