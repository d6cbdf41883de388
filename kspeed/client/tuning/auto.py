"""``offload="auto"``: one rank's split of preprocessing, measured and decided while the job runs.

:class:`AutoOffload` is fed by the prepared dataset (:class:`kspeed.client.prepared.PreparedDataset`):
the calls of ``next()`` (:class:`~kspeed.client.tuning.meters.LoopMeter`) and each batch its workers
finish (:class:`~kspeed.client.tuning.meters.PrepMeter`); a thread reads the servers' preprocessing
counters every :data:`INTERVAL_S` (:class:`~kspeed.client.tuning.meters.ServerMeter`). Every interval
the training thread decides (:func:`~kspeed.client.tuning.decision.decide`, FastFlow's Algorithm 1)
and, through :class:`~kspeed.client.tuning.decision.Hysteresis`, applies a real change at the next
batch boundary (:meth:`kspeed.client.feeding.pump.Pump.resplit`). Each adopted decision is logged
once with its inputs; :meth:`AutoOffload.stats` is what ``ds.stats()["offload"]`` shows.

Until this client ran a sample's offloadable stages itself, its cost here (Pcycle) is taken as the
servers' measured cost per sample (their workers' CPU seconds over their samples; busy seconds
from a server that does not report CPU, which overstate the cost where workers share cores): a
prior that the first samples run here replace.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kspeed.client.feeding.links import Link
from kspeed.client.tuning.decision import Cut, Decision, Hysteresis, Observed, Rates, decide, predicted
from kspeed.client.tuning.meters import WINDOW_S, LoopMeter, PrepMeter, Reading, ServerMeter, Window
from kspeed.config import usable_cores
from kspeed.errors import KSpeedError

__all__ = ["AutoOffload"]

log = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the servers are read and the split reconsidered
MIN_SAMPLES = 16  # samples the loop must have consumed (in its recent window) before a decision


class AutoOffload:
    """The self-tuned split of one rank's dataset.

    Args:
        dataset: its name (for logs).
        links: its servers now (their preprocessing counters are read; a share that moved is read
            at its new server).
        server_stages: the stages the servers run for an offloaded sample (the one cut applied).
        nbytes: bytes a sample offloaded at that cut sends.
        label: how logs name the cut.
        apply: makes a ratio the split from the next batch on (the pump's ``resplit``).
        ratio: the split in force at the start.
        rail_bytes_per_s: the rail's bandwidth, where known.
        raw_bytes: a sample's stored bytes (the rail carries them for each sample preprocessed here).
        cores: CPUs this process may use (default: :func:`usable_cores`).
        clock: the time source (tests).
        hysteresis: how a change is adopted (default: :class:`Hysteresis`'s).
        keep: keeps a decision for the next run (the manager's metric store); called from this
            tuner's thread after a change, and at :meth:`close`.
        record: makes that record of a ratio and the decision behind it.
        kept: the rates of the decision kept from a previous run, if any (its Pcycle is the prior).
        job: the job's name as its feeds gave it to the servers (each server then says how many
            of its samples were this job's: the others' use is the rest).
        loop: the meter of the loop's step, fed by the dataset's calls of ``next()`` (the one the
            wait's attribution keeps: the step is measured once).
    """

    def __init__(
        self,
        *,
        dataset: str,
        links: Callable[[], Sequence[Link]],
        server_stages: int,
        nbytes: int,
        label: str,
        apply: Callable[[float], None],
        ratio: float,
        rail_bytes_per_s: float = math.inf,
        raw_bytes: float = 0.0,
        cores: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        hysteresis: Hysteresis | None = None,
        keep: Callable[[Any], None] | None = None,
        record: Callable[[float, Decision | None], Any] | None = None,
        kept: Mapping[str, float] | None = None,
        job: str = "",
        loop: LoopMeter | None = None,
    ) -> None:
        self.dataset = dataset
        self._job = job
        self.loop = loop if loop is not None else LoopMeter()
        self.prep = PrepMeter(server_stages)
        self.servers = ServerMeter()
        self._links = links
        self._stages, self._nbytes, self._label = server_stages, nbytes, label
        self._apply = apply
        self._rail = rail_bytes_per_s
        self._raw_bytes = raw_bytes
        self._cores = cores if cores is not None else usable_cores()
        self._clock = clock
        self.hysteresis = hysteresis or Hysteresis()
        self.ratio = ratio
        self.hysteresis.keep(Decision(ratio, None, f"start at {ratio:.2f}", 0.0))
        self.last: Decision | None = None  # the latest decision made (adopted or not)
        self.decided_at = -math.inf  # when (this tuner's clock)
        self._next_at = clock() + INTERVAL_S
        # offloaded samples received so far, read at each decision: this job's rate at the servers is
        # taken over the last WINDOW_S (as their capacity is), not since the last decision: samples
        # arrive in bursts, and a burst taken for a rate made the servers look faster than they are
        self._remote_samples = 0.0
        self._remote_marks: collections.deque[tuple[float, float]] = collections.deque([(clock(), 0.0)])
        self._remote_rate = 0.0
        self._server_cost: float | None = None  # the servers' CPU seconds per sample (the Pcycle prior)
        self._kept_cost = (kept or {}).get("pcycle")  # the last run's Pcycle (a better prior)
        self._keep, self._record = keep, record
        self._unsaved = False
        self._inline = Window(2)  # CPU seconds of batches prepared inside next(), samples
        self.observed = Observed()  # what the loop achieved at each split lately
        self._consumed_at: tuple[float, int] | None = None  # (when, samples consumed) at the last tick
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_servers, name=f"kspeed-tune-{dataset}", daemon=True)
        self._thread.start()

    # -- what the prepared dataset reports -----------------------------------------------------------

    def batch_done(
        self, seconds: dict[str, float], cpu_s: float, wall_s: float, local: int, remote: int, inline: bool = False
    ) -> None:
        """A batch the client's workers finished: its stage seconds, CPU and wall, and its mix;
        ``inline``: it was prepared in the training thread, inside ``next()`` (its CPU is then in the
        loop's ``next()`` time too, and is not counted twice)."""
        self.prep.record(seconds, cpu_s, wall_s, local, remote)
        with self._lock:
            self._remote_samples += remote
            self._inline.add(self._clock(), (cpu_s if inline else 0.0, float(local + remote)))

    def tick(self) -> Decision | None:
        """Called by the training thread after each batch: every interval, decide and apply.
        Returns the decision adopted now, if any."""
        now = self._clock()
        if now < self._next_at:
            return None
        self._next_at = now + INTERVAL_S
        rates = self.rates(now)
        if rates is None:
            return None
        consumed = self.loop.consumed
        if self._consumed_at is not None and now - self.hysteresis.changed_at >= self.hysteresis.dwell:
            # the split in force has had its dwell: what the loop achieved counts for it
            began, before = self._consumed_at
            if now > began:
                self.observed.record(self.ratio, (consumed - before) / (now - began), now)
        self._consumed_at = (now, consumed)
        cut = self._cut()
        decision = decide(rates, [cut])
        # what Rthp was made of: the servers' capacity in all, what they ran, and this job's part
        with self._lock:
            mine = self._remote_rate
        decision.inputs.update(server_capacity=self.servers.capacity, server_used=self.servers.used, job_rate=mine)
        self.last, self.decided_at = decision, now
        adopted = self.hysteresis.offer(decision, rates, now, in_force=cut, observed=self.observed)
        if adopted is None or abs(adopted.ratio - self.ratio) < 1e-9:
            return None
        log.info(
            "dataset %s: offload %.2f -> %.2f: %s; inputs %s",
            self.dataset,
            self.ratio,
            adopted.ratio,
            adopted.reason,
            {k: round(v, 6) for k, v in adopted.inputs.items()},
        )
        self.ratio = adopted.ratio
        self._apply(adopted.ratio)
        self._unsaved = True
        return adopted

    # -- rates ---------------------------------------------------------------------------------------

    def _cut(self) -> Cut:
        with self._lock:
            mine = self._remote_rate
        receive = self.prep.receive_cpu if self.prep.receive_cpu is not None else 0.0
        remote = self.servers.left_for(mine, len({link.server_id for link in self._links()}))
        return Cut(self._stages, self._nbytes, remote, receive, self._label)

    def rates(self, now: float | None = None, *, advance: bool = True) -> Rates | None:
        """The rates measured so far (``None``: too few to decide on); ``advance=False`` reads them
        without starting a new span of this job's own rate at the servers (a report, not a decision)."""
        now = self._clock() if now is None else now
        with self._lock:
            marks = self._remote_marks
            if advance and now - marks[-1][0] >= INTERVAL_S:
                marks.append((now, self._remote_samples))
                while len(marks) > 2 and now - marks[1][0] >= WINDOW_S:
                    marks.popleft()
                began, before = marks[0]
                self._remote_rate = (self._remote_samples - before) / (now - began)
        loop = self.loop.figures()
        local = self.prep.local_cpu
        if local is None:
            local = self._kept_cost if self._kept_cost is not None else self._server_cost
        if loop is None or loop["samples"] < MIN_SAMPLES or local is None:
            return None
        with self._lock:
            inline_cpu, prepared = self._inline.sums()
        inside = max(loop["next_cpu"] - (inline_cpu / prepared if prepared else 0.0), 0.0)
        return Rates(
            step_s=loop["step_s"],
            step_cpu=loop["step_cpu"],
            local_cpu=local,
            common_cpu=self.prep.common_cpu + inside,
            cores=float(self._cores),
            rail_bytes_per_s=self._rail,
            raw_bytes=self._raw_bytes,
        )

    def _read_servers(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self.read_servers()
            if self._unsaved:
                self._save()

    def read_servers(self) -> None:
        """Read the servers' preprocessing counters once (the tuner's thread does, every interval)."""
        busy = cpu = ran = 0.0
        # one link per share: a server holding two (a failover moved one to it) is read once
        links = list({link.server_id: link for link in self._links()}.values())
        for gone in self.servers.known() - {link.server_id for link in links}:
            self.servers.forget(gone)  # its share moved: the new holder is read instead
        for link in links:
            try:
                figures = link.prep_figures(self._job)
            except KSpeedError as exc:  # a lost server: failover deals with it
                log.debug("dataset %s: no preprocessing figures from %s: %s", self.dataset, link.name, exc)
                self.servers.forget(link.server_id)
                continue
            if figures is None:
                continue
            self.servers.read(link.server_id, Reading.of(figures, counts_job=bool(self._job)), self._clock())
            busy += figures.busy_seconds
            cpu += figures.cpu_seconds
            ran += figures.samples
        if ran > 0:
            self._server_cost = (cpu if cpu > 0 else busy) / ran

    def _save(self) -> None:
        """Keep the split in force for the next run (best effort: a manager away loses nothing here)."""
        if self._keep is None or self._record is None:
            return
        self._unsaved = False
        try:
            self._keep(self._record(self.ratio, self.last))
        except KSpeedError as exc:
            log.debug("dataset %s: offload decision not kept on the manager: %s", self.dataset, exc)

    # -- reporting -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The split in force, why, and the rates the last decision used."""
        current = self.hysteresis.current
        rates = self.rates(advance=False)
        expected = predicted(rates, self._cut(), self.ratio) if rates is not None else None
        return {
            "mode": "auto",
            "ratio": self.ratio,
            "reason": current.reason if current is not None else "",
            "changes": self.hysteresis.changes,
            "expected_samples_per_s": expected,
            "inputs": dict(self.last.inputs) if self.last is not None else {},
            "last_decision": self.last.reason if self.last is not None else "",
            "last_ratio": self.last.ratio if self.last is not None else None,
            "decided_at": self.decided_at,
        }

    def close(self) -> None:
        """Stop reading the servers; keep the split in force if a decision was made."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self._unsaved or (self.last is not None and self.hysteresis.changes > 0):
            self._save()
