"""Server-side preprocessing: worker processes, each confined by :mod:`.sandbox`
(its own user, Landlock, seccomp), that run a dataset's pipeline stages on samples from the pool.

:mod:`.workers` and :mod:`.link` run in the server's main process; :mod:`.worker` is the worker
processes' program.
"""
