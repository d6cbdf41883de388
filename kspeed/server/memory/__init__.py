"""The server's pooled host memory: 128 MiB registered regions, slices of them shared by small
datasets, each share's window of resident samples, where each sample lives now, and crc32c of
what was loaded.

Runs in the server's main process; feeder processes map the same regions (:mod:`.pool` names them)
and read what :mod:`.residency` and :mod:`.window` decide, never decide it.
"""
