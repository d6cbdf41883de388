"""The offload decision: FastFlow's Algorithm 1 over rates measured while the job runs.

FastFlow (Um et al., VLDB 2023, §4) decides once, from profiling before training, whether to
offload (is the training loop waiting on preprocessing, and would offloading gain more than a
threshold?), which operators to offload (the candidate cut that maximises the estimated
throughput) and how much (``Upper``/``Lower``). KSpeed takes the same decision from rates it
measures continuously (:mod:`kspeed.client.tuning.meters`), in per-sample terms:

- ``Gthp``: samples/s the training loop consumes with no data wait (its step alone);
- ``Lthp``: samples/s with every sample preprocessed on this client, whose cores also run the
  step: ``min(Gthp, cores / (step_cpu + Pcycle + common))``;
- ``Rthp(cut)``: samples/s with every sample preprocessed on the servers up to ``cut``:
  ``min(Gthp, remote(cut), cores / (step_cpu + Ocycle(cut) + common))``, where ``remote(cut)`` is the
  servers' capacity for this job (their preprocessing rate, and the rail's bytes/s over the bytes a
  sample sends at that cut);
- ``Pcycle``: client CPU seconds to run a sample's offloadable stages here; ``Ocycle(cut)``: client
  CPU seconds to receive one preprocessed at ``cut`` (and run what the servers did not);
  ``common``: what every sample costs here wherever it was preprocessed (collation).

Algorithm 1 then reads: no offload when ``Gthp <= Lthp * (1 + threshold)`` (the loop is not waiting
on preprocessing, or the gain is too small); the cut maximising ``Lthp (1 - Ocycle/Pcycle) + Rthp``;
``Upper`` = the servers' capacity at that cut, ``Lower = (Gthp - Lthp)(1 + Ocycle/Pcycle)``; the
ratio ``Upper/Gthp`` when ``Lower < Upper`` (the servers can take everything the client cannot),
else ``Rthp/(Lthp + Rthp)`` (neither side can avoid being a bottleneck: balance them). FastFlow
measures ``Rthp`` as a whole training run with everything offloaded; ``Upper`` is meant as the
remote side's capacity ("offloading more than Rthp will lead to the remote bottleneck"), which is
what KSpeed uses for it, so a client busy receiving does not lower how much the servers are given.

:func:`predicted` is the throughput model those rates imply at any ratio (the tightest of the
loop, the servers and this client's CPUs); every decision carries it, so a log line or
``ds.stats()`` says what the split is expected to deliver and why. FastFlow's ``Upper/Gthp``
assumes the client keeps up with the samples it is left; on a CPU-starved client whose step takes
the same cores it may not (offloading a little less than the servers could take then costs more
client CPU than it saves server time), so where the model predicts more than
:data:`MODEL_MARGIN` more at another ratio, that ratio is taken and the reason says so
(``inputs["fastflow_ratio"]`` keeps FastFlow's).

:class:`Hysteresis` keeps a decision from following noise: a new ratio is adopted only when it
differs from the current one by at least ``min_step``, the model predicts a gain of at least
``min_gain`` from the change, and the same answer came ``settle`` times in a row; after a change,
``dwell`` seconds pass before the next (the rates must first be measured at the new split).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kspeed.errors import ConfigError

__all__ = ["Cut", "Decision", "Hysteresis", "Observed", "Rates", "decide", "predicted"]

#: FastFlow's SpeedUpThreshold: no offload for an ideal gain under 10%.
SPEEDUP_THRESHOLD = 0.10
#: Ratios the model is evaluated at (0, 1/RATIO_STEPS, ..., 1).
RATIO_STEPS = 100
#: FastFlow's ratio stands unless the model predicts more than this much more elsewhere.
MODEL_MARGIN = 0.02
#: Splits whose achieved throughput is remembered are this far apart; and for this long.
OBSERVED_STEP = 0.05
OBSERVED_S = 30.0


@dataclass(frozen=True)
class Cut:
    """One legal place to split the pipeline: the servers run its first ``stages`` stages.

    Attributes:
        stages: leading stages run on the servers for an offloaded sample.
        nbytes: bytes a sample sends at this cut (its declared output).
        remote_rate: the servers' preprocessing capacity for this job at this cut, samples/s
            (``inf``: not measured yet, no limit known).
        receive_cpu: client CPU seconds per sample offloaded at this cut (Ocycle: receiving it and
            running the stages the servers did not run but the local path would have).
        label: how logs name it (e.g. ``"after 2:RandomResizedCrop"``).
    """

    stages: int
    nbytes: int
    remote_rate: float
    receive_cpu: float
    label: str = ""


@dataclass(frozen=True)
class Rates:
    """What the decision is made from (per sample; seconds are CPU seconds unless said).

    Attributes:
        step_s: wall seconds per sample of the training loop's step, without data waits (1/Gthp).
        step_cpu: this process's CPU seconds per sample in the step.
        local_cpu: Pcycle: CPU seconds to run the offloadable stages here, per sample.
        common_cpu: CPU seconds every sample costs here wherever it is preprocessed (collation).
        cores: CPUs this process may use.
        rail_bytes_per_s: the rail's bandwidth from the servers to this client (``inf``: unknown).
        raw_bytes: a sample's stored bytes, which the rail carries for each sample preprocessed
            here (the servers send it raw).
    """

    step_s: float
    step_cpu: float
    local_cpu: float
    common_cpu: float
    cores: float
    rail_bytes_per_s: float = math.inf
    raw_bytes: float = 0.0

    @property
    def gthp(self) -> float:
        """Samples/s the loop consumes when it never waits."""
        return 1.0 / self.step_s if self.step_s > 0 else math.inf

    def lthp(self) -> float:
        """Samples/s with everything preprocessed here (their raw bytes still cross the rail)."""
        rail = self.rail_bytes_per_s / self.raw_bytes if self.raw_bytes > 0 else math.inf
        return min(self.gthp, rail, self.cores / max(self.step_cpu + self.local_cpu + self.common_cpu, 1e-12))

    def remote_capacity(self, cut: Cut) -> float:
        """Samples/s the servers (and the rail) can deliver preprocessed at ``cut``."""
        rail = self.rail_bytes_per_s / cut.nbytes if cut.nbytes > 0 else math.inf
        return min(cut.remote_rate, rail)

    def rthp(self, cut: Cut) -> float:
        """Samples/s with everything preprocessed on the servers at ``cut``."""
        local = self.cores / max(self.step_cpu + cut.receive_cpu + self.common_cpu, 1e-12)
        return min(self.gthp, self.remote_capacity(cut), local)


@dataclass(frozen=True)
class Decision:
    """A split and why.

    Attributes:
        ratio: share of each batch's samples preprocessed on the servers (0..1).
        cut: the cut used for them (``None`` with ratio 0).
        reason: one line for the log and ``ds.stats()``.
        expected: samples/s the model predicts at ``ratio``.
        inputs: the figures it was made from (Gthp, Lthp, Rthp, Upper, Lower, ...).
    """

    ratio: float
    cut: Cut | None
    reason: str
    expected: float
    inputs: dict[str, float] = field(default_factory=dict)


def predicted(rates: Rates, cut: Cut | None, ratio: float) -> float:
    """Samples/s the rates imply when ``ratio`` of each batch is preprocessed on the servers at
    ``cut``: the tightest of the loop (Gthp), the servers (capacity / ratio) and this client's CPUs
    (cores over the CPU a sample costs here at that mix)."""
    if cut is None or ratio <= 0:
        return rates.lthp()
    remote = rates.remote_capacity(cut) / ratio
    cpu = rates.step_cpu + (1.0 - ratio) * rates.local_cpu + ratio * cut.receive_cpu + rates.common_cpu
    sent = (1.0 - ratio) * rates.raw_bytes + ratio * cut.nbytes  # what the rail carries per sample
    rail = rates.rail_bytes_per_s / sent if sent > 0 else math.inf
    return min(rates.gthp, remote, rail, rates.cores / max(cpu, 1e-12))


def decide(rates: Rates, cuts: Sequence[Cut], threshold: float = SPEEDUP_THRESHOLD) -> Decision:
    """FastFlow's Algorithm 1 on ``rates`` over the legal ``cuts`` (see the module docstring).

    Raises:
        ConfigError: no cut given.
    """
    if not cuts:
        raise ConfigError("the offload decision needs at least one cut of the pipeline", field="offload")
    gthp, lthp = rates.gthp, rates.lthp()
    inputs = {
        "gthp": gthp,
        "lthp": lthp,
        "step_s": rates.step_s,
        "step_cpu": rates.step_cpu,
        "pcycle": rates.local_cpu,
        "common_cpu": rates.common_cpu,
        "cores": rates.cores,
        "rail_bytes_per_s": rates.rail_bytes_per_s,
    }
    if gthp <= lthp * (1.0 + threshold):
        why = (
            "the loop does not wait on preprocessing"
            if gthp <= lthp * (1.0 + 1e-9)
            else f"offloading would gain under {threshold:.0%}"
        )
        return Decision(0.0, None, f"no offload: {why} (Gthp {gthp:.0f}/s, Lthp {lthp:.0f}/s)", lthp, inputs)
    pcycle = max(rates.local_cpu, 1e-12)

    def worth(cut: Cut) -> float:
        return lthp * (1.0 - cut.receive_cpu / pcycle) + rates.rthp(cut)

    cut = max(cuts, key=lambda c: (worth(c), -c.nbytes))  # a tie goes to the cut that sends fewer bytes
    rthp = rates.rthp(cut)
    upper = rates.remote_capacity(cut)
    lower = (gthp - lthp) * (1.0 + cut.receive_cpu / pcycle)
    inputs.update(
        rthp=rthp,
        upper=upper,
        lower=lower,
        ocycle=cut.receive_cpu,
        remote_rate=cut.remote_rate,
        nbytes=float(cut.nbytes),
    )
    if lower < upper:
        ratio = min(upper / gthp, 1.0) if math.isfinite(upper) else 1.0
        rule = f"Lower {lower:.0f}/s < Upper {upper:.0f}/s: offload Upper/Gthp"
    else:
        ratio = rthp / (lthp + rthp) if lthp + rthp > 0 else 1.0
        rule = f"Upper {upper:.0f}/s <= Lower {lower:.0f}/s: balance Rthp/(Lthp+Rthp)"
    ratio = min(max(ratio, 0.0), 1.0)
    inputs["fastflow_ratio"] = ratio
    expected = predicted(rates, cut, ratio)
    # FastFlow's ratio assumes the client keeps up with whatever it is left; where the model says
    # its CPUs (the step's share included) cannot, the best ratio on the grid is taken instead
    best = max(
        (k / RATIO_STEPS for k in range(RATIO_STEPS + 1)), key=lambda r: (predicted(rates, cut, r), -abs(r - ratio))
    )
    if predicted(rates, cut, best) > expected * (1.0 + MODEL_MARGIN):
        rule += f"; the model predicts {predicted(rates, cut, best) / max(expected, 1e-12) - 1:.0%} more at {best:.2f}"
        ratio, expected = best, predicted(rates, cut, best)
    label = cut.label or f"{cut.stages} stage(s)"
    reason = f"offload {ratio:.2f} at {label}: {rule} (Gthp {gthp:.0f}/s, Lthp {lthp:.0f}/s, Rthp {rthp:.0f}/s)"
    return Decision(ratio, cut, reason, expected, inputs)


class Observed:
    """The throughput the loop achieved lately at each split (to the nearest :data:`OBSERVED_STEP`),
    kept :data:`OBSERVED_S`: what a model predicts is checked against what was seen, so noisy rates
    cannot move the split back and forth between two splits it has tried."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[float, float]] = {}  # split key -> (samples/s, when)

    @staticmethod
    def _key(ratio: float) -> int:
        return round(ratio / OBSERVED_STEP)

    def record(self, ratio: float, samples_per_s: float, now: float) -> None:
        """The loop achieved ``samples_per_s`` with ``ratio`` in force (averaged with what was seen)."""
        key = self._key(ratio)
        old = self._seen.get(key)
        fresh = old is not None and now - old[1] <= OBSERVED_S
        self._seen[key] = ((old[0] + samples_per_s) / 2 if fresh and old else samples_per_s, now)

    def get(self, ratio: float, now: float) -> float | None:
        """What was achieved at ``ratio`` within :data:`OBSERVED_S` (``None``: not seen lately)."""
        seen = self._seen.get(self._key(ratio))
        return seen[0] if seen is not None and now - seen[1] <= OBSERVED_S else None

    def contradicts(self, current: float, wanted: float, now: float, margin: float) -> bool:
        """Whether ``wanted`` did no better than ``current`` by ``margin`` when both were seen lately."""
        here, there = self.get(current, now), self.get(wanted, now)
        return here is not None and there is not None and there < here * (1.0 + margin)


