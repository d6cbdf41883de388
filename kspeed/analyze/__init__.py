"""The stall analyzer: where a job's data waits come from, and what would remove them.

:func:`analyze` measures a job's rates on a live cluster (:mod:`kspeed.analyze.measure`) and
predicts its throughput at other cluster shapes (:mod:`kspeed.analyze.model`);
:mod:`kspeed.analyze.report` prints and writes what it found. ``kspeed analyze`` is its command.
"""

from kspeed.analyze.analysis import Analysis, analyze
from kspeed.analyze.measure import Options
from kspeed.analyze.model import Measured, Prediction, Setup, predict, smallest_cluster

__all__ = ["Analysis", "Measured", "Options", "Prediction", "Setup", "analyze", "predict", "smallest_cluster"]
