"""Tensor parallelism through the real CLI on CPU (gloo), against runs without it.

- TP=2 on 2 processes (``configs/strategies/tp.yaml``) trains the GPT demo as one process does: the same
  losses and final parameters, fp32, with gradient clipping active (so the global norm over DTensor shards
  and replicated parameters is the one-process norm), and each rank holds its split of the planned matrices.
- FSDP x TP, 2 x 2 on 4 processes (``fsdp_tp.yaml``), trains as DDP on 2 processes does (the session's
  shared run: the same global batch of 2 x 16, the same data order); NCCLHealthCheck's pre-flight checks
  both mesh dimensions. With ``replicate_size: 2`` (HSDP x TP, FSDP's keys taken whole) it does too.
- ``tp_sp.yaml`` (with sequence parallelism: norms on half the sequence each) trains as one process does.
- ``tp_hf.yaml``, written for Hugging Face's module names, trains a Llama-shaped model (grouped-query
  attention, SwiGLU, RMSNorm) at TP=2 as one process does.
- A TP=2 checkpoint resumes under FSDP on 2 processes, and that one on one process (DCP reshards each time:
  the tensor split, then the data split, undone), with every parameter restored exactly; ``checkpoint
  consolidate`` and ``export`` turn it into full tensors equal to the run's.
- PerformanceMonitor counts a tensor-parallel group's batch once and each rank's own FLOPs.

The one-process reference is our DDP at one device: like the TP run (whose data-parallel size is 1) it reads
the data through a one-replica DistributedSampler, so both see the same batches in the same order.
Tolerances as in test_strategy_equivalence.py: the all-reduces sum partial products in another order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lightning_mlopt.checkpoint import STATE_NAME, CheckpointStore
from lightning_mlopt.demos import GPTLanguageModel
from lightning_mlopt.planning.memory import plan_memory
from lightning_mlopt.planning.probe import instantiate, measure_activations
from lightning_mlopt.strategies.tensor.tp_plan import resolve
from tests.conftest import CONFIGS, SHARED_RUN_CLIP, SHARED_RUN_CLIP_VALUE, SHARED_RUN_STEPS, run_tool_here
from tests.support.grad_norms import MONITOR_FOLDER, assert_norms_match_one_process, monitor_args
from tests.support.llama_style import LlamaStyleLM, write_llama_config
from tests.support.strategy_runs import TrainedRun, assert_same_training, train

STEPS = 8


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainedRun]:
    root = tmp_path_factory.mktemp("tp_runs")
    perf = "--trainer.callbacks+=lightning_mlopt.callbacks.PerformanceMonitor"
    return {  # the TP runs log GradNormMonitor too (test_grad_norms_under_tp_equal_the_unsharded_reference)
        "tp": train(root, "tp", "tp", STEPS, devices=2, extra=(SHARED_RUN_CLIP, perf, *_monitor(root / "tp"))),
        "tp_sp": train(root, "tp_sp", "tp_sp", STEPS, devices=2, extra=(SHARED_RUN_CLIP, *_monitor(root / "tp_sp"))),
        "one": train(root, "one", "ddp", STEPS, devices=1, extra=(SHARED_RUN_CLIP, perf)),
    }


def _monitor(out: Path) -> tuple[str, ...]:
    return monitor_args(out / MONITOR_FOLDER, step=1, every=1)


def _strategy_class_path(run: TrainedRun) -> str:
    return yaml.safe_load((run.run_dir / "config.yaml").read_text())["trainer"]["strategy"]["class_path"]


@pytest.mark.multiprocess
def test_tp2_trains_the_one_process_model(gpt_runs):
    # Both ranks of the tensor-parallel group computed the same loss from the same batch.
    assert_same_training(gpt_runs["tp"], gpt_runs["one"], {0: 0, 1: 0})
    assert _strategy_class_path(gpt_runs["tp"]) == "lightning_mlopt.strategies.TensorParallelStrategy"


@pytest.mark.multiprocess
def test_tp2_with_sequence_parallelism_trains_the_one_process_model(gpt_runs):
    # The norms see half the sequence each and their gradients come back as partial sums: made whole before
    # clipping (active here) and the optimizer read them.
    assert_same_training(gpt_runs["tp_sp"], gpt_runs["one"], {0: 0, 1: 0})


@pytest.mark.multiprocess
def test_tp2_with_compiled_blocks_trains_the_one_process_model(tmp_path, gpt_runs):
    # torch.compile (configs/features/compile.yaml) after the plan split the blocks: dynamo traces their DTensors.
    compiled = ("--config", str(CONFIGS / "features" / "compile.yaml"), "--compile.backend=aot_eager")
    run = train(tmp_path, "tp_compiled", "tp", STEPS, devices=2, extra=(SHARED_RUN_CLIP, *compiled))
    assert_same_training(run, gpt_runs["one"], {0: 0, 1: 0})
    assert "torch.compile (aot_eager): 4 block region(s)" in (tmp_path / "tp_compiled" / "output.txt").read_text()


# The norm over DTensor pieces split across the tensor dimension and the replicated ones counted once (both ranks
# read the same batch, so the reference's mean of the two batches' losses is that batch's loss).
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp", "tp_sp"])
def test_grad_norms_under_tp_equal_the_unsharded_reference(gpt_runs, layout):
    out = gpt_runs[layout].run_dir.parents[1] / layout
    assert_norms_match_one_process(out, step=1, clip=SHARED_RUN_CLIP_VALUE, ranks=2)


@pytest.mark.multiprocess
def test_tp2_ranks_hold_their_split_of_the_planned_matrices(gpt_runs):
    # The bytes each rank holds, worked out from the plan: split weights (and column-wise biases) halved,
    # row-wise biases, norms and the position embedding whole.
    model = GPTLanguageModel(**yaml.safe_load((CONFIGS / "gpt.yaml").read_text())["model"]["init_args"])
    plan_of = resolve(model, GPTLanguageModel.tp_plan, 2)
    plan = plan_of.styles
    expected = 0
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        split = owner in plan and (kind == "weight" or plan[owner].startswith("colwise"))
        expected += param.numel() * 4 // (2 if split else 1)
    for record in gpt_runs["tp"].records:
        assert record["state_bytes"]["parameters"] == expected
        assert record["state_bytes"]["optimizer_state"] == pytest.approx(2 * expected, rel=0.01)
    whole = gpt_runs["one"].records[0]["state_bytes"]["parameters"]
    assert 0.5 < expected / whole < 0.6
    # The planner's TP row says the same (fp32: 4 bytes a parameter).
    total = sum(p.numel() for p in model.parameters())
    row = plan_memory(total, 2, 10**9, precision="fp32", tensor_parallel=(2, plan_of.split_elements(model))).rows[-1]
    assert (row.strategy, row.parameters) == ("tp2", expected)


@pytest.mark.multiprocess
def test_the_planners_activations_are_what_each_rank_saved_for_backward(gpt_runs):
    # The planner splits a meta model by the plan on a fake world of 2 ranks and counts what its forward saves
    # for backward; each rank of the real runs counted the same at its first step (RecordEverything).
    config = yaml.safe_load((CONFIGS / "gpt.yaml").read_text())
    for name, overlay in (("one", None), ("tp", "tp.yaml"), ("tp_sp", "tp_sp.yaml")):
        with torch.device("meta"):
            model = instantiate(config["model"])
        split = resolve(model, _overlay_plan(overlay), 2).split_on_fake_world(model) if overlay else None
        planned = measure_activations(model, instantiate(config["data"]), around=split)
        assert [record["activation_bytes"] for record in gpt_runs[name].records] == [planned] * len(
            gpt_runs[name].records
        ), name
    one, tp, sp = (gpt_runs[name].records[0]["activation_bytes"] for name in ("one", "tp", "tp_sp"))
    # The heads and the MLP's hidden width are split; with SP the norms' sequence and the logits too.
    assert sp < tp < 0.7 * one


def _overlay_plan(overlay: str) -> dict[str, str]:
    return yaml.safe_load((CONFIGS / "strategies" / overlay).read_text())["trainer"]["strategy"]["init_args"]["tp_plan"]


@pytest.mark.multiprocess
def test_performance_monitor_counts_a_tp_groups_batch_once_and_each_ranks_own_flops(gpt_runs):
    # The tensor-parallel pair computed on one batch per step: together they trained on as many samples as the
    # one process did, and did its FLOPs, each half of them (every matmul of the demo's plan is split).
    def summary(run: TrainedRun) -> dict:
        return json.loads((run.run_dir / "perf" / "summary.json").read_text())

    one, tp = summary(gpt_runs["one"]), summary(gpt_runs["tp"])
    (alone,) = one["ranks"]
    assert [rank["samples"] for rank in tp["ranks"]] == [alone["samples"] / 2] * 2
    assert [rank["flops"] for rank in tp["ranks"]] == [alone["flops"] / 2] * 2
    assert tp["flops_per_sample"] == one["flops_per_sample"] / 2  # what each rank does per sample


HEALTH = "--trainer.callbacks+=lightning_mlopt.callbacks.NCCLHealthCheck"
HSDP = "--trainer.strategy.init_args.replicate_size=2"  # FSDP's keys reach TP whole: HSDP x TP


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "knob", "said", "parameter_share"),
    [
        # The pre-flight checks each mesh dimension's groups, not only the world; every parameter is sharded
        # over the data dimension, the planned ones over the tensor one too.
        ("fsdp_tp", HEALTH, "all-reduce per mesh dimension ok: shard (2), tensor (2)", (0.0, 0.3)),
        # replicate 2 x shard 1 x tensor 2: each replica holds whole copies of its tensor split (half a model).
        ("hsdp_tp", HSDP, "hybrid sharding (HSDP): 2 replicas x 1 shards (replicate 2 x tensor 2)", (0.45, 0.7)),
    ],
)
def test_fsdp_and_hsdp_x_tp_2x2_train_the_ddp_model(tmp_path, strategy_runs, name, knob, said, parameter_share):
    run = train(tmp_path, name, "fsdp_tp", SHARED_RUN_STEPS, devices=4, extra=(SHARED_RUN_CLIP, knob))
    assert said in (tmp_path / name / "output.txt").read_text()
    # Ranks 0 and 1 are data-parallel rank 0 (one tensor-parallel pair), ranks 2 and 3 data-parallel rank 1.
    assert_same_training(run, strategy_runs["ddp"], {0: 0, 1: 0, 2: 1, 3: 1})
    held = run.records[0]["state_bytes"]["parameters"] / strategy_runs["ddp"].records[0]["state_bytes"]["parameters"]
    assert parameter_share[0] < held < parameter_share[1]


def _resume(tmp_path: Path, name: str, first: TrainedRun, strategy: str, devices: int, steps: int) -> TrainedRun:
    """Train on from ``first``'s newest checkpoint to ``steps``; assert every parameter came back exactly."""
    saved = CheckpointStore(first.run_dir / "checkpoints").newest_valid()
    assert saved is not None
    run = train(tmp_path, name, strategy, steps, devices, extra=(f"--ckpt_path={saved.path / STATE_NAME}",))
    start = torch.load(tmp_path / name / "start_params.pt")
    assert start["step"] == saved.step
    assert start["params"].keys() == first.params.keys()
    for param, value in first.params.items():
        assert torch.equal(start["params"][param], value), f"{param} was not restored exactly"
    assert [len(record["losses"]) for record in run.records] == [steps - saved.step] * devices
    return run


