"""Feeders: the processes that write ready samples into clients' rings.

:mod:`.supervisor` runs in the server's main process: it starts the feeder processes and relays
plans, places and frees to them. :mod:`.process`, :mod:`.writer` and :mod:`.doorbell` (one poller
for a feeder's idle feeds) run in each feeder process (one per usable core, at most four).
:mod:`.protocol` defines what the two sides send each other; :mod:`.plan_part` is a feeder's part
of a plan.
"""
