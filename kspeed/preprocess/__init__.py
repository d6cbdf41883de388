"""Preprocessing: ops, pipelines of them sent as data, and their placement between servers and clients.

``Pipeline([Stage("decode_image"), Stage("random_resized_crop", {"size": [224, 224]}), ...])`` is
attached to a :class:`kspeed.DatasetSpec`; each stage runs on the servers, the client's CPU or its
GPU, and draws its randomness from ``(seed, epoch, sample, stage)`` wherever it runs.
"""

from kspeed.preprocess.pipeline import Output, Pipeline, Stage

__all__ = ["Output", "Pipeline", "Stage"]
