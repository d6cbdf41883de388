"""The next order of a sampler that is not deterministic in (seed, epoch), predicted without
disturbing what the training loop sees.

The order a sampler gives at its next draw follows from its own state and from the global
generators it draws from, so it is computed now from copies of both:

- torch's ``RandomSampler``, ``SubsetRandomSampler`` and ``WeightedRandomSampler`` (their own
  ``__iter__``): a copy of the sampler whose generator is a copy of its own (``generator=``) or of
  torch's global one (``generator=None``: what ``RandomSampler`` draws its seed from, what the
  others draw from). Only private generators are drawn from, with array operations
  (:func:`~kspeed.client.planning.sampling.sampler_order`), so the order is drawn on the planner
  thread.
- any other sampler (a class of the user's, a subclass, one with ``set_epoch``): a deep copy (the
  datasets it refers to shared), set to the next epoch if it has ``set_epoch``, iterated in the
  caller's thread with torch's, Python's and numpy's global generators put back afterwards. One
  that cannot be copied is not predicted: its epochs are planned when they start.

A prediction comes true only if nothing draws from what it was copied from before the next epoch
starts: a training loop that draws from torch's global generator between epochs makes a sampler
that draws from it give another order. One pattern is learnt: a loop that draws as much from
torch's global generator between every two epochs, up to :data:`MAX_SEEDS` 64-bit numbers (a
``DataLoader`` over the dataset draws one per epoch, its workers' base seed), is predicted past it
from the next epoch on. Why a prediction failed is logged once per dataset and reason.
"""

from __future__ import annotations

import copy
import enum
import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from kspeed.client.planning.sampling import EpochOrders
from kspeed.errors import KSpeedError, StateError
from kspeed.preprocess.rng import global_generators_kept

__all__ = ["MAX_SEEDS", "Prediction", "Predictor"]

log = logging.getLogger(__name__)

#: 64-bit numbers (seeds) that a loop may draw from torch's global generator between epochs and
#: still be predicted past (a DataLoader over the dataset draws one per epoch)
MAX_SEEDS = 4
_TORCH_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
_DATA_ATTRIBUTES = ("data_source", "dataset")  # what a sampler draws from: shared by its copies, never copied
_OWN_GENERATOR_HINT = "give the sampler a generator of its own (generator=torch.Generator().manual_seed(seed))"


class Source(enum.Enum):
    """What a sampler's next order is predicted from."""

    GLOBAL = "a copy of torch's global generator"
    OWN = "a copy of its own generator"
    COPY = "a copy of the sampler"


class Prediction:
    """The order a sampler is predicted to give at its next draw, and what it was predicted from.

    Attributes:
        epoch: the epoch predicted to be drawn next.
        follows: the draw it was made after (:attr:`Predictor.draws`).
        global_state: torch's global generator's state when it was made.
        own_state: the sampler's own generator's state when it was made.
        others: Python's and numpy's global generators' states when it was made (a copy iterated
            in the caller's thread may draw from them).
    """

    def __init__(
        self,
        epoch: int,
        follows: int,
        draw: Callable[[], np.ndarray],
        *,
        global_state: torch.Tensor | None = None,
        own_state: torch.Tensor | None = None,
        others: tuple[Any, Any] | None = None,
    ) -> None:
        self.epoch = epoch
        self.follows = follows
        self.global_state = global_state
        self.own_state = own_state
        self.others = others
        self._draw: Callable[[], np.ndarray] | None = draw

    def order(self) -> np.ndarray:
        """The predicted IDs (once: the prediction keeps no order after handing it over).

        Draws only from private copies, so any thread may call it.
        """
        draw, self._draw = self._draw, None
        if draw is None:
            raise StateError("a prediction's order is handed over once")
        return draw()


