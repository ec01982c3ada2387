"""Pipeline parallelism through the real CLI on CPU (gloo), against one process.

- PP=2 on 2 processes (``configs/strategies/pp.yaml``, the GPT demo cut where ``model.layers.2`` begins) trains
  as one process does, with GPipe, 1F1B, and interleaved 1F1B (two stages per rank, four in all): the same loss
  at every step and the same final parameters, fp32, with gradient clipping active (so the global norm is
  summed over the stages), and each rank holds only its stages' parameters, under their whole-model names.
- Checkpoints (killed with SIGKILL and resumed bitwise: tests/callbacks/test_fault_tolerant_checkpoint.py): a PP
  checkpoint resumes in one process (DDP, through a conversion: the stages' flattened optimizer
  states gathered by name) and trains on as the one-process run does, moments included; ``checkpoint
  consolidate`` gives the run's full tensors.

The one-process reference is our DDP at one device: like the pipeline (whose data-parallel size is 1) it reads
the data through a one-replica DistributedSampler, so both see the same batches in the same order. The
micro-batches' losses are summed in another order than one batch's: tolerances as in test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_mlopt.checkpoint import STATE_NAME, CheckpointStore
from lightning_mlopt.strategies.full_checkpoint import consolidate_dcp
from tests.conftest import SHARED_RUN_CLIP, run_tool_here
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
        "one": train(root, "one", "ddp", STEPS + 2, devices=1, extra=(SHARED_RUN_CLIP,)),
        "1f1b": train(root, "1f1b", "pp", STEPS, extra=(SHARED_RUN_CLIP, "--checkpoint.every_n_steps=3")),
        "gpipe": train(
            root, "gpipe", "pp", STEPS, extra=(SHARED_RUN_CLIP, "--trainer.strategy.init_args.schedule=gpipe")
        ),
        "interleaved": train(root, "interleaved", "pp", STEPS, extra=(SHARED_RUN_CLIP, *interleaved)),
    }


def _assert_same_losses(run: TrainedRun, reference: TrainedRun, steps: slice) -> None:
    expected = torch.tensor(reference.records[0]["losses"][steps])
    for record in run.records:  # every rank returns the pipeline's loss
        torch.testing.assert_close(torch.tensor(record["losses"]), expected, rtol=1e-5, atol=0)
    losses = reference.records[0]["losses"]
    assert losses[-1] < losses[0], "the reference trained: agreeing on doing nothing proves nothing"


def _assert_same_parameters(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert params.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_pp2_trains_the_one_process_model(pp_runs, schedule):
    run = pp_runs[schedule]
    _assert_same_losses(run, pp_runs["one"], slice(0, STEPS))
    start = torch.load(run.run_dir.parents[1] / schedule / "start_params.pt")["params"]
    one_start = torch.load(pp_runs["one"].run_dir.parents[1] / "one" / "start_params.pt")["params"]
    _assert_same_parameters(start, one_start)
    assert not any(torch.equal(run.params[name], one_start[name]) for name in one_start), "every parameter trained"


@pytest.mark.multiprocess
def test_a_pp_checkpoint_trains_on_in_one_process_as_the_one_process_run(tmp_path, pp_runs):
    # Step 3's, mid-epoch (a final checkpoint marks its epoch done: a relaunch from it starts the next one).
    saved = dict(CheckpointStore(pp_runs["1f1b"].run_dir / "checkpoints").committed())[3]
    run = train(tmp_path, "ddp1", "ddp", STEPS + 2, devices=1, extra=(SHARED_RUN_CLIP, f"--ckpt_path={saved}"))
    assert "converted" in (tmp_path / "ddp1" / "output.txt").read_text()
    _assert_same_losses(run, pp_runs["one"], slice(3, STEPS + 2))  # AdamW's moments came back too
    _assert_same_parameters(run.params, pp_runs["one"].params)


@pytest.mark.multiprocess
def test_a_pp_checkpoint_consolidates_to_the_full_tensors_and_named_moments(tmp_path, monkeypatch, pp_runs):
    run = pp_runs["1f1b"]
    checkpoints = str(run.run_dir / "checkpoints")
    result = run_tool_here(
        "checkpoint", ["consolidate", checkpoints, str(tmp_path / "one.ckpt")], tmp_path, monkeypatch
    )
    assert result.returncode == 0, result.stderr
    full = torch.load(tmp_path / "one.ckpt", weights_only=False)
    for name, value in run.params.items():
        assert torch.equal(full["state_dict"][name], value), name
    # What conversions read: every stage's flattened moments, one named state with the run's two groups.
    saved = CheckpointStore(run.run_dir / "checkpoints").newest_valid()
    assert saved is not None
    (optimizer,) = consolidate_dcp(saved.path / STATE_NAME)["optimizer_states"]
    assert set(optimizer["state"]) == set(run.params), "every stage's moments, by parameter name"
    assert sorted(len(group["params"]) for group in optimizer["param_groups"]) == [19, 34]  # decayed, not