@pytest.mark.multiprocess
def test_a_tp_checkpoint_resumes_under_fsdp_and_then_on_one_process(tmp_path, gpt_runs):
    on_fsdp = _resume(tmp_path, "fsdp2", gpt_runs["tp"], "fsdp", devices=2, steps=STEPS + 2)
    _resume(tmp_path, "fsdp1", on_fsdp, "fsdp", devices=1, steps=STEPS + 3)


@pytest.mark.multiprocess
def test_checkpoint_consolidate_and_export_give_the_full_tensors_of_a_tp_run(tmp_path, monkeypatch, gpt_runs):
    from safetensors.torch import load_file

    run = gpt_runs["tp"]  # read only: its final checkpoint holds the parameters it recorded at the end
    checkpoints = str(run.run_dir / "checkpoints")
    consolidated = run_tool_here(
        "checkpoint", ["consolidate", checkpoints, str(tmp_path / "one.ckpt")], tmp_path, monkeypatch
    )
    assert consolidated.returncode == 0, consolidated.stderr
    exported = run_tool_here("checkpoint", ["export", checkpoints, str(tmp_path / "export")], tmp_path, monkeypatch)
    assert exported.returncode == 0, exported.stderr
    state_dict = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    tensors = load_file(tmp_path / "export" / "model.safetensors")
    assert state_dict.keys() == tensors.keys() == run.params.keys()
    for name, value in run.params.items():
        assert torch.equal(state_dict[name], value) and torch.equal(tensors[name], value), name


@pytest.mark.multiprocess
def test_the_hugging_face_overlay_trains_a_llama_shaped_model_like_one_process(tmp_path):
    llama = ("--config", write_llama_config(tmp_path))
    tp = train(tmp_path, "tp_hf", "tp_hf", STEPS, devices=2, extra=llama)  # the overlay by its file
    one = train(tmp_path, "one", "ddp", STEPS, devices=1, extra=llama)
    assert_same_training(tp, one, {0: 0, 1: 0})
    assert LlamaStyleLM.__name__ in (tp.run_dir / "config.yaml").read_text()