class Predictor:
    """Predicts the next order of a sampler that is not deterministic in (seed, epoch) and tells
    whether it came true.

    Args:
        orders: the sampler's orders (``orders.deterministic`` is False).
    """

    def __init__(self, orders: EpochOrders) -> None:
        self.orders = orders
        self.sampler: Any = orders.sampler
        own = any(_iterates_as(self.sampler, cls) for cls in _TORCH_SAMPLERS)
        if own:
            self.source = Source.OWN if getattr(self.sampler, "generator", None) is not None else Source.GLOBAL
        else:
            self.source = Source.COPY
        #: why its orders cannot be predicted ("" while they may be)
        self.unable = ""
        #: draws from the sampler so far (:meth:`draw`)
        self.draws = 0
        self.predicted = self.used = self.missed = 0
        self._seeds = 0  # 64-bit seeds the loop draws from torch's global generator between epochs (learnt)
        self._last: int | None = None
        self._step = 1  # the next draw's epoch after the last one's: 0 while the loop repeats an epoch
        self._at_draw: tuple[torch.Tensor | None, torch.Tensor | None, tuple[Any, Any] | None] = (None, None, None)
        self._told: set[str] = set()

    @property
    def _name(self) -> str:
        return type(self.sampler).__name__

    def draw(self, epoch: int) -> np.ndarray:
        """``epoch``'s order from the sampler itself, drawn as a ``DataLoader`` would (its random
        state consumed once, now); the generators' states are noted first, to tell why a
        prediction failed.

        Raises:
            as :meth:`EpochOrders.order`.
        """
        own = self.sampler.generator.get_state() if self.source is Source.OWN else None
        others = _other_states() if self.source is Source.COPY else None
        self._at_draw = (torch.get_rng_state(), own, others)
        if self._last is not None:
            self._step = 0 if epoch == self._last else 1
        self._last = epoch
        self.draws += 1
        return self.orders.order(epoch)

    def predict(self) -> Prediction | None:
        """The order of the next draw: of the next epoch, or of the same one while the loop repeats
        it (no ``set_epoch`` between iterations); ``None`` when it cannot be predicted (why is logged once).

        Raises nothing: a sampler whose copy fails to give an order is not predicted this time.
        """
        if self.unable or self._last is None:
            return None
        epoch = self._last + self._step
        try:
            prediction = self._by_copy(epoch) if self.source is Source.COPY else self._by_generator(epoch)
        except KSpeedError as exc:  # the real draw will say it
            log.debug("dataset %s: epoch %d not predicted: %s", self.orders.dataset, epoch, exc)
            return None
        except Exception as exc:  # a user's sampler may raise anything
            self._tell(
                f"iterating a copy of {self._name} failed ({type(exc).__name__}: {exc})",
                "make it iterable from a copy",
            )
            return None
        if prediction is not None:
            self.predicted += 1
        return prediction

    def _by_generator(self, epoch: int) -> Prediction:
        """A torch sampler's next order: a shallow copy drawing from a copy of its generator, or (none
        of its own) of torch's global one past the seeds the loop draws between epochs."""
        sampler = copy.copy(self.sampler)
        if self.source is Source.OWN:
            own = self.sampler.generator
            sampler.generator = torch.Generator(device=own.device)
            sampler.generator.set_state(own.get_state())
            return Prediction(epoch, self.draws, lambda: self.orders.order_of(sampler), own_state=own.get_state())
        state = torch.get_rng_state()
        generator = torch.Generator()
        generator.set_state(state)
        _skip_seeds(generator, self._seeds)
        if isinstance(sampler, RandomSampler):  # it draws a seed from the global generator, then its permutations
            seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        sampler.generator = generator
        return Prediction(epoch, self.draws, lambda: self.orders.order_of(sampler), global_state=state)

    def _by_copy(self, epoch: int) -> Prediction | None:
        """Any other sampler's next order: a deep copy set to ``epoch``, iterated here with the global
        generators put back afterwards."""
        try:
            sampler = _deep_copy(self.sampler)
        except Exception as exc:  # deepcopy raises what the object's state raises
            self.unable = f"{self._name} cannot be copied ({type(exc).__name__}: {exc})"
            self._tell(self.unable, "make it copyable (copy.deepcopy)")
            return None
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        state, others = torch.get_rng_state(), _other_states()
        with global_generators_kept():
            _skip_seeds(None, self._seeds)
            ids = self.orders.order_of(sampler)
        return Prediction(epoch, self.draws, lambda: ids, global_state=state, others=others)

    def check(self, prediction: Prediction, epoch: int, ids: np.ndarray, predicted: np.ndarray | None) -> bool:
        """Whether ``prediction`` came true: ``epoch`` is the one it was made for and ``ids``, the
        order the sampler just gave (:meth:`draw`), equal its order ``predicted`` (``None``: it
        could not be planned). Why not is logged once per reason; a loop's seeds between epochs are learnt.
        """
        if prediction.epoch == epoch and predicted is not None and np.array_equal(predicted, ids):
            self.used += 1
            return True
        self.missed += 1
        if prediction.epoch != epoch:
            log.debug(
                "dataset %s: epoch %d started, not epoch %d as predicted (set_epoch skipped or repeated an epoch)",
                self.orders.dataset,
                epoch,
                prediction.epoch,
            )
        elif predicted is not None:
            self._explain(prediction)
        return False

    def _explain(self, prediction: Prediction) -> None:
        """Log why ``prediction`` gave another order than the sampler did (once per reason), or learn
        the seeds the loop draws from torch's global generator between epochs."""
        global_now, own_now, others_now = self._at_draw
        if self.source is Source.OWN:
            if (
                own_now is not None
                and prediction.own_state is not None
                and not torch.equal(own_now, prediction.own_state)
            ):
                self._tell(
                    f"{self._name}'s generator was drawn from or seeded between epochs",
                    "draw from another generator in the loop",
                )
            else:
                self._tell(f"{self._name}'s order depends on more than its generator", "")
            return
        seeds = None
        if prediction.global_state is not None and global_now is not None:
            seeds = _seeds_between(prediction.global_state, global_now)
        others_drawn = (
            prediction.others is not None and others_now is not None and not _same_states(prediction.others, others_now)
        )
        if seeds is not None and seeds != self._seeds and not others_drawn:
            log.debug(
                "dataset %s: the training loop draws as much as %d seed(s) from torch's global RNG between "
                "epochs (a DataLoader over the dataset draws one per epoch): %s's next order is predicted past it",
                self.orders.dataset,
                seeds,
                self._name,
            )
            self._seeds = seeds
            return
        drawn = [
            name
            for name, moved in (("torch's global RNG", seeds is None), ("Python's or numpy's global RNG", others_drawn))
            if moved
        ]
        if drawn:
            hint = _OWN_GENERATOR_HINT if seeds is None else ""
            self._tell(f"the training loop drew from {' and '.join(drawn)} between epochs", hint)
        else:
            self._tell(f"{self._name}'s order depends on more than its own state and the global generators", "")

    def _tell(self, why: str, fix: str) -> None:
        if why in self._told:
            return
        self._told.add(why)
        log.warning(
            "dataset %s: %s, so %s's next order could not be predicted: such an epoch is planned when it "
            "starts, and its first batch waits for the plan%s",
            self.orders.dataset,
            why,
            self._name,
            f"; {fix} to have it planned ahead" if fix else "",
        )


