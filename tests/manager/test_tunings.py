"""The manager's metric store of offload decisions: keyed by pipeline, model and servers, kept in
the state file, bounded, and refusing records out of range."""

from __future__ import annotations

import math

import pytest

from kspeed.errors import NotFoundError, ProtocolError
from kspeed.manager import tunings
from kspeed.manager.store import Store
from kspeed.manager.tunings import TuningBoard
from kspeed.proto import kspeed_pb2


class _Catalog:
    def __init__(self) -> None:
        self.infos: dict[str, kspeed_pb2.DatasetInfo] = {}

    def add(self, name: str, op: str, servers: list[str]) -> None:
        info = kspeed_pb2.DatasetInfo()
        info.spec.name = name
        info.spec.pipeline.stages.add(op=op)
        for server in servers:
            info.shares.add(server_id=server)
        self.infos[name] = info

    def get(self, name: str) -> kspeed_pb2.DatasetInfo:
        if name not in self.infos:
            raise NotFoundError(f"no dataset {name!r}")
        return self.infos[name]


class _Membership:
    def __init__(self, cores: dict[str, int]) -> None:
        self.cores = cores

    def get(self, server_id: str) -> kspeed_pb2.ServerRecord:
        record = kspeed_pb2.ServerRecord(id=server_id)
        record.inventory.cores = self.cores[server_id]
        record.inventory.preprocess_workers = self.cores[server_id]
        return record


def _record(dataset: str, model: str = "resnet/batch32", ratio: float = 0.6) -> kspeed_pb2.TuningRecord:
    return kspeed_pb2.TuningRecord(
        dataset=dataset, model=model, ratio=ratio, server_stages=4, rates={"gthp": 250.0, "pcycle": 0.004}
    )


def _board(tmp_path, catalog=None, membership=None) -> tuple[TuningBoard, Store]:
    catalog = catalog or _Catalog()
    if not catalog.infos:
        catalog.add("imgs", "decode_image", ["a", "b"])
    store = Store(str(tmp_path))
    return TuningBoard(catalog, membership or _Membership({"a": 4, "b": 4, "c": 16}), store), store


def test_a_kept_decision_is_found_again_and_survives_a_restart(tmp_path):
    board, store = _board(tmp_path)
    with pytest.raises(NotFoundError):
        board.get(kspeed_pb2.TuningRequest(dataset="imgs", model="resnet/batch32"))
    board.save(_record("imgs"))
    got = board.get(kspeed_pb2.TuningRequest(dataset="imgs", model="resnet/batch32"))
    assert got.ratio == 0.6 and got.rates["pcycle"] == 0.004 and got.key and got.updated_unix > 0
    store.close()
    again, _ = _board(tmp_path)
    assert again.get(kspeed_pb2.TuningRequest(dataset="imgs", model="resnet/batch32")).ratio == 0.6


def test_the_key_has_the_pipeline_the_model_and_the_servers_kind(tmp_path):
    catalog = _Catalog()
    catalog.add("imgs", "decode_image", ["a", "b"])
    catalog.add("same-pipeline", "decode_image", ["b", "a"])
    catalog.add("other-pipeline", "decode_audio", ["a", "b"])
    catalog.add("bigger-servers", "decode_image", ["c"])
    board, _ = _board(tmp_path, catalog)
    assert board.key("imgs", "m") == board.key("same-pipeline", "m")  # the same stages and servers' kind
    assert board.key("imgs", "m") != board.key("other-pipeline", "m")
    assert board.key("imgs", "m") != board.key("bigger-servers", "m")
    assert board.key("imgs", "m") != board.key("imgs", "n")


def test_only_the_most_recent_decisions_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tunings, "MAX_TUNINGS", 2)
    board, store = _board(tmp_path)
    for model in ("m1", "m2", "m3"):
        board.save(_record("imgs", model))
    with pytest.raises(NotFoundError):
        board.get(kspeed_pb2.TuningRequest(dataset="imgs", model="m1"))
    assert board.get(kspeed_pb2.TuningRequest(dataset="imgs", model="m3")).ratio == 0.6
    assert len(list(store.tunings())) == 2


@pytest.mark.parametrize(
    ("record", "words"),
    [
        (_record("imgs", ratio=1.5), "between 0 and 1"),
        (_record("imgs", model=""), "model signature"),
        (_record("imgs", model="x" * 300), "model signature"),
        (kspeed_pb2.TuningRecord(dataset="imgs", model="m", ratio=0.5, rates={"gthp": math.nan}), "named number"),
        (kspeed_pb2.TuningRecord(dataset="imgs", model="m", rates={f"r{i}": 1.0 for i in range(65)}), "too large"),
    ],
)
def test_a_record_out_of_range_is_refused_and_nothing_is_kept(tmp_path, record, words):
    board, store = _board(tmp_path)
    with pytest.raises(ProtocolError, match=words):
        board.save(record)
    assert list(store.tunings()) == []


def test_a_decision_for_an_unknown_dataset_is_refused(tmp_path):
    board, _ = _board(tmp_path)
    with pytest.raises(NotFoundError, match="nope"):
        board.save(_record("nope"))
