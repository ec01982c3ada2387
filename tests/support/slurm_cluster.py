"""A private one-node SLURM cluster for the tests marked ``slurm``: Debian's slurm-wlm and munge, as root.

Its own config, spool, state, munge socket and key, and free ports, so it never meets a cluster the machine
may already run; every daemon is stopped by its pid file at the end. No systemd, no cgroups: process tracking
through /proc. ``.ci/run`` installs the two packages where it runs as root on Debian; elsewhere the tests
are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import closing
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


def missing_requirement() -> str | None:
    """Why no private cluster can start here, or None."""
    if os.geteuid() != 0:
        return "a private SLURM cluster needs root (slurmd runs jobs as any user)"
    lacking = [
        name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()
    ]
    if lacking:
        return f"SLURM binaries missing ({', '.join(lacking)}): apt-get install -y slurm-wlm munge"
    return None


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """Start with ``start()``, stop with ``stop()``; ``env`` is what a client command needs (``SLURM_CONF``).

    Args:
        root: an empty folder for the config, state, spool, logs and munge files.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60) -> None:
        """Write the config, start munged, slurmctld and slurmd, and wait until the node is idle."""
        for folder in ("state", "spool"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(
            [
                _binary("munged"),
                f"--key-file={key}",
                f"--socket={self.root / 'munge.socket'}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munged.seed'}",
                "--force",
            ],
            check=True,
            capture_output=True,
        )
        self.conf.write_text(self._config())
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_binary(daemon), "-f", str(self.conf)], check=True, capture_output=True, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T").stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node never became idle; see {self.root}/slurmctld.log and slurmd.log")

    def _config(self) -> str:
        node = subprocess.run([_binary("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
        node_line = node.splitlines()[0]  # NodeName=<short host> CPUs=... RealMemory=...
        host = node_line.split()[0].split("=", 1)[1]
        return "\n".join(
            [
                "ClusterName=mlopt-tests",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                # cred_expire: how long a requeued job is held before it may start again (120 s by default:
                # the "about two minutes" a requeue takes); the minimum SLURM accepts keeps the tests short.
                f"AuthInfo=socket={self.root / 'munge.socket'},cred_expire=10",
                f"StateSaveLocation={self.root / 'state'}",
                f"SlurmdSpoolDir={self.root / 'spool'}",
                f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                f"SlurmdLogFile={self.root / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SwitchType=switch/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/backfill",
                # Scheduling passes every second or two instead of every 30 s (backfill) and 60 s (main loop):
                # a requeued job then starts as soon as its credential expires, not up to 30 s later.
                "SchedulerParameters=bf_interval=1,sched_interval=2",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                "JobAcctGatherType=jobacct_gather/none",
                "KillWait=30",  # seconds between SIGTERM and SIGKILL, as on most clusters
                "MinJobAge=600",  # keep finished jobs visible to scontrol for the assertions
                f"{node_line} State=UNKNOWN",
                f"PartitionName=tests Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def run(self, *command: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster."""
        return subprocess.run(
            [_binary(command[0]), *command[1:]], capture_output=True, text=True, env=self.env, check=check
        )

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
        text = self.run("scontrol", "show", "job", job_id).stdout
        fields: dict[str, str] = {}
        for token in text.split():
            if "=" in token:
                key, _, value = token.partition("=")
                fields.setdefault(key, value)
        return fields

    def stop(self) -> None:
        """Cancel every job, then stop the daemons by pid."""
        self.run("scancel", "--full", "--user=root")
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / f"{name}.pid"
            try:
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
