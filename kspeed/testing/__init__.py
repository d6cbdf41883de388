"""Support for KSpeed's tests and benchmarks; production code never imports it.

:mod:`.throttle` holds file systems that stand in for remote storage (latency per request, a
bandwidth cap, pauses): fsspec finds them by the entry points that ``pyproject.toml`` declares
(``slowfile``, ``throttled``), so a daemon started by a test reads them with no import of its own.
"""
