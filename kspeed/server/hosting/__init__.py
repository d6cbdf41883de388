"""The datasets a server hosts: its shares, how they are preloaded into the pool, the sample index
that says where each one lives, integrity checks and scrubbing, and datasets cached preprocessed.

Runs in the server's main process.
"""
