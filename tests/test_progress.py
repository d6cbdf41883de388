"""The preload progress bar (no daemon: a stand-in for the manager's answers)."""

from __future__ import annotations

import io

from kspeed.control.progress import follow_preload
from kspeed.proto import kspeed_pb2


class Manager:
    """Answers preload() and dataset() from a list of progress steps (the last one repeats)."""

    def __init__(self, steps: list[tuple[int, int, bool]], total: int) -> None:
        self._steps = steps
        self._total = total

    def _info(self) -> kspeed_pb2.DatasetInfo:
        loaded, loaded_bytes, running = self._steps.pop(0) if len(self._steps) > 1 else self._steps[0]
        info = kspeed_pb2.DatasetInfo(spec=kspeed_pb2.DatasetSpec(name="imgs"))
        info.progress.samples_total, info.progress.bytes_total = self._total, self._total * 1024
        info.progress.samples_loaded, info.progress.bytes_loaded, info.progress.running = loaded, loaded_bytes, running
        info.shares.add(server_id="srv-a", first_id=0, end_id=self._total)
        return info

    def preload(self, name: str) -> kspeed_pb2.DatasetInfo:
        return self._info()

    def dataset(self, name: str) -> kspeed_pb2.DatasetInfo:
        return self._info()


def test_the_bar_shows_samples_then_bytes_without_an_empty_field():
    out = io.StringIO()
    manager = Manager([(0, 0, True), (50, 50 * 1024, True), (100, 100 * 1024, False)], total=100)
    follow_preload(manager, "imgs", out=out)  # type: ignore[arg-type]
    drawn = out.getvalue()
    assert ", ," not in drawn, drawn
    assert "100/100 samples, 100.0 KiB/100.0 KiB, " in drawn, drawn