@dataclass
class Hysteresis:
    """Adopts a new decision only when it is a real, repeated change (see the module docstring).

    Attributes:
        min_step: smallest ratio change adopted.
        min_gain: smallest predicted gain (fraction) that justifies a change.
        settle: the same answer this many times in a row before it is adopted.
        dwell: seconds after a change during which no other is made.
    """

    min_step: float = 0.1
    min_gain: float = 0.03
    settle: int = 2
    dwell: float = 2.0
    current: Decision | None = None
    changed_at: float = -math.inf
    changes: int = 0
    _candidate: float | None = None
    _seen: int = 0

    def offer(
        self,
        decision: Decision,
        rates: Rates,
        now: float,
        in_force: Cut | None = None,
        observed: Observed | None = None,
    ) -> Decision | None:
        """The decision to apply now, or ``None`` to keep the current one. ``in_force`` is the cut of
        the split in force as measured now (default: as it was when that split was decided);
        ``observed``, the throughput achieved lately at each split: a change to a split that did
        no better than the one in force is not made, whatever the model predicts."""
        if self.current is None:
            return self._adopt(decision, now)
        if now - self.changed_at < self.dwell:
            self._candidate, self._seen = None, 0
            return None
        current = self.current
        step = abs(decision.ratio - current.ratio)
        same_cut = decision.cut is None or current.cut is None or decision.cut.stages == current.cut.stages
        if step < self.min_step and same_cut:
            self._candidate, self._seen = None, 0
            return None
        now_expected = predicted(rates, in_force if in_force is not None else current.cut, current.ratio)
        if decision.expected < now_expected * (1.0 + self.min_gain) or (
            observed is not None and observed.contradicts(current.ratio, decision.ratio, now, self.min_gain)
        ):
            self._candidate, self._seen = None, 0
            return None
        if self._candidate is not None and abs(self._candidate - decision.ratio) < self.min_step:
            self._seen += 1
        else:
            self._candidate, self._seen = decision.ratio, 1
        if self._seen < self.settle:
            return None
        return self._adopt(decision, now)

    def _adopt(self, decision: Decision, now: float) -> Decision:
        self.current = decision
        self.changed_at = now
        self.changes += 1
        self._candidate, self._seen = None, 0
        return decision

    def keep(self, decision: Decision) -> None:
        """Record ``decision`` as the one in force without counting a change (e.g. a fixed start)."""
        self.current = replace(decision)
