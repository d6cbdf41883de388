"""Attacks against real daemons on loopback, bounded in time and count (marker ``security``)."""
