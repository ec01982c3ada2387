"""The subcommands of ``python -m lightning_mlopt``: Trainer runs, and tools dispatched before any Trainer.

Standard library only: the entry point reads it before importing torch.

Example::

    python -m lightning_mlopt fit --config configs/quickstart.yaml   # a Trainer run (cli/entry.py)
    python -m lightning_mlopt checkpoint verify runs/quickstart-1a2b3c4d    # a tool (its module's main)
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence

TRAINER_RUNS = ("fit", "validate", "test", "predict")

# Subcommands that are tools, not Trainer runs: name -> (module with a ``main(argv) -> int``, summary).
TOOLS = {
    "plan": ("lightning_mlopt.tools.plan", "memory per rank for each strategy, from numbers or a config"),
    "checkpoint": (
        "lightning_mlopt.tools.checkpoint",
        "list, verify, consolidate, export (safetensors) or convert checkpoints",
    ),
    "sweep": ("lightning_mlopt.tools.sweep", "hyperparameter sweeps: local, on W&B, or as a SLURM job array"),
    "slurm": ("lightning_mlopt.tools.slurm", "write an sbatch script that requeues and resumes the run"),
    "launch": ("lightning_mlopt.tools.launch", "torchrun with preemption done right: exit 75, within the grace"),
    "k8s": ("lightning_mlopt.tools.k8s", "write a Kubernetes JobSet/TrainJob/PyTorchJob that resumes after preemption"),
    "profile": (
        "lightning_mlopt.tools.profile",
        "why is my run slow: step time per rank, input ceiling, MFU, scaling",
    ),
    "parity": (
        "lightning_mlopt.tools.parity",
        "is my parallel config silently wrong: a few steps against one process, tensor by tensor",
    ),
    "goodput": (
        "lightning_mlopt.tools.goodput",
        "share of wall-clock time on steps that survived, and badput by category, over all launches",
    ),
}


def tools_help(below: bool = False) -> str:
    """The list of subcommands, for ``--help`` and for a command line that names none."""
    lines = [f"Trainer runs: {', '.join(TRAINER_RUNS)}{' (below)' if below else ''}. Tools, each with its own --help:"]
    lines += [f"  {name:<11} {summary}" for name, (_, summary) in TOOLS.items()]
    return "\n".join(lines) + "\n"


def refuse_unknown_subcommand(name: str) -> None:
    """Raise BadInputError for a mistyped subcommand, naming the one likely meant and all of them.

    Example::

        >>> refuse_unknown_subcommand("fit")
        >>> refuse_unknown_subcommand("fti")
        Traceback (most recent call last):
        ...
        lightning_mlopt.exceptions.BadInputError: unknown subcommand 'fti' (did you mean fit?); ...
    """
    from lightning_mlopt.exceptions import BadInputError

    known = [*TRAINER_RUNS, *TOOLS]
    if name in known or name.startswith("-"):
        return
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise BadInputError(f"unknown subcommand {name!r}{hint}; subcommands: {', '.join(known)}")


def run_tool(name: str, argv: Sequence[str]) -> int:
    """Run tool ``name`` with its arguments; its exit status."""
    return int(importlib.import_module(TOOLS[name][0]).main(list(argv)))


def command_line(subcommand: str, *args: str) -> list[str]:
    """``python -m lightning_mlopt SUBCOMMAND ARGS...`` with this interpreter: what scripts and sweeps launch.

    Example::

        >>> command_line("fit", "--config", "gpt.yaml")[1:]
        ['-m', 'lightning_mlopt', 'fit', '--config', 'gpt.yaml']
    """
    return [sys.executable, "-m", "lightning_mlopt", subcommand, *args]
