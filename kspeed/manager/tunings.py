"""The metric store of ``offload="auto"`` (FastFlow §5.2): the split a job settled on, and the
rates it decided from, kept so that a repeated job starts from it instead of from scratch.

A decision is kept under a key of three parts, as FastFlow keys its store by input pipeline,
model and remote node information: the digest of the dataset's pipeline (the same stages on
another dataset of the same name share it; another pipeline does not), the model signature the
client gives (a name, or a digest of the model's structure), and the kind of the servers that
hold the dataset (each one's cores and preprocessing workers). The newest :data:`MAX_TUNINGS`
decisions are kept in the manager's state file; older ones are forgotten.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict

from kspeed.errors import NotFoundError, ProtocolError
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.membership import Membership
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2

__all__ = ["MAX_TUNINGS", "TuningBoard"]

MAX_TUNINGS = 4096  # decisions kept (the most recent)
MAX_MODEL = 256  # characters of a model signature
MAX_REASON = 1000  # characters of a reason
MAX_RATES = 64  # rates per decision


class TuningBoard:
    """The kept offload decisions, in memory and in the state file."""

    def __init__(self, catalog: DatasetCatalog, membership: Membership, store: Store) -> None:
        self._catalog = catalog
        self._membership = membership
        self._store = store
        self._records: OrderedDict[str, kspeed_pb2.TuningRecord] = OrderedDict(store.tunings())

    def key(self, dataset: str, model: str) -> str:
        """The key ``dataset``'s decisions for ``model`` are kept under.

        Raises:
            NotFoundError: no such dataset.
        """
        info = self._catalog.get(dataset)
        pipeline = hashlib.sha256(info.spec.pipeline.SerializeToString(deterministic=True)).hexdigest()[:16]
        kinds = []
        for server_id in sorted({share.server_id for share in info.shares}):
            try:
                inventory = self._membership.get(server_id).inventory
            except NotFoundError:
                continue
            kinds.append(f"{inventory.cores}c{inventory.preprocess_workers}w")
        servers = hashlib.sha256(",".join(sorted(kinds)).encode()).hexdigest()[:16]
        return f"{pipeline}/{hashlib.sha256(model.encode()).hexdigest()[:16]}/{servers}"

    def get(self, request: kspeed_pb2.TuningRequest) -> kspeed_pb2.TuningRecord:
        """The decision kept for ``request``'s dataset and model.

        Raises:
            NotFoundError: none is kept, or no such dataset.
            ProtocolError: a model signature too long.
        """
        _check_model(request.model)
        key = self.key(request.dataset, request.model)
        record = self._records.get(key)
        if record is None:
            raise NotFoundError(f"no offload decision kept for dataset {request.dataset!r} and this model")
        return record

    def save(self, record: kspeed_pb2.TuningRecord) -> None:
        """Keep ``record`` (stamped with its key and the time), replacing the one under its key.

        Raises:
            NotFoundError: no such dataset.
            ProtocolError: a field out of range (named).
        """
        _check_model(record.model)
        if not 0.0 <= record.ratio <= 1.0:
            raise ProtocolError(f"tuning ratio {record.ratio!r} is not between 0 and 1")
        if len(record.rates) > MAX_RATES or len(record.reason) > MAX_REASON:
            raise ProtocolError(
                f"tuning record too large ({len(record.rates)} rates, {len(record.reason)} characters of reason)"
            )
        for name, value in record.rates.items():
            if len(name) > 64 or math.isnan(value):
                raise ProtocolError(f"tuning rate {name[:64]!r} = {value!r} is not a named number")
        key = self.key(record.dataset, record.model)
        kept = kspeed_pb2.TuningRecord()
        kept.CopyFrom(record)
        kept.key, kept.updated_unix = key, time.time()
        self._records.pop(key, None)
        self._records[key] = kept
        while len(self._records) > MAX_TUNINGS:
            self._records.popitem(last=False)
        self._store.keep(lambda: self._store.save_tuning(key, kept, MAX_TUNINGS))


def _check_model(model: str) -> None:
    if not model or len(model) > MAX_MODEL:
        raise ProtocolError(f"a model signature must have 1..{MAX_MODEL} characters, got {len(model)}")
