"""Production: which samples a share keeps in the pool, which it reads again from the backend and
when, for plans larger than memory, and preprocessed samples made on the way.

Runs in the server's main process (its producer threads); feeders learn the outcome as places.
"""
