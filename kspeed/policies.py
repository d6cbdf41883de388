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

A server produces a share under one of these or under two members of its own (never asked for by
name: held whole, or on demand by a survivor); :mod:`kspeed.server.production.policies` holds the
classes that make each policy's decisions.
"""

from __future__ import annotations

__all__ = ["AUTO", "CACHE", "CACHING", "LRU", "MEMORY_POLICIES", "MINIO", "POLICIES", "REUSE", "STREAM"]

AUTO = "auto"
CACHE = "cache"
STREAM = "stream"
MINIO = "minio"
REUSE = "reuse"
LRU = "lru"

MEMORY_POLICIES = (STREAM, MINIO, REUSE, LRU)  # a dataset held in part (a window per share)
CACHING = (MINIO, REUSE, LRU)  # memory policies that keep written samples (stream keeps none)
POLICIES = (AUTO, CACHE, *MEMORY_POLICIES)
