"""``ds.sampler``: the epoch control a trainer reaches through a loader's sampler. No daemon."""

from __future__ import annotations

from torch.utils.data import RandomSampler

from kspeed.client.sampler_view import SamplerView


class Owner:
    """A dataset's epoch, as a KSpeed dataset keeps it."""

    def __init__(self) -> None:
        self.epoch = 0
        self.samples = 10

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_set_epoch_reaches_the_dataset_and_len_follows_it():
    owner, drawn = Owner(), RandomSampler(range(10))
    view = SamplerView(owner, lambda: owner.samples, drawn)
    view.set_epoch(4)
    assert owner.epoch == view.epoch == 4
    owner.samples = 7  # (asked at each len(), never kept)
    assert len(view) == 7 and view.sampler is drawn
    assert "epoch=4" in repr(view) and "samples=7" in repr(view)
