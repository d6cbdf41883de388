"""Preprocessing pipelines and their placement between servers and clients."""
