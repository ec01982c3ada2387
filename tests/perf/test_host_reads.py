"""No device synchronisation on a quiet step: the CLI with its defaults and the bar drawn, under every strategy.

A quiet step neither logs (no logger is called) nor prints (the progress bar does not read its metrics). On a
GPU, any host read of a device tensor in such a step stops the host queueing the next step while the GPU
drains: Lightning's own loop read every ``prog_bar=True`` metric after every batch (``.item()``), which cost the
CLI 17-28% over a plain loop on an H200 (issue 38). Counted here on CPU by provenance
(``tests/support/host_reads.py``): every read of a tensor computed from the model or a batch, with its site.

The runs: the GPT demo through ``python -m lightning_mlopt fit`` with its default callbacks, the bar drawn (as
in a terminal: ``log_every_n_steps: 0``) and a default logger, for DDP (with a user's model that puts a metric
of its own on the bar), FSDP and ZeRO-2 on 2 processes, and one process with no bar at all.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args

STEPS = 10
LOG_EVERY = 5
# DeepSpeed's ZeRO-1/2 optimizer reads its global norm's validity on the host inside its own step: once to skip a
# step with a non-finite norm (fp32, or bf16 with its default `check_grad_overflow`), and once per parameter group
# in its clip. A loop that calls `deepspeed.initialize` alone pays the same; they are pinned here, so that a
# DeepSpeed upgrade that changes them, or a read of ours that hides among them, is seen.
DEEPSPEED_OWN = Counter({"step": 1, "unscale_and_clip_grads": 2})


def _launch(tmp_path: Path, strategy: str, devices: int, *extra: str) -> list[dict]:
    out = tmp_path / "reads"
    result = run_cli(
        fit_args(
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            f"--trainer.log_every_n_steps={LOG_EVERY}",
            "--trainer.callbacks+=tests.support.host_reads.CountHostReads",
            f"--trainer.callbacks.out_dir={out}",
            *extra,
            strategy=strategy,
            devices=devices,
            steps=STEPS,
            run_dir=tmp_path / "run",
            quiet=False,
        ),
        cwd=tmp_path,
        preloaded=True,
    )
    assert result.returncode == 0, failure_report(result)
    return [json.loads((out / f"host-reads-rank{rank}.json").read_text()) for rank in range(devices)]


# The bar as a terminal draws it (a file or pipe would get a plain line every N steps instead), at most every
# 2 s so that quiet steps remain on a slow machine: each step is slower here, under the counting dispatch mode.
BAR_DRAWN = (
    "--trainer.callbacks+=lightning_mlopt.callbacks.ThroughputProgressBar",
    "--trainer.callbacks.log_every_n_steps=0",
    "--trainer.callbacks.min_interval_s=2.0",
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "devices", "extra"),
    [
        ("ddp", 2, (*BAR_DRAWN, "--model=tests.support.host_reads.GPTWithBarMetrics")),
        ("fsdp", 2, BAR_DRAWN),
        ("zero2", 2, BAR_DRAWN),
        ("auto", 1, ("--model=tests.support.host_reads.GPTWithBarMetrics", "--trainer.enable_progress_bar=false")),
    ],
    ids=["ddp-user-model", "fsdp", "zero2", "one-process-no-bar"],
)
def test_a_quiet_step_reads_nothing_from_the_device(tmp_path, strategy, devices, extra):
    records = _launch(tmp_path, strategy, devices, *extra)
    seen_reads = 0
    for rank, record in enumerate(records):
        steps = record["steps"]
        assert [step["step"] for step in steps] == list(range(STEPS))
        quiet = [step for step in steps if not step["logged"] and not step["printed"]]
        assert len(quiet) >= 3, f"rank {rank}: too few quiet steps to judge: {steps}"
        for step in quiet:
            sites = Counter(read["site"] for read in step["reads"])
            if strategy == "zero2":
                own = Counter(
                    {name: sum(n for site, n in sites.items() if site.endswith(f" {name}")) for name in DEEPSPEED_OWN}
                )
                assert own == DEEPSPEED_OWN, f"rank {rank}, step {step['step']}: DeepSpeed's reads changed: {sites}"
                sites = Counter(
                    {site: n for site, n in sites.items() if not site.startswith("deepspeed/runtime/utils")}
                )
            assert not sites, f"rank {rank}, quiet step {step['step']} read the device: {dict(sites)}"
        seen_reads += sum(len(step["reads"]) for step in steps if step["logged"] or step["printed"])
    # The count sees reads where they are due: the logged metrics on logging steps, the bar's when it draws.
    assert seen_reads > 0
