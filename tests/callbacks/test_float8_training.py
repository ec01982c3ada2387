"""Float8Training: which linears go float8 in the models users bring, what it refuses, and runs through the CLI.

On CPU torchao emulates the float8 matmuls (float8's numerics in higher precision), so these runs check what a
float8 configuration computes and writes; its speed is the GPU checklist's. A float8 run is not bitwise the eager
run: the comparisons are float8 against float8 across layouts, and float8 against eager within float8's error.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_mlopt.callbacks import Float8Training
from lightning_mlopt.demos import GPTLanguageModel
from lightning_mlopt.exceptions import BadInputError
from tests.conftest import CONFIGS, SHARED_RUN_CLIP, SHARED_RUN_STEPS
from tests.support.strategy_runs import train
from tests.support.user_models import HFCausalLM, NanoGPT

FLOAT8 = ("--config", str(CONFIGS / "features" / "float8.yaml"))


def test_every_linear_but_the_head_and_odd_sizes_is_chosen_in_the_models_users_bring():
    chosen, kept = Float8Training().choose(GPTLanguageModel(n_layer=2))
    assert len(chosen) == 8 and "model.layers.1.mlp.2" in chosen  # qkv, proj, two MLP linears per block
    assert kept == {"model.lm_head": "the output head"}
    chosen, kept = Float8Training().choose(NanoGPT())  # its blocks in a root ModuleList
    assert {"layers.0.c_attn", "layers.1.mlp_proj"} <= chosen and kept == {"lm_head": "the output head"}
    chosen, kept = Float8Training(skip=["model.model.layers.0.*"]).choose(HFCausalLM(family="llama", layers=2))
    assert "model.model.layers.1.self_attn.q_proj" in chosen and "model.lm_head" not in chosen
    assert kept["model.model.layers.0.mlp.up_proj"] == "float8.skip"
    odd = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.Linear(64, 64))
    assert Float8Training().choose(odd) == ({"1"}, {"0": "30x64: not multiples of 16"})
    with pytest.raises(BadInputError, match=r"float8: no linear layer to convert \(kept: 0 \(30x64"):
        Float8Training().choose(torch.nn.Sequential(torch.nn.Linear(30, 64)))


@pytest.mark.slow  # building DeepSpeed's strategy imports DeepSpeed: 2-3 s
def test_bad_settings_and_the_strategies_it_cannot_run_under_are_refused():
    with pytest.raises(ValueError, match="recipe must be tensorwise, rowwise or rowwise_with_gw_hp"):
        Float8Training(recipe="blockwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fsdp_float8_all_gather needs the tensorwise recipe"):
        Float8Training(recipe="rowwise", fsdp_float8_all_gather=True)
    from lightning_mlopt.strategies import DeepSpeedStrategy, PipelineParallelStrategy

    tensor_parallel = SimpleNamespace(mesh_plan=SimpleNamespace(tensor=2))
    for strategy, named in (
        (PipelineParallelStrategy(), "pipeline parallelism"),
        (tensor_parallel, "tensor parallelism"),
        (DeepSpeedStrategy(), "DeepSpeed"),
    ):
        with pytest.raises(BadInputError, match=f"float8: not under {named} yet"):
            Float8Training().setup(SimpleNamespace(strategy=strategy), GPTLanguageModel(), "fit")  # type: ignore[arg-type]
    Float8Training(enabled=False).setup(SimpleNamespace(strategy=PipelineParallelStrategy()), None, "fit")  # type: ignore[arg-type]


@pytest.mark.slow
def test_one_process_float8_trains_near_eager_and_its_checkpoint_trains_on_without_float8(tmp_path):
    steps = 6
    eager = train(tmp_path, "eager", "ddp", steps, devices=1, extra=(SHARED_RUN_CLIP,))
    float8 = train(tmp_path, "float8", "ddp", steps, devices=1, extra=(SHARED_RUN_CLIP, *FLOAT8))
    printed = (tmp_path / "float8" / "output.txt").read_text()
    assert (
        "float8 (tensorwise, emulated: no float8 matmuls on this device): 16 linear layer(s) "
        "(model.layers.0.attn.proj, ...); kept in high precision: model.lm_head (the output head)"
    ) in printed
    assert "Failed to load" not in printed  # torchao's CUDA kernel libraries, said at import on a CPU
    losses, reference = (torch.tensor(run.records[0]["losses"]) for run in (float8, eager))
    assert not torch.equal(losses, reference)  # float8 ran: its rounding shows
    torch.testing.assert_close(losses, reference, rtol=2e-2, atol=0)  # within float8's error
    assert float8.params.keys() == eager.params.keys()  # the same names: no float8 state in the checkpoint
    # MFU's count: the model's FLOPs, the same as eager's (float8 matmuls counted once, not their casts).
    flops = [
        json.loads((run.run_dir / "perf" / "summary.json").read_text())["flops_per_sample"] for run in (float8, eager)
    ]
    assert flops[0] == pytest.approx(flops[1], rel=1e-3), flops
    again = (SHARED_RUN_CLIP, "--checkpoint.resume.final=true")  # train on from its final checkpoint, eagerly
    resumed = train(tmp_path, "float8", "ddp", steps + 2, devices=1, extra=again)
    assert len(resumed.records[0]["losses"]) == 2


@pytest.mark.multiprocess
def test_fsdp_with_float8_all_gathers_trains_the_float8_ddp_model(tmp_path, strategy_runs):
    # The weights all-gathered in float8 (half bf16's bytes) are the ones DDP casts after its all-reduce: the same
    # float8 training up to the order its scales' maxima are reduced in (1e-3, against float8's 2e-2 from eager);
    # and both within float8's error of the shared eager run.
    extra = (SHARED_RUN_CLIP, *FLOAT8)
    ddp = train(tmp_path, "ddp", "ddp", SHARED_RUN_STEPS, extra=extra)
    fsdp = train(tmp_path, "fsdp", "fsdp", SHARED_RUN_STEPS, extra=(*extra, "--float8.fsdp_float8_all_gather=true"))
    for rank in (0, 1):
        losses, reference = (torch.tensor(run.records[rank]["losses"]) for run in (fsdp, ddp))
        torch.testing.assert_close(losses, reference, rtol=1e-3, atol=0)
        eager = torch.tensor(strategy_runs["ddp"].records[rank]["losses"])
        torch.testing.assert_close(losses, eager, rtol=2e-2, atol=0)
    for name, value in ddp.params.items():
        torch.testing.assert_close(fsdp.params[name], value, rtol=0, atol=1e-3, msg=name)
    assert "float8 (tensorwise, float8 all-gather, emulated" in (tmp_path / "fsdp" / "output.txt").read_text()
