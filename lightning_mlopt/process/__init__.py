"""The life of a ``python -m lightning_mlopt`` process, from its first second to its exit status.

Standard library only, so the entry point loads all of it before torch and Lightning (seconds of imports
during which a scheduler's signal or a dead peer must not go unnoticed):

- ``signals.py``: preemption signals owned from the first second (flag-only handlers) and the deadline after one.
- ``startup.py``: the start-up deadline, and the end of a rank whose launcher is gone.
- ``phase.py``: which phase of a step the process is in (read by the guards, the watchdog and PerformanceMonitor).
- ``watchdog.py``: the hang watchdog (no step finished in time: stacks to disk, exit 124).
- ``exit_codes.py``: the exit statuses, named once.
- ``exit.py``: how a rank leaves with the agreed status and without an abort on the way out.
- ``launcher.py``: whether Lightning's launcher started this rank, and waiting for it to go first.
- ``child.py``: a ``fit`` started by a sweep or ``profile``: its environment, and signals passed on to it.
- ``run_lock.py``: one live job per run directory (the lock rank zero holds, and the record naming it).

Example::

    >>> import subprocess, sys
    >>> code = "import sys, lightning_mlopt.process.exit; print('torch' in sys.modules)"
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    'False'
"""
