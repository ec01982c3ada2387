"""Pipeline parallelism through the real CLI on CPU (gloo), against one process.

- PP=2 on 2 processes (``configs/strategies/pp.yaml``, the GPT demo cut where ``model.layers.2`` begins) trains
  as one process does, with GPipe, 1F1B, and interleaved 1F1B (two stages per rank, four in all): the same loss
  at every step and the same final parameters, fp32, with gradient clipping active (so the global norm is
  summed over the stages), and each rank holds only its stages' parameters, under their whole-model names.
- The bubble is measured and logged (``pipeline/bubble``) next to the schedule's theoretical one.

The one-process reference is our DDP at one device: like the pipeline (whose data-parallel size is 1) it reads
the data through a one-replica DistributedSampler, so both see the same batches in the same order. The
micro-batches' losses are summed in another order than one batch's: tolerances as in test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SHARED_RUN_CLIP
from tests.support.strategy_runs import TrainedRun, train

STEPS = 6
PP = "--config", "configs/strategies/pp.yaml"


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainedRun]:
    root = tmp_path_factory.mktemp("pp_runs")
    interleaved = (
        "--trainer.strategy.init_args.schedule=interleaved_1f1b",
        "--trainer.strategy.init_args.split_points=[model.layers.1, model.layers.2, model.layers.3]",
    )
    return {
        "one": train(root, "one", "ddp", STEPS, devices=1, extra=(SHARED_RUN_CLIP,)),
        "1f1b": train(root, "1f1b", "pp", STEPS, extra=(SHARED_RUN_CLIP,)),
        "gpipe": train(
            root, "gpipe", "pp", STEPS, extra=(SHARED_RUN_CLIP, "--trainer.strategy.init_args.schedule=gpipe")
        ),
        "interleaved": train(root, "interleaved", "pp", STEPS, extra=(SHARED_RUN_CLIP, *interleaved)),
    }


def _assert_same_training(run: TrainedRun, reference: TrainedRun) -> None:
    expected = torch.tensor(reference.records[0]["losses"])
    for record in run.records:  # every rank returns the pipeline's loss
        torch.testing.assert_close(torch.tensor(record["losses"]), expected, rtol=1e-5, atol=0)
    assert run.params.keys() == reference.params.keys()
    for name, value in reference.params.items():
        torch.testing.assert_close(run.params[name], value, rtol=0, atol=1e-5, msg=name)
    losses = reference.records[0]["losses"]
    assert losses[-1] < losses[0], "the reference trained: agreeing on doing nothing proves nothing"


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_pp2_trains_the_one_process_model(pp_runs, schedule):
    _assert_same_training(pp_runs[schedule], pp_runs["one"])
