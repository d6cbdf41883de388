"""A batch prepared in two parts comes out as ``default_collate`` over the whole would make it."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from kspeed.client.prep.interleave import interleave

Pair = namedtuple("Pair", ["image", "name"])


def samples(n: int) -> list:
    rng = np.random.default_rng(7)
    return [
        (rng.integers(0, 255, size=(3, 4, 5), dtype=np.uint8), int(rng.integers(0, 10)), f"file-{i}.jpg")
        for i in range(n)
    ]


def in_two_parts(batch: list, first_at: list[int], second_at: list[int]):
    """``batch`` collated in two parts, then interleaved."""
    first = default_collate([batch[i] for i in first_at])
    return interleave(first, default_collate([batch[i] for i in second_at]), first_at, second_at)


@pytest.mark.parametrize("first_at", [[0, 2, 5], [1], [0, 1, 2, 3, 4], [5, 3]])
def test_two_parts_give_what_collating_the_whole_batch_gives(first_at):
    batch = samples(6)
    second_at = [i for i in range(6) if i not in first_at]
    whole = default_collate(batch)
    got = in_two_parts(batch, first_at, second_at)
    assert isinstance(got, list) and len(got) == 3
    assert torch.equal(got[0], whole[0]) and got[0].dtype == torch.uint8
    assert torch.equal(got[1], whole[1]) and got[1].dtype == whole[1].dtype
    assert got[2] == whole[2] and list(got[2]) == [f"file-{i}.jpg" for i in range(6)]  # (a tuple, as collated)


def test_mappings_and_named_tuples_keep_their_types():
    batch = [
        OrderedDict(x=torch.full((2,), float(i)), pair=Pair(torch.tensor([i]), f"n{i}"), label=i) for i in range(4)
    ]
    first_at, second_at = [3, 0], [1, 2]
    whole = default_collate(batch)
    got = in_two_parts(batch, first_at, second_at)
    assert type(got) is OrderedDict and list(got) == ["x", "pair", "label"]
    assert torch.equal(got["x"], whole["x"]) and torch.equal(got["label"], whole["label"])
    assert isinstance(got["pair"], Pair) and got["pair"].name == whole["pair"].name == ("n0", "n1", "n2", "n3")
    assert torch.equal(got["pair"].image, whole["pair"].image)


def test_parts_that_disagree_are_named():
    a = default_collate([torch.zeros(3, dtype=torch.uint8)])
    with pytest.raises(TypeError, match=r"\(3,\) torch.uint8 rows against \(4,\) torch.uint8"):
        interleave(a, default_collate([torch.zeros(4, dtype=torch.uint8)]), [0], [1])
    with pytest.raises(TypeError, match=r"torch.uint8 rows against .* torch.float32"):
        interleave(a, default_collate([torch.zeros(3)]), [1], [0])
    with pytest.raises(TypeError, match="keys"):
        interleave({"a": a}, {"b": a}, [0], [1])
    with pytest.raises(TypeError, match="types Tensor and dict"):
        interleave(a, {"a": a}, [0], [1])
