"""Launching ranks: the launcher's policy and options, restarts, ``spawn`` and ``Parallel``.

This wing sits above the process-group core and the backends: it starts processes (or rank
threads) that then join a group through :mod:`collectives`' public API. ``python -m
collectives.run`` (``collectives/run.py``) is its command line; ``collectives.spawn``,
``collectives.SpawnContext`` and ``collectives.Parallel`` are its public names.
"""
