"""The ``kspeed`` command-line tool: a local cluster, status, datasets, preload and the demo."""
