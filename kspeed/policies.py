"""What the servers keep of a dataset in memory: the policy names, shared by every side.

- ``auto`` (default): the whole dataset when it fits the servers' free memory (and its quota),
  else ``stream``.
- ``cache``: the whole dataset, loaded once and served from memory every epoch; refused when it
  does not fit.
- ``stream``: each server keeps only a window of its share, loaded from the backend ahead of
  consumption in the order the committed plans consume it and reclaimed once served; every
  sample is read once per epoch.
- ``minio``, ``reuse``, ``lru`` (for comparison, from CoorDL and Lobster): the window keeps written
  samples for their next use (a fixed subset; the farthest next use evicted first; the least
  recently used evicted first) and reads the misses in the same plan order.
"""

from __future__ import annotations

__all__ = ["CACHING", "MEMORY_POLICIES", "POLICIES"]

MEMORY_POLICIES = ("stream", "minio", "reuse", "lru")  # a dataset held in part (a window per share)
CACHING = ("minio", "reuse", "lru")  # memory policies that keep written samples (stream keeps none)
POLICIES = ("auto", "cache", *MEMORY_POLICIES)
