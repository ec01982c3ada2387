"""One ``fit`` a tool runs as a child process (a ``profile`` measurement, a ``parity`` run), and how it ended.

Example::

    code = run_child_fit(["--config", "c.yaml", "--trainer.max_steps=5"], folder, expected=folder / "out.json")
    if code:
        return code  # 2: the run's own bad-input line was shown; 1: the end of its log was
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.cli.commands import command_line
from lightning_mlopt.run_dir import CHECKPOINTS_DIR


def run_child_fit(arguments: Sequence[str], folder: Path, expected: Path) -> int:
    """Run ``fit ARGUMENTS --run_dir=FOLDER`` (its log in ``folder/output.log``); 0 when it wrote ``expected``.

    The run's checkpoints are removed after it: a measurement, not a run to resume. Bad input (the run's
    status 2) is passed on with the run's own ``error:`` line; any other failure, or ``expected`` missing,
    is 1 with the end of the log.
    """
    from lightning_mlopt.process.child import child_fit_env, run_forwarding_signals

    folder.mkdir(parents=True, exist_ok=True)
    expected.unlink(missing_ok=True)
    command = command_line("fit", *arguments, f"--run_dir={folder}")
    log_path = folder / "output.log"
    with open(log_path, "wb") as log:
        code, signalled = run_forwarding_signals(command, log, child_fit_env())
    shutil.rmtree(folder / CHECKPOINTS_DIR, ignore_errors=True)
    if code == 2:  # bad input: the run said why in one line, before writing anything
        said = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith("error: ")]
        sys.stderr.write((said[0] if said else f"error: bad input (see {log_path})") + "\n")
        return 2
    if code != 0 or not expected.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        why = "it was signalled" if signalled else f"exit {code}" if code else f"it wrote no {expected.name}"
        sys.stderr.write(f"error: the run in {folder} failed ({why}); its log ends:\n" + "\n".join(tail) + "\n")
        return 1
    return 0


def checked_fit(arguments: Sequence[str]) -> tuple[dict[str, Any], Path]:
    """The ``fit`` ``arguments`` parsed and checked as the run will be (nothing built), and its run directory.

    Raises:
        BadInputError: what the run itself would refuse, before a child process starts.

    """
    from lightning_mlopt.cli.bad_input import config_paths
    from lightning_mlopt.cli.check import check_arguments
    from lightning_mlopt.run_dir import resolve_run_dir

    config: dict[str, Any] = check_arguments(list(arguments)).as_dict()
    return config, resolve_run_dir(config, config_paths(list(arguments)))
