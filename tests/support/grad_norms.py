"""GradNormMonitor's logged norms against the unsharded model's, for runs that recorded them.

A run records with :func:`monitor_args`: the monitor with parameter norms and update ratios, and
``RecordMonitor`` (the logged metrics of every step; each rank's micro-batch of the reference step and the full
parameters before and after it). That is all a one-process reference needs, so the session's shared strategy
runs and the TP runs carry it and no strategy trains a run of its own for this check.

Example::

    train(tmp_path, "run", "fsdp", steps=3, extra=monitor_args(tmp_path / "run" / MONITOR_FOLDER, step=1, every=1))
    assert_norms_match_one_process(tmp_path / "run", step=1, clip=1.0, ranks=2)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_mlopt.callbacks.grad_norm_monitor import module_group
from lightning_mlopt.demos import GPTLanguageModel


def monitor(every: int | None = 1) -> tuple[str, ...]:
    """CLI arguments: GradNormMonitor logging every ``every`` steps (None: the Trainer's period), with parameter
    norms and update ratios."""
    return (
        "--trainer.callbacks+=lightning_mlopt.callbacks.GradNormMonitor",
        *([f"--trainer.callbacks.log_every_n_steps={every}"] if every is not None else []),
        "--trainer.callbacks.param_norms=true",
        "--trainer.callbacks.update_ratios=true",
    )


MONITOR = monitor()  # at every step
MONITOR_FOLDER = "monitor"  # beside the run's records


def monitor_args(out: Path, step: int, every: int | None) -> tuple[str, ...]:
    """CLI arguments: :func:`monitor`, recorded into ``out`` with the parameters around ``step``.

    ``step`` must be one the monitor logs (a multiple of its period): its norms are the ones compared.
    """
    return (
        *monitor(every),
        "--trainer.callbacks+=tests.support.recorders.RecordMonitor",
        f"--trainer.callbacks.out_dir={out}",
        f"--trainer.callbacks.reference_step={step}",
        "--trainer.callbacks.save_params=true",
    )


def _reference(monitor: Path, before: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    """The unsharded model's gradient norm for the global batch of the step, in one process."""
    model = GPTLanguageModel()
    model.load_state_dict(before)
    batches = [torch.load(path) for path in sorted(monitor.glob("batch-rank*.pt"))]
    # Equal per-rank batch sizes: the global mean loss is the mean of the per-rank mean losses.
    loss = torch.stack([model._loss((inputs, targets)) for inputs, targets in batches]).mean()
    loss.backward()
    total = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    groups: dict[str, float] = {}
    for name, param in model.named_parameters():
        group = module_group(name.removeprefix("model."), 2)
        groups[group] = groups.get(group, 0.0) + float(param.grad.double().pow(2).sum())
    return total, {group: math.sqrt(value) for group, value in groups.items()}


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(value.double().pow(2).sum()) for value in tensors.values()))


def assert_norms_match_one_process(out: Path, step: int, clip: float, ranks: int) -> None:
    """Every rank's norms at ``step`` (total, per group, clipped, parameters, update ratio) equal one process's.

    ``out``: the run's record folder, with the monitor's records in ``monitor/``.
    """
    monitor = out / MONITOR_FOLDER
    before = torch.load(monitor / f"params-before-step-{step}.pt")
    after = torch.load(monitor / f"params-after-step-{step}.pt")
    total, groups = _reference(monitor, before)
    for rank in range(ranks):
        logged = json.loads((monitor / f"monitor-rank{rank}.json").read_text())["metrics"][step - 1]
        assert logged["grad_norm/total"] == pytest.approx(total, rel=1e-5), f"rank {rank}"
        assert {"grad_norm/layers.0", "grad_norm/token_embedding", "grad_norm/lm_head"} <= set(logged)
        for group, value in groups.items():
            assert logged[f"grad_norm/{group}"] == pytest.approx(value, rel=1e-5), group
        assert logged["param_norm/total"] == pytest.approx(_norm(before), rel=1e-5)
        # The post-clip norm is what the update used.
        assert logged["grad_norm/total_clipped"] == pytest.approx(min(total, clip), rel=1e-5)
        # The update ratio is |theta_after - theta_before| / |theta_after|, from the full parameters.
        delta = _norm({name: after[name] - before[name] for name in before})
        assert logged["update_ratio/total"] == pytest.approx(delta / _norm(after), rel=1e-4)
        assert logged["update_ratio/layers.0"] > 0
