"""Pipeline parallelism through the real CLI on CPU (gloo), against one process.

- PP=2 on 2 processes (``configs/strategies/pp.yaml``, the GPT demo cut where ``model.layers.2`` begins) trains
  as one process does, with GPipe, 1F1B, and interleaved 1F1B (two stages per rank, four in all): the same loss
  at every step and the same final parameters, fp32, with gradient clipping active (so the global norm is
  summed over the stages), and each rank holds only its stages' parameters, under their whole-model names.
- Validation runs the schedule forward only: the same ``val/loss`` as one process.
- The bubble is measured by PerformanceMonitor, per rank, beside the schedule's theoretical one.
- A split, a size or a model that does not fit is refused before launch: exit 2, one line naming the fix.
- Checkpoints (killed with SIGKILL and resumed bitwise: tests/callbacks/test_fault_tolerant_checkpoint.py): a PP
  checkpoint resumes in one process (DDP, through a conversion: the stages' flattened optimizer
  states gathered by name) and trains on as the one-process run does, moments included; ``checkpoint
  consolidate`` gives the run's full tensors.

The one-process reference is our DDP at one device: like the pipeline (whose data-parallel size is 1) it reads
the data through a one-replica DistributedSampler, so both see the same batches in the same order. The
micro-batches' losses are summed in another order than one batch's: tolerances as in test_tensor_parallel.py.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint import STATE_NAME, CheckpointStore
from lightning_mlopt.cli import main
from lightning_mlopt.strategies.full_checkpoint import consolidate_dcp
from tests.conftest import CONFIGS, SHARED_RUN_CLIP, failure_report, run_cli, run_tool_here
from tests.support.cli_args import fit_args
from tests.support.llama_style import write_llama_config
from tests.support.strategy_runs import TrainedRun, train

STEPS = 6
CHECKPOINTED = ("--checkpoint.every_n_steps=3",)
TP2 = "--trainer.strategy.init_args.tensor_parallel_size=2"
# tp_sp.yaml's plan (sequence parallelism: the norms on half the sequence each, their gradients partial sums made
# whole), but with an LM head whose logits are gathered (a pipeline's last stage hands pipeline_loss whole logits).
SP_PLAN = {
    "model.token_embedding": "embedding_rowwise_sequence",
    "model.position_embedding": "embedding_rowwise_sequence",
    "model.layers.*.ln1": "sequence_parallel",
    "model.layers.*.attn": "gather_sequence",
    "model.layers.*.attn.qkv": "colwise",
    "model.layers.*.attn.proj": "rowwise_sequence",
    "model.layers.*.ln2": "sequence_parallel",
    "model.layers.*.mlp": "gather_sequence",
    "model.layers.*.mlp.0": "colwise",
    "model.layers.*.mlp.2": "rowwise_sequence",
    "model.ln_f": "sequence_parallel",
    "model.lm_head": "colwise_replicated_from_sequence",
}
TP2_SP = (TP2, f"--trainer.strategy.init_args.tp_plan={json.dumps(SP_PLAN)}")


# GradNormMonitor every step, into a CSV log: its global and per-module norms, summed over the stages.
GRAD_NORMS = (
    *("--config", str(CONFIGS / "trackers" / "csv.yaml")),
    *("--trainer.callbacks+=lightning_mlopt.callbacks.GradNormMonitor", "--trainer.callbacks.log_every_n_steps=1"),
)


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainedRun]:
    root = tmp_path_factory.mktemp("pp_runs")
    interleaved = (
        "--trainer.strategy.init_args.schedule=interleaved_1f1b",
        "--trainer.strategy.init_args.split_points=[model.layers.1, model.layers.2, model.layers.3]",
    )
    validate = ("--trainer.val_check_interval=3", "--trainer.limit_val_batches=2")
    return {
        "one": train(root, "one", "ddp", STEPS + 2, devices=1, extra=(SHARED_RUN_CLIP, *validate, *GRAD_NORMS)),
        "1f1b": train(root, "1f1b", "pp", STEPS, extra=(SHARED_RUN_CLIP, *CHECKPOINTED, *validate)),
        "gpipe": train(
            root, "gpipe", "pp", STEPS, extra=(SHARED_RUN_CLIP, "--trainer.strategy.init_args.schedule=gpipe")
        ),
        "interleaved": train(root, "interleaved", "pp", STEPS, extra=(SHARED_RUN_CLIP, *interleaved)),
        # Pipeline x tensor parallel on 4 processes, each stage split over 2 ranks with sequence parallelism (the
        # demo's own plan runs in the 3D test and in the eval-mode test).
        "tp": train(
            root, "tp", "pp", STEPS, devices=4, extra=(SHARED_RUN_CLIP, *CHECKPOINTED, *validate, *TP2_SP, *GRAD_NORMS)
        ),
    }


def _assert_same_losses(run: TrainedRun, reference: TrainedRun, steps: slice) -> None:
    expected = torch.tensor(reference.records[0]["losses"][steps])
    for record in run.records:  # every rank returns the pipeline's loss
        torch.testing.assert_close(torch.tensor(record["losses"]), expected, rtol=1e-5, atol=0)
    losses = reference.records[0]["losses"]
    assert losses[-1] < losses[0], "the reference trained: agreeing on doing nothing proves nothing"


def _assert_same_gradient_norms(run: TrainedRun, reference: TrainedRun, steps: int) -> None:
    def norms(run: TrainedRun) -> list[dict[str, float]]:
        (log,) = (run.run_dir / "csv").glob("version_*/metrics.csv")
        rows = list(csv.DictReader(log.read_text().splitlines()))
        return [{k: float(v) for k, v in row.items() if k.startswith("grad_norm/") and v} for row in rows]

    expected = [row for row in norms(reference) if row][:steps]
    assert len(expected) == steps and "grad_norm/total" in expected[0] and len(expected[0]) > 2, expected
    actual = [row for row in norms(run) if row]
    assert [row.keys() for row in actual] == [row.keys() for row in expected]
    for got, want in zip(actual, expected, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4), key


def _assert_same_parameters(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert params.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "tp"])
def test_pp2_trains_the_one_process_model(pp_runs, schedule):
    run = pp_runs[schedule]
    _assert_same_losses(run, pp_runs["one"], slice(0, STEPS))
    start = torch.load(run.run_dir.parents[1] / schedule / "start_params.pt")["params"]
    one_start = torch.load(pp_runs["one"].run_dir.parents[1] / "one" / "start_params.pt")["params"]
    _assert_same_parameters(start, one_start)
    assert not any(torch.equal(run.params[name], one_start[name]) for name in one_start), "every parameter trained"
    if schedule == "tp":  # each block's 8 planned modules, and the embeddings or the final norm and head
        output = (run.run_dir.parents[1] / schedule / "output.txt").read_text()
        assert "[rank 0] pipeline stage(s) 0 of 2: 437,504 parameters, 18 modules split 2 ways" in output, output
        assert "[rank 3] pipeline stage(s) 1 of 2: 429,568 parameters, 18 modules split 2 ways" in output, output
        # The sequence-parallel norms' gradients come out as partial sums on each tensor rank: made whole.
        _assert_same_gradient_norms(run, pp_runs["one"], STEPS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["1f1b", "tp"])
def test_a_pp_checkpoint_trains_on_in_one_process_as_the_one_process_run(tmp_path, pp_runs, layout):
    # Step 3's, mid-epoch (a final checkpoint marks its epoch done: a relaunch from it starts the next one).
    saved = dict(CheckpointStore(pp_runs[layout].run_dir / "checkpoints").committed())[3]
    run = train(tmp_path, "ddp1", "ddp", STEPS + 2, devices=1, extra=(SHARED_RUN_CLIP, f"--ckpt_path={saved}"))
    assert "converted" in (tmp_path / "ddp1" / "output.txt").read_text()
    _assert_same_losses(run, pp_runs["one"], slice(3, STEPS + 2))  # AdamW's moments came back too
    _assert_same_parameters(run.params, pp_runs["one"].params)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["1f1b", "tp"])
def test_a_pp_checkpoint_consolidates_to_the_full_tensors_and_named_moments(tmp_path, monkeypatch, pp_runs, layout):
    run = pp_runs[layout]
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


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["1f1b", "tp"])
def test_validation_under_pp_gives_the_one_process_loss(pp_runs, layout):
    def final_val_loss(run: TrainedRun) -> float:
        return json.loads((run.run_dir / "metrics.json").read_text())["metrics"]["val/loss"]

    assert final_val_loss(pp_runs[layout]) == pytest.approx(final_val_loss(pp_runs["one"]), rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("schedule", "theory"), [("1f1b", 1 / 9), ("interleaved", 1 / 17)])
def test_performance_monitor_reports_each_ranks_bubble_beside_the_schedules_theory(pp_runs, schedule, theory):
    summary = json.loads((pp_runs[schedule].run_dir / "perf" / "summary.json").read_text())
    metrics = summary["metrics"]
    assert metrics["perf/pipeline_bubble_theory"] == pytest.approx(theory)  # (p - 1) / (v m + p - 1), m = 8
    bubbles = [rank["pipeline_idle"] / rank["pipeline_steps"] for rank in summary["ranks"]]
    assert all(0 < bubble < 1 for bubble in bubbles), bubbles
    assert metrics["perf/pipeline_bubble"] == pytest.approx(sum(bubbles) / 2)
    assert metrics["perf/pipeline_bubble_max"] == pytest.approx(max(bubbles))
    output = (pp_runs[schedule].run_dir.parents[1] / schedule / "output.txt").read_text()
    if "PerformanceMonitor: pipeline bubble: ranks idle" in output:  # a window over 20% (gloo's p2p is slow)
        assert f"{theory:.0%} in theory for {'interleaved_1f1b' if schedule == 'interleaved' else schedule}" in output


def _refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> str:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "gpt.yaml"), "--config", str(CONFIGS / "strategies" / "pp.yaml"),
              "--trainer.accelerator=cpu", "--trainer.devices=2", *args])  # fmt: skip
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("error: trainer.strategy: ") and len(message.strip().splitlines()) == 1, message
    assert not list(tmp_path.iterdir()), "nothing written"
    return message


INTERLEAVED = "--trainer.strategy.init_args.schedule=interleaved_1f1b"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--trainer.strategy.init_args.split_points=[model.layer.2]"],
            "split_points: 'model.layer.2' is not a module of GPTLanguageModel; did you mean model.layers.2",
        ),
        (
            [INTERLEAVED, "--trainer.strategy.init_args.split_points=[model.layers.1, model.layers.3, model.layers.2]"],
            "split_points: 'model.layers.2' comes before 'model.layers.3' in the model; list them in forward order",
        ),
        (
            ["--trainer.strategy.init_args.split_points=[model.layers.2, model.layers.3]"],
            "split_points: 2 stages need 1 split point(s)",
        ),
        (
            ["--trainer.strategy.init_args.split_points=[model.layers]"],
            "split_points: 'model.layers' holds no module of its own: name a module the forward calls",
        ),
        (["--trainer.strategy.init_args.microbatches=1"], "microbatches=1: 1f1b needs at least one per stage (2)"),
        (["--trainer.strategy.init_args.microbatches=6"], "microbatches=6 must divide the batch size (16)"),
        (
            ["--trainer.strategy.init_args.pipeline_parallel_size=3"],
            "pipeline_parallel_size=3 must divide the world size (2",
        ),
        (["--model=tests.support.llama_style.LlamaStyleLM"], "LlamaStyleLM has no pipeline_loss(output, target)"),
        ([TP2], "pipeline_parallel_size=2 x tensor_parallel_size=2 must divide the world size (2"),
        (
            ["--trainer.devices=4", TP2, "--trainer.strategy.init_args.tp_plan={model.lm_head: loss_parallel}"],
            "tp_plan: model.lm_head is loss_parallel, whose split logits a pipeline's last stage cannot hand to",
        ),
        (
            ["--trainer.devices=4", TP2, "--trainer.strategy.init_args.tp_plan={model.layers.*.ln1: colwise}"],
            "tp_plan: model.layers.0.ln1 (LayerNorm) cannot be colwise: that style splits an nn.Linear",
        ),
    ],
    ids=["unknown", "order", "count", "container", "1f1b", "divide", "world", "no-loss", "tp-world", "tp-loss", "tp"],
)
def test_a_split_or_size_that_does_not_fit_is_refused_before_launch(tmp_path, monkeypatch, capsys, args, expected):
    assert expected in _refused(tmp_path, monkeypatch, capsys, *args)


@pytest.mark.multiprocess
def test_a_llama_shaped_model_trains_under_pp2_as_in_one_process(tmp_path):
    """Hugging Face's module names and shapes (grouped-query attention, SwiGLU, RMSNorm, the head outside
    ``model``), cut at ``model.layers.1``: the model adds ``pipeline_loss`` and nothing else."""
    llama = (
        *("--config", write_llama_config(tmp_path, "tests.support.llama_style.PipelinedLlamaStyleLM")),
        *GRAD_NORMS,
    )
    pp = train(tmp_path, "pp", "pp", 4, extra=(*llama, "--trainer.strategy.init_args.split_points=[model.layers.1]"))
    one = train(tmp_path, "one", "ddp", 4, devices=1, extra=llama)
    _assert_same_losses(pp, one, slice(0, 4))
    _assert_same_parameters(pp.params, one.params)

    _assert_same_gradient_norms(pp, one, 4)  # GradNormMonitor's, summed over the stages


@pytest.mark.multiprocess
def test_pp_x_dp_2x2_trains_the_ddp_model(tmp_path, strategy_runs):
    """4 processes: two pipelines of two stages, each stage sharded by FSDP over its two data ranks; the same
    global batch of 2 x 16 as DDP on 2 processes, in the same order (the session's shared DDP run)."""
    # Validation every 3 steps too: the stages' FSDP parameters gathered under inference mode, then trained on.
    validate = ("--trainer.val_check_interval=3", "--trainer.limit_val_batches=2")
    run = train(tmp_path, "pp_dp", "pp", STEPS, devices=4, extra=(SHARED_RUN_CLIP, *validate))
    ddp = strategy_runs["ddp"]
    for rank, record in enumerate(run.records):  # rank = pipeline rank x 2 + data rank: its replica's loss
        expected = torch.tensor(ddp.records[rank % 2]["losses"][:STEPS])
        torch.testing.assert_close(torch.tensor(record["losses"]), expected, rtol=1e-5, atol=0)
    assert run.params.keys() == ddp.params.keys()
    assert "pipeline stage(s) 1 of 2" in (tmp_path / "pp_dp" / "output.txt").read_text()
    assert "val/loss" in json.loads((run.run_dir / "metrics.json").read_text())["metrics"]


@pytest.mark.multiprocess
def test_validation_under_pp_runs_the_model_in_eval_mode(tmp_path, pp_runs):
    """With dropout 0.5, validate gives one process's loss: the stages traced in eval mode run (dropout off), under
    PP and under PP x TP."""
    saved = CheckpointStore(pp_runs["1f1b"].run_dir / "checkpoints").newest_valid()
    assert saved is not None

    def val_loss(strategy: str, devices: int, *extra: str) -> float:
        args = ("--model.init_args.dropout=0.5", f"--ckpt_path={saved.path}", "--trainer.limit_val_batches=2", *extra)
        run_dir = tmp_path / f"{strategy}{devices}"
        result = run_cli(
            fit_args(*args, strategy=strategy, devices=devices, run_dir=run_dir, subcommand="validate"),
            cwd=tmp_path,
            preloaded=True,
        )
        assert result.returncode == 0, failure_report(result)
        # Lightning draws the table with rich where rich is installed (transformers brings it): "│" between cells.
        found = re.search(r"val/loss[\s│]+([0-9.]+)", result.stdout + result.stderr)
        assert found is not None, (result.stdout + result.stderr)[-2000:]
        return float(found[1])

    expected = val_loss("ddp", 1)
    assert val_loss("pp", 2) == pytest.approx(expected, rel=1e-5)
    # PP x TP: torch.fx's stages traced again in eval mode, calling the same tensor-parallel modules.
    assert val_loss("pp", 4, TP2) == pytest.approx(expected, rel=1e-5)


@pytest.mark.multiprocess
def test_3d_pp_x_fsdp_x_tp_on_8_processes_trains_the_ddp_model(tmp_path, strategy_runs):
    """2 x 2 x 2: two pipelines of two stages, each stage split over 2 tensor ranks and sharded by FSDP over 2
    data ranks; the same global batch of 2 x 16 as DDP on 2 processes, in the same order (the shared DDP run)."""
    steps = 3  # 8 processes on this machine's 2 cores: the fewest steps that show two updates
    # ReplicaConsistencyCheck at every step: a stage's 4 ranks (2 data x 2 tensor) compare what they hold alike,
    # each FSDP shard among the ranks that hold it, and find nothing to report in a clean run.
    check = (
        "--trainer.callbacks+=lightning_mlopt.callbacks.ReplicaConsistencyCheck",
        "--trainer.callbacks.every_n_steps=1",
    )
    run = train(tmp_path, "3d", "pp", steps, devices=8, extra=(SHARED_RUN_CLIP, TP2, *check))
    ddp = strategy_runs["ddp"]
    for rank, record in enumerate(run.records):  # rank = (pipeline x 2 + data) x 2 + tensor
        expected = torch.tensor(ddp.records[rank // 2 % 2]["losses"][:steps])
        torch.testing.assert_close(torch.tensor(record["losses"]), expected, rtol=1e-5, atol=0)
    assert run.params.keys() == ddp.params.keys()
    output = (tmp_path / "3d" / "output.txt").read_text()
    assert "[rank 4] pipeline stage(s) 1 of 2: 429,568 parameters, 9 modules split 2 ways" in output
    compared = "ReplicaConsistencyCheck: every 1 steps, 8 ranks compare within each pipeline stage, among its ranks "
    assert compared + "(stage 0: 13 parameter shards, each across its replicas; and buffers: 13 tensors)" in output
    assert "replica mismatch" not in output
