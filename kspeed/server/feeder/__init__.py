"""Feeders: the processes that write ready samples into clients' rings.

:mod:`.supervisor` runs in the server's main process: it starts the feeder processes and relays
plans, places and frees to them. :mod:`.process` and :mod:`.writer` run in each feeder process
(one per usable core, at most four). :mod:`.protocol` defines what the two sides send each other.
:mod:`.doorbell` wakes a feeder from the main process.
"""