def _iterates_as(sampler: object, cls: type) -> bool:
    """Whether ``sampler`` is a ``cls`` whose ``__iter__`` is ``cls``'s own."""
    return isinstance(sampler, cls) and type(sampler).__iter__ is cls.__iter__  # type: ignore[attr-defined]


def _deep_copy(sampler: object) -> Any:
    """A deep copy of ``sampler`` sharing the datasets it refers to (read, never drawn from)."""
    attributes = getattr(sampler, "__dict__", {})
    shared = {
        id(value): value
        for name, value in attributes.items()
        if isinstance(value, Dataset) or (name in _DATA_ATTRIBUTES and value is not None)
    }
    return copy.deepcopy(sampler, shared)


def _skip_seeds(generator: torch.Generator | None, seeds: int) -> None:
    """Draw ``seeds`` 64-bit seeds from ``generator`` (``None``: torch's global one), as a DataLoader
    draws its base seed."""
    for _ in range(seeds):
        torch.empty((), dtype=torch.int64).random_(generator=generator)


def _seeds_between(before: torch.Tensor, now: torch.Tensor) -> int | None:
    """How many 64-bit seeds drawn from a generator in state ``before`` leave it in state ``now``
    (``None``: not up to :data:`MAX_SEEDS`; something else drew from it)."""
    generator = torch.Generator()
    generator.set_state(before)
    for seeds in range(MAX_SEEDS + 1):
        if torch.equal(generator.get_state(), now):
            return seeds
        _skip_seeds(generator, 1)
    return None


def _other_states() -> tuple[Any, Any]:
    return random.getstate(), np.random.get_state()


def _same_states(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    (python_a, numpy_a), (python_b, numpy_b) = a, b
    return python_a == python_b and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(numpy_a, numpy_b, strict=True)
    )
