"""Where a run came from: git commit and dirty flag, command, environment fingerprint, our version."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_mlopt.redaction import redact


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(cwd: str | Path = ".") -> dict[str, Any]:
    """The commit checked out in ``cwd``, whether tracked files differ from it, and the origin URL.

    Outside a repository (or without git) the values are None. The URL's credentials are removed.

    Example::

        >>> sorted(git_state("/"))
        ['commit', 'dirty', 'remote']
    """
    folder = Path(cwd)
    commit = _git(["rev-parse", "HEAD"], folder)
    if commit is None:
        return {"commit": None, "dirty": None, "remote": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], folder)
    remote = _git(["config", "--get", "remote.origin.url"], folder)
    return {"commit": commit, "dirty": bool(status), "remote": redact(remote) if remote else None}


def run_provenance(cwd: str | Path = ".") -> dict[str, Any]:
    """Everything needed to find the code and environment of a run again, with secrets redacted.

    Example::

        >>> sorted(run_provenance())
        ['command', 'fingerprint', 'git', 'lightning_mlopt']
    """
    import lightning_mlopt
    from lightning_mlopt.distributed.fingerprint import collect_fingerprint  # here: fingerprint imports us

    return redact(
        {
            "lightning_mlopt": lightning_mlopt.__version__,
            "git": git_state(cwd),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "fingerprint": collect_fingerprint(),
        }
    )
