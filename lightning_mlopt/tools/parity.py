"""``python -m lightning_mlopt parity --config FILE [--config OVERLAY ...] [--steps N]``.

"Is my parallel configuration silently wrong?" in one command, for any strategy (DDP, FSDP, ZeRO, TP, 2D).
It runs ``--steps`` steps of the configuration, then of a one-process reference of the same model, seed and
data (our DDP at one device, fp32, on the CPU, its batch the configuration's global batch), each as a ``fit``
of its own in ``<run_dir>/parity/``, and compares the losses step by step, the first step's gradients and
the final parameters tensor by tensor (see :mod:`lightning_mlopt.diagnosis.parity`). The reference runs eager
(``compile:`` off), so a compiled configuration is checked against its model. ``float8:`` is turned off in both
runs, said in a line: its activation scales come from each rank's own batch, so a one-process run cannot
reproduce a data-parallel float8 run, and the layout is what parity checks.

Exit 0 with a one-line verdict when they match; exit 1 naming the first step or tensor that diverges; 2 on
bad input. Arguments it does not know (``--trainer.devices=2``) go to both runs; the reference then sets
its own strategy, devices, accelerator and precision.

The reference sees the same samples: both runs read the data through a DistributedSampler with the same
seed, and a one-replica sampler's first ``B x D`` indices are the ``D`` data-parallel ranks' first ``B`` each.
So the configuration's data module must take ``batch_size`` (``data.init_args.batch_size``) when its
data-parallel size is over 1, and shuffling must not depend on the rank.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.tools._child_fit import checked_fit, run_child_fit
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input, fit_arguments

PARITY_DIR = "parity"
RECORDER = "lightning_mlopt.diagnosis.parity.ParityRecorder"
RECORD_NAME = "parity.pt"  # diagnosis.parity's, not imported here: it imports torch
# Both runs: a run directory of their own, no resume, no saves, no logger, no validation, no bar.
_COMPARED_RUN = (
    "--checkpoint.resume.auto=false",
    "--checkpoint.save_on.train_end=false",
    "--checkpoint.save_on.epoch_end=false",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.use_distributed_sampler=true",
)
# The reference: one process, fp32, on the CPU, DDP (its one-replica DistributedSampler orders the data as the
# configured run's samplers do), eager: a compiled configuration is compared with the model it compiles.
_REFERENCE = (
    "--compile.enabled=false",
    "--trainer.strategy=ddp",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.num_nodes=1",
    "--trainer.precision=32-true",
)


def _parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(
        prog="python -m lightning_mlopt parity",
        description="Run a few steps of a configuration and of a one-process reference (same model, seed and "
        "data; fp32 on the CPU) and compare losses, gradients and parameters. Exit 0 when they match, 1 naming "
        "the first divergence. Arguments not listed here (e.g. --trainer.devices=2) go to both runs; the "
        "reference then sets its own strategy, devices, accelerator and precision.",
    )
    parser.add_argument("--config", "-c", action="append", required=True, help="config file(s), in order")
    parser.add_argument("--steps", type=int, default=4, help="training steps compared (default 4)")
    return parser


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt parity``; returns the exit status."""
    options, extra = _parser().parse_known_args(list(argv))
    base_args = fit_arguments(options.config, extra)
    try:
        if options.steps < 1:
            raise BadInputError(f"--steps must be >= 1, got {options.steps}")
        config, run_dir = checked_fit(base_args)
    except BadInputError as error:
        return bad_input(error)
    folder = run_dir / PARITY_DIR
    if (config.get("float8") or {}).get("enabled"):
        # float8 scales each activation by its own amax: a rank's, over its batch; no one-process run reproduces
        # a data-parallel float8 run (measured: 14% on a parameter after 6 steps), so the layout is compared without.
        print("parity: float8 off in both runs (its activation scales come from each rank's batch)", flush=True)
        base_args = [*base_args, "--float8.enabled=false"]
    steps = [f"--trainer.max_steps={options.steps}", "--trainer.max_epochs=-1"]
    print(f"parity: {options.steps} steps of the configuration ...", flush=True)
    code = _run([*base_args, *_COMPARED_RUN, *steps], folder / "configured")
    if code:
        return code
    from lightning_mlopt.diagnosis.parity import FP32, HALF, compare, load_record

    parallel = load_record(folder / "configured")
    try:
        batch = _reference_batch(config, parallel["data_parallel_size"])
    except BadInputError as error:
        return bad_input(error)
    print(f"parity: {options.steps} steps of the one-process reference ...", flush=True)
    code = _run([*base_args, *_COMPARED_RUN, *steps, *_REFERENCE, *batch], folder / "reference")
    if code:
        return code
    precision = str(config.get("trainer", {}).get("precision") or "32")
    tolerance = FP32 if precision.startswith(("32", "64")) else HALF
    verdict = compare(parallel, load_record(folder / "reference"), tolerance)
    print(verdict.summary, flush=True)
    return 0 if verdict.matches else 1


def _reference_batch(config: dict[str, Any], data_parallel: int) -> list[str]:
    """``--data.init_args.batch_size=B x D``: the reference's one batch is the configured run's global batch.

    Raises:
        BadInputError: D > 1 and the data module takes no ``batch_size`` to scale.

    """
    if data_parallel == 1:
        return []
    data = config.get("data") or {}
    batch = (data.get("init_args") or {}).get("batch_size") if isinstance(data, dict) else None
    if not isinstance(batch, int):
        raise BadInputError(
            f"parity: the configured run has {data_parallel} data-parallel ranks, so the reference needs their "
            "global batch in one, and the data module has no data.init_args.batch_size to scale; give the data "
            "module a batch_size argument"
        )
    return [f"--data.init_args.batch_size={batch * data_parallel}"]


def _run(arguments: list[str], folder: Path) -> int:
    """One compared ``fit`` into ``folder`` (emptied first: an earlier comparison's record must not count)."""
    shutil.rmtree(folder, ignore_errors=True)
    recorder = [f"--trainer.callbacks+={RECORDER}", f"--trainer.callbacks.out_dir={folder}"]
    return run_child_fit([*arguments, *recorder], folder, expected=folder / RECORD_NAME)
