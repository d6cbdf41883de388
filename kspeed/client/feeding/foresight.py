"""Plans made ahead for a sampler that is not deterministic in (seed, epoch), from a prediction.

When an epoch starts, the sampler's order is drawn as without KSpeed and its next one predicted
(:mod:`kspeed.client.planning.prediction`); the prediction is planned and committed on a planner
thread while the epoch is consumed, so the pump grants into it ahead as into a deterministic
sampler's next plan. When the next epoch starts, the order the sampler then gives is compared with
the prediction's:

- the same: the plan made ahead is that epoch's (its batches granted already stay granted);
- another (or another epoch was started): the plan made ahead is given up (the pump discards its
  granted batches, and the servers are told to drop it once those settle) and the real order is
  planned there and then, as for a sampler whose orders cannot be predicted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType

import numpy as np

from kspeed.client.planning.plans import EpochPlan
from kspeed.client.planning.prediction import Prediction, Predictor
from kspeed.rdma.topology import pin

__all__ = ["Foresight"]

log = logging.getLogger(__name__)


class Foresight:
    """The next plan of a sampler not deterministic in (seed, epoch), made ahead from a prediction.

    Args:
        predictor: predicts the sampler's orders and draws them.
        plan_epoch: builds and commits the plan of an epoch (its order from the sampler's orders).
        drop: tells the servers to let go of a pass (the feed's ``drop_plan``).
        thread_cores: cores the planner thread is pinned to (empty: no pinning).
    """

    #: :meth:`stats` of a feed without one
    NONE = MappingProxyType({"orders_predicted": 0, "predictions_used": 0, "predictions_missed": 0})

    def __init__(
        self,
        predictor: Predictor,
        plan_epoch: Callable[[int], EpochPlan],
        drop: Callable[[int], None],
        thread_cores: tuple[int, ...] = (),
    ) -> None:
        self.predictor = predictor
        self._plan_epoch = plan_epoch
        self._drop = drop
        self._planner = ThreadPoolExecutor(
            1, thread_name_prefix="kspeed-plan", initializer=pin, initargs=(thread_cores,)
        )
        self._ahead: tuple[Prediction, Future[EpochPlan]] | None = None
        self._missed: list[EpochPlan] = []  # made ahead, given up: dropped once their granted batches settle

    def draw(self, epoch: int) -> np.ndarray:
        """``epoch``'s order from the sampler, drawn once, now (see :meth:`Predictor.draw`)."""
        return self.predictor.draw(epoch)

    def take(self, epoch: int, ids: np.ndarray) -> EpochPlan | None:
        """The plan made ahead if it is of ``epoch`` and of ``ids``, the order the sampler just
        gave (waiting for it while it is being made); else ``None``, the plan made ahead given up."""
        if self._ahead is None or self._ahead[0].follows == self.predictor.draws:
            return None  # nothing made ahead, or made for the draw after this one (a failover made it again)
        (prediction, future), self._ahead = self._ahead, None
        plan = None
        if prediction.epoch == epoch:
            try:
                plan = future.result()
            except Exception as exc:  # given up: the real order is planned now (and raises again if it must)
                log.debug("dataset %s: the plan made ahead failed: %s", self.predictor.orders.dataset, exc)
        if self.predictor.check(prediction, epoch, ids, plan.ids if plan is not None else None):
            return plan
        self._give_up(future)
        return None

    def plan(self, epoch: int, ids: np.ndarray) -> EpochPlan:
        """Plan ``epoch`` with ``ids``, the order the sampler gave (it is not drawn again), in this thread."""
        with self.predictor.orders.given(epoch, ids):
            return self._plan_epoch(epoch)

    def plan_next(self) -> None:
        """Predict the sampler's next order and plan it on the planner thread (nothing when it cannot
        be predicted, or when it is being planned already)."""
        if self._ahead is not None and self._ahead[0].follows == self.predictor.draws:
            return
        prediction = self.predictor.predict()
        if prediction is None:
            return
        if self._ahead is not None:
            self._give_up(self._ahead[1])
        self._ahead = (prediction, self._planner.submit(self._plan_predicted, prediction))

    def _plan_predicted(self, prediction: Prediction) -> EpochPlan:
        """On the planner thread: the predicted order, planned and committed."""
        return self.plan(prediction.epoch, prediction.order())

    def again(self) -> None:
        """Make the plan ahead again, from the same prediction (the split of preprocessing changed:
        a plan made before it would keep the old one, and be followed before the re-split current
        pass). One granted already stays: it is re-split when the cursor reaches it."""
        if self._ahead is None:
            return
        made = self.ready()
        if made is not None and made.slots > 0:
            return
        (prediction, future), self._ahead = self._ahead, None
        self._give_up(future, at_once=True)
        self._ahead = (prediction, self._planner.submit(self._plan_predicted, prediction))

    def ready(self) -> EpochPlan | None:
        """The plan made ahead, once committed (never waits)."""
        if self._ahead is None:
            return None
        future = self._ahead[1]
        if not future.done() or future.cancelled() or future.exception() is not None:
            return None
        return future.result()

    def retire(self) -> None:
        """Tell the servers to drop the plans given up whose granted batches have all settled."""
        for plan in [p for p in self._missed if p.slots == 0]:
            self._drop(plan.feed_epoch)
            self._missed.remove(plan)

    def forget(self, kept: Sequence[EpochPlan]) -> None:
        """After a failover replaced servers: drop every plan given up, and the plan made ahead
        unless it is among the ``kept`` ones committed again; that one is made again, to the
        servers now in place."""
        for plan in self._missed:
            self._drop(plan.feed_epoch)
        self._missed.clear()
        made = self.ready()
        if self._ahead is None or (made is not None and any(made is plan for plan in kept)):
            return
        future, self._ahead = self._ahead[1], None
        self._give_up(future, at_once=True)
        self.plan_next()

    def _give_up(self, future: Future[EpochPlan], at_once: bool = False) -> None:
        """Let the plan of ``future`` go: dropped by the servers once made, or (made already, maybe
        granted) once its granted batches settle, or ``at_once``."""
        if not future.done():
            future.add_done_callback(self._drop_made)
        elif not future.cancelled() and future.exception() is None:
            plan = future.result()
            if at_once:
                self._drop(plan.feed_epoch)
            else:
                self._missed.append(plan)

    def _drop_made(self, future: Future[EpochPlan]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._drop(future.result().feed_epoch)

    def stats(self) -> dict[str, int]:
        """Orders predicted and planned ahead, and the predictions that came true or not."""
        p = self.predictor
        return {"orders_predicted": p.predicted, "predictions_used": p.used, "predictions_missed": p.missed}

    def close(self) -> None:
        """Stop the planner thread: the plans queued are cancelled; one in progress ends when its
        calls do, :meth:`join` waits for it."""
        self._planner.shutdown(wait=False, cancel_futures=True)

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the planner thread to end, after :meth:`close`;
        whether it has."""
        give_up = time.monotonic() + timeout
        threads = list(self._planner._threads)
        for thread in threads:
            thread.join(max(give_up - time.monotonic(), 0.0))
        return not any(thread.is_alive() for thread in threads)
