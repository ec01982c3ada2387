"""A callback that writes the optimizer's full state, per parameter name, as each strategy itself gathers it.

Each strategy's own gathering, not the package's conversion code: DeepSpeed's ``safe_get_full_optimizer_state``,
torch's ``get_optimizer_state_dict(full_state_dict=True)`` for DTensor modules, the optimizer's own
``state_dict`` elsewhere. A resumed run writes it at train start (after the restore); a source run at the end of
step ``at_step`` (what its checkpoint of that step holds). A test compares the two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

KEYS = ("exp_avg", "exp_avg_sq")


class DumpOptimizerState(pl.Callback):
    """Writes ``<out_dir>/optimizer-step<N>.pt``: {parameter name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}}.

    Args:
        out_dir: where to write (rank zero writes; every rank takes part in the gathering).
        at_step: the step whose state is written, at its end or, resumed at it, at train start.
    """

    def __init__(self, out_dir: str, at_step: int) -> None:
        self.out_dir = Path(out_dir)
        self.at_step = at_step

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.at_step:
            self._dump(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step == self.at_step:
            self._dump(trainer, pl_module)

    def _dump(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = _full_state(trainer, pl_module)
        if trainer.global_rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(state, self.out_dir / f"optimizer-step{self.at_step}.pt")


def _full_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict[str, Any]]:
    strategy = trainer.strategy
    if hasattr(strategy, "deepspeed_engine"):
        from deepspeed.utils import safe_get_full_optimizer_state

        from lightning_mlopt._compat import link_zero_optimizer_state

        # DeepSpeed 0.19 links ZeRO-1/2's per-parameter views of the optimizer state after the first group's
        # first step, before the other groups have state: a second group's views stay empty. Link them again.
        link_zero_optimizer_state(strategy.deepspeed_engine)  # type: ignore[attr-defined]
        return {
            name: {key: safe_get_full_optimizer_state(param, key).detach().cpu().clone() for key in KEYS}
            for name, param in pl_module.named_parameters()
        }
    optimizer = trainer.optimizers[0]
    if any(type(p).__name__ == "DTensor" for p in pl_module.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(pl_module, optimizer, options=StateDictOptions(full_state_dict=True))
        return {name: {k: v.detach().cpu().clone() for k, v in value.items()} for name, value in full["state"].items()}
    names = {id(param): name for name, param in pl_module.named_parameters()}  # the live state, by parameter object
    return {
        names[id(param)]: {k: v.detach().cpu().clone() for k, v in optimizer.state[param].items()}
        for group in optimizer.param_groups
        for param in group["params"]
    }
