"""CompileModel: torch.compile from YAML trains what eager trains, keeps eager names, says what it cost.

The regions are found in the models users bring (our GPT demo, a nanoGPT shape with its blocks in a root
``ModuleList``, a Hugging Face model built from its config); the runs go through the CLI with
``configs/features/compile.yaml`` over a strategy overlay, and are compared with the eager runs of the same model,
seed and data. Inductor (what the feature file sets) runs in the one-process test, the most common user; the
multi-process runs use ``aot_eager`` (dynamo's tracing through the strategy's hooks and DTensors, and AOT
autograd, without generating kernels: the same graphs at a fraction of the compile time on 2 cores).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lightning_mlopt.callbacks import CompileModel
from lightning_mlopt.callbacks.compile_model import repeated_blocks
from lightning_mlopt.demos import GPTLanguageModel
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.perf.compile_watch import CompileRecord, _is_recompilation
from tests.conftest import CONFIGS, SHARED_RUN_CLIP, SHARED_RUN_STEPS
from tests.support.strategy_runs import assert_same_training, train
from tests.support.user_models import HFCausalLM, NanoGPT

COMPILE = ("--config", str(CONFIGS / "features" / "compile.yaml"))
AOT_EAGER = (*COMPILE, "--compile.backend=aot_eager")


def test_the_blocks_are_found_in_the_models_users_bring():
    assert [name for name, _ in repeated_blocks(GPTLanguageModel(n_layer=3))] == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
    ]
    assert [name for name, _ in repeated_blocks(NanoGPT())] == ["layers.0", "layers.1"]  # a root ModuleList
    llama = HFCausalLM(family="llama", layers=2)
    assert [name for name, _ in repeated_blocks(llama)] == ["model.model.layers.0", "model.model.layers.1"]


def test_regions_by_class_by_network_and_the_refusals():
    model = GPTLanguageModel(n_layer=2)
    by_class = CompileModel(block_classes=["lightning_mlopt.demos.gpt.TransformerBlock"])
    assert [name for name, _ in by_class.regions_of(model)] == ["model.layers.0", "model.layers.1"]
    assert [name for name, _ in CompileModel(regions="model").regions_of(model)] == ["model"]
    with pytest.raises(BadInputError, match=r"compile.block_classes: torch.nn.modules.conv.Conv1d is not in the"):
        CompileModel(block_classes=["torch.nn.Conv1d"]).regions_of(model)
    with pytest.raises(
        BadInputError, match=r"found no repeated blocks .* compile.block_classes, or set compile.regions: model"
    ):
        CompileModel().regions_of(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"block_classes: cannot import 'nowhere\.Block'"):
        CompileModel(block_classes=["nowhere.Block"])
    with pytest.raises(ValueError, match="regions must be 'blocks' or 'model'"):
        CompileModel(regions="layers")  # type: ignore[arg-type]


def test_a_recompilation_is_a_frames_second_attempt_and_the_line_says_what_was_paid():
    assert not _is_recompilation("0/0") and _is_recompilation("3/1") and _is_recompilation("!0/2/1")
    callback = CompileModel(mode="max-autotune")
    callback.compiled = ["model.layers.0", "model.layers.1"]
    batch = CompileRecord(compilations=2, seconds=12.34)
    line = callback.describe(2, batch, CompileRecord(compilations=3, recompilations=1, seconds=13.0))
    assert line == (
        "torch.compile (inductor, mode max-autotune): 2 block region(s) (model.layers.0, ...); step 2 compiled 2 "
        "graph(s) in 12.3 s (13.0 s in all so far, 1 recompilation(s))"
    )


@pytest.mark.slow
def test_one_process_with_inductor_trains_as_eager_and_its_run_resumes_with_compile_off(tmp_path):
    steps = 6
    eager = train(tmp_path, "eager", "ddp", steps, devices=1, extra=(SHARED_RUN_CLIP,))
    compiled = train(tmp_path, "compiled", "ddp", steps, devices=1, extra=(SHARED_RUN_CLIP, *COMPILE))
    assert_same_training(compiled, eager, {0: 0})  # the eager names: no `_orig_mod.`
    printed = (tmp_path / "compiled" / "output.txt").read_text()
    # The first step runs eagerly (PerformanceMonitor counts its FLOPs); the second compiles.
    line = re.search(
        r"torch.compile \(inductor\): 4 block region\(s\) \(model.layers.0, ...\); step 2 compiled (\d+)", printed
    )
    assert line is not None and int(line[1]) >= 1, printed[-2000:]
    summary = json.loads((compiled.run_dir / "perf" / "summary.json").read_text())
    assert summary["compile"]["compilations"] >= 1 and summary["compile"]["recompilations"] == 0, summary
    # The step that compiled (seconds of it) is in no figure: one batch fewer than eager's (both leave out the first,
    # FLOP-counted one). Counted, not timed: a loaded machine stretches an eager step past a warm cache's compile.
    eager_batches = json.loads((eager.run_dir / "perf" / "summary.json").read_text())["ranks"][0]["batches"]
    assert summary["ranks"][0]["batches"] == eager_batches - 1 == steps - 2, summary["ranks"]
    assert "recompiled" not in printed
    # The same run directory relaunched without compile: it resumes the compiled run's checkpoint (eager names).
    again = (SHARED_RUN_CLIP, "--checkpoint.resume.final=true")  # train on from its final checkpoint
    resumed = train(tmp_path, "compiled", "ddp", steps + 2, devices=1, extra=again)
    assert len(resumed.records[0]["losses"]) == 2  # steps 7 and 8: it started where the compiled run ended


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_blocks_under_ddp_and_fsdp_with_activation_checkpointing_train_the_shared_runs_model(
    tmp_path: Path, strategy: str, strategy_runs
):
    extra = (SHARED_RUN_CLIP, *AOT_EAGER)
    if strategy == "fsdp":  # torchtitan's order: checkpointing, then compile, then FSDP's units
        extra += ("--trainer.strategy.init_args.activation_checkpointing=[lightning_mlopt.demos.gpt.TransformerBlock]",)
    run = train(tmp_path, strategy, strategy, SHARED_RUN_STEPS, extra=extra)
    assert_same_training(run, strategy_runs[strategy], {0: 0, 1: 1})
    printed = (tmp_path / strategy / "output.txt").read_text()
    assert re.search(r"torch.compile \(aot_eager\): 4 block region\(s\) .*; step 2 compiled [1-9]", printed), printed


def test_pipeline_parallelism_is_refused_and_a_disabled_callback_compiles_nothing():
    from types import SimpleNamespace

    from lightning_mlopt.strategies import PipelineParallelStrategy

    trainer = SimpleNamespace(strategy=PipelineParallelStrategy())
    with pytest.raises(BadInputError, match="compile: pipeline parallelism runs traced stage graphs"):
        CompileModel().setup(trainer, GPTLanguageModel(), "fit")  # type: ignore[arg-type]
    off, model = CompileModel(enabled=False), GPTLanguageModel(n_layer=2)
    off.setup(trainer, model, "fit")  # type: ignore[arg-type]
    off.compile_model(trainer, model)  # type: ignore[arg-type]
    assert off.compiled == [] and all(block._compiled_call_impl is None for block in model.model.layers)
