"""``python -m lightning_mlopt ARGS`` for a docs block, its process forked from the test's preloaded server.

A docs block's ``python`` is a shim (:func:`python_shim`) that sends ``-m lightning_mlopt ARGS`` here and runs
anything else with the real interpreter. The command runs the CLI's own entry point in a fresh fork of a process
that imported torch and Lightning once (``tests/support/preloaded.py``), from the block's folder and with its
environment; what it printed comes out on this process's stdout and stderr once it ends (a pipe after it still
reads it all), and its exit status is this process's. Children it starts (a sweep's trials) are real launches.

Example::

    bin_dir = python_shim(tmp_path / "bin")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", SERVER_ENV: str(server_socket())}
    subprocess.run(["bash", "-c", "python -m lightning_mlopt plan --num_params 1B"], env=env)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.support.preloaded import run_preloaded


def python_shim(folder: Path) -> Path:
    """A folder holding ``python``: ``-m lightning_mlopt ...`` through this module, the rest to this interpreter."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "python"
    real = sys.executable
    shim.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = "-m" ] && [ "$2" = "lightning_mlopt" ]; then\n'
        f'  shift 2; exec "{real}" -m tests.support.preloaded_client "$@"\n'
        "fi\n"
        f'exec "{real}" "$@"\n'
    )
    shim.chmod(0o755)
    return folder


def main(args: list[str]) -> int:
    """Run ``args`` as ``python -m lightning_mlopt`` would, preloaded; print its output; return its status."""
    result = run_preloaded(args, Path.cwd(), dict(os.environ), timeout=600)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
