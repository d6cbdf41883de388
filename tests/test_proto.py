"""The committed generated modules match proto/kspeed.proto (run `make proto` after editing it)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_matches_proto(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed (pip install -e '.[dev]')")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    assert written, "protoc wrote nothing"
    committed = ROOT / "kspeed" / "proto"
    for path in written:
        assert (committed / path.name).read_text() == path.read_text(), (
            f"kspeed/proto/{path.name} drifted from proto/kspeed.proto: run `make proto` and commit"
        )
    assert {p.name for p in committed.glob("*_pb2*")} == {p.name for p in written}
