"""Backend storage as the server reads it: fsspec file systems behind the operator's allow-list,
listings that describe a dataset, tar shards, fast local reads, and the checks that notice files
changed after they were listed.

Runs in the server's main process (listing, preload and production threads); nothing here holds
pool memory.
"""
