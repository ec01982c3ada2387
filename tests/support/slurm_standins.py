"""Stand-ins for SLURM's ``srun`` and ``scontrol`` (no SLURM controller runs here), and the environment that
``sbatch`` gives a batch script, so tests can run the scripts we generate."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

from tests.conftest import REPO_PYTHONPATH

# srun as SLURM runs it: one task per SLURM_NTASKS with SLURM_PROCID/LOCALID/NODEID, exit status the highest
# of the tasks'. Like `#SBATCH --signal=USR1@N`, it sends SIGUSR1 to every task, here once a file matching
# STANDIN_SIGNAL_AFTER_GLOB exists (e.g. the first committed checkpoint), so a job is interrupted mid-run.
SRUN = """#!{python}
import glob, os, signal, subprocess, sys, time
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
tasks, per_node = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write("srun " + " ".join(args) + "\\n")
procs = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % per_node),
                                      "SLURM_NODEID": str(r // per_node)}}) for r in range(tasks)]
pattern, signalled = os.environ.get("STANDIN_SIGNAL_AFTER_GLOB"), False
while any(p.poll() is None for p in procs):
    if pattern and not signalled and glob.glob(pattern):
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        signalled = True
    time.sleep(0.1)
sys.exit(max(p.returncode for p in procs))
"""
SCONTROL = """#!/bin/sh
echo "scontrol $*" >> "$STANDIN_LOG"
"""


def slurm_environment(tmp_path: Path, tasks_per_node: int, job_name: str = "test") -> dict[str, str]:
    """Stand-ins on PATH and the variables sbatch sets for a one-node job; calls are logged to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": REPO_PYTHONPATH,
        "STANDIN_LOG": str(tmp_path / "calls.log"),
        "SLURM_JOB_ID": str(random.randint(20000, 29999)),  # Lightning derives MASTER_PORT from it
        "SLURM_JOB_NAME": job_name,
        "SLURM_NTASKS": str(tasks_per_node),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODELIST": "127.0.0.1",
    }
    env.pop("MASTER_PORT", None)
    env.pop("MASTER_ADDR", None)
    return env
