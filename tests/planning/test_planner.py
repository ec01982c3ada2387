"""The memory planner: the ZeRO paper's figures, hand-computed cases, meta-device counts, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_mlopt.demos import GPTLanguageModel, ResNetClassifier
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.planning import parse_count, parse_size, plan_memory
from lightning_mlopt.planning.memory import bytes_per_parameter
from tests.conftest import CONFIGS, run_tool_here


def test_reproduces_the_zero_paper_example():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam.
    plan = plan_memory(7_500_000_000, 64, 80 * 10**9)
    totals = {row.strategy: round(row.total / 1e9, 1) for row in plan.rows}
    assert (totals["ddp"], totals["zero1"], totals["zero2"], totals["zero3/fsdp"]) == (120.0, 31.4, 16.6, 1.9)
    assert plan.recommendation == "zero1"  # DDP's 120 GB does not fit in 80 GB


def test_hand_computed_cases():
    assert bytes_per_parameter("mixed", "adam") == (2, 2, 12)
    assert bytes_per_parameter("mixed", "sgd_momentum") == (2, 2, 8)
    assert bytes_per_parameter("fp32", "sgd") == (4, 4, 0)
    # 1M parameters, fp32 Adam, 4 ranks: DDP 4 + 4 + 8 = 16 MB; ZeRO-2 (DeepSpeed, + its fp32 master copy)
    # 4 + (4 + 12) / 4 = 8 MB; ZeRO-3 / FSDP 16 / 4 = 4 MB; plus 1 MB of activations each.
    plan = plan_memory(1_000_000, 4, 10**9, precision="fp32", optimizer="adam", activation_bytes=1e6)
    rows = {row.strategy: row for row in plan.rows}
    assert rows["ddp"].total == 17e6 and rows["zero2"].total == 9e6 and rows["zero3/fsdp"].total == 5e6
    assert rows["zero3/fsdp+offload"].cpu_offloaded == (4 + 12) * 1e6 / 4
    assert plan.recommendation == "ddp"  # the simplest that fits
    tight = plan_memory(1_000_000, 4, int(9e6), precision="fp32", optimizer="adam", headroom=0.1)
    assert tight.recommendation == "zero2"  # 8 MB x 1.1 fits in 9 MB, ZeRO-1's 11 MB does not


def test_parsing_sizes_and_counts():
    assert parse_size("80GB") == 80 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("512 MB") == 512 * 10**6
    assert parse_count("7.5B") == 7_500_000_000 and parse_count("350M") == 350_000_000 and parse_count("1e6") == 10**6
    for bad in ("80XB", "eighty", "-5GB", "80"):
        with pytest.raises(ValueError):
            parse_size(bad)
    for bad in ("-3B", "many", "0"):
        with pytest.raises(ValueError):
            parse_count(bad)


@pytest.mark.parametrize("model", [GPTLanguageModel(n_layer=3), ResNetClassifier(depth=50, width=16)])
def test_meta_device_parameter_counts_equal_real_counts(model):
    with torch.device("meta"):
        meta = type(model)(**model.hparams)
    assert all(p.is_meta for p in meta.parameters())
    assert sum(p.numel() for p in meta.parameters()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num_params", "-5", "--world_size", "8"], "not a parameter count"),
        (["--num_params", "lots", "--world_size", "8"], "not a parameter count"),
        (["--num_params", "7B", "--world_size", "0"], "world_size must be >= 1"),
        (["--num_params", "7B", "--world_size", "8", "--gpu_memory", "80XB"], "unknown unit"),
        (["--num_params", "7B", "--world_size", "eight"], "invalid int value"),
        (["--world_size", "8"], "give --config FILE or --num_params N"),
    ],
)
def test_bad_input_exits_2_with_a_short_message(tmp_path, monkeypatch, args, message):
    result = run_tool_here("plan", args, tmp_path, monkeypatch)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 15


def test_plan_from_a_config_uses_the_meta_device_and_prints_json(tmp_path, monkeypatch):
    args = ["--config", str(CONFIGS / "gpt.yaml"), "--world_size", "2", "--gpu_memory", "1GB", "--format", "json"]
    result = run_tool_here("plan", args, tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["num_params"] == sum(p.numel() for p in GPTLanguageModel().parameters())
    assert plan["optimizer"] == "adam" and plan["precision"] == "fp32"  # gpt.yaml trains in fp32 with AdamW
    assert plan["recommendation"] == "ddp"
    assert plan["rows"][0]["activations"] > 0  # measured from one micro-batch on the meta device


def _gpt_config(devices: int) -> dict:
    return {
        "trainer": {"accelerator": "cpu", "devices": devices, "precision": "32-true"},
        "model": {"class_path": "lightning_mlopt.demos.GPTLanguageModel", "init_args": {}},
        "data": {"class_path": "lightning_mlopt.demos.TokenDataModule", "init_args": {"num_sequences": 64}},
    }


def test_auto_picks_the_simplest_strategy_that_fits(monkeypatch):
    from lightning_mlopt.planning import auto

    monkeypatch.setattr(auto, "device_memory", lambda trainer, per_node: 10**11)
    name, plan, table = auto.choose_strategy(_gpt_config(devices=2))
    assert name == "ddp" and "recommendation: ddp" in table
    # Squeeze memory until DDP's total no longer fits but fully sharded does: auto moves down the list.
    rows = {row.strategy: row.total for row in plan.rows}
    between = int(1.1 * (rows["zero3/fsdp"] + rows["zero2"]) / 2)
    monkeypatch.setattr(auto, "device_memory", lambda trainer, per_node: between)
    name, plan, _ = auto.choose_strategy(_gpt_config(devices=2))
    assert plan.recommendation == "zero3/fsdp" and name == "fsdp"
    monkeypatch.setattr(auto, "device_memory", lambda trainer, per_node: 10**6)
    assert auto.choose_strategy(_gpt_config(devices=2))[0] is None  # nothing fits


def test_hsdp_rows_divide_the_state_by_one_replicas_ranks_and_come_between_zero2_and_full_sharding():
    plan = plan_memory(7_500_000_000, 64, 80 * 10**9, replicate=8)
    rows = {row.strategy: row for row in plan.rows}
    names = [row.strategy for row in plan.rows]
    assert names.index("zero2") < names.index("hsdp8x8") < names.index("zero3/fsdp")
    assert rows["hsdp8x8"].total == pytest.approx(rows["ddp"].total / 8)  # 120 GB over one node's 8 ranks
    assert rows["hsdp8x8"].total == pytest.approx(15e9)
    # One replica is FSDP; one shard per replica is DDP: no row of its own.
    for replicate in (1, 64):
        assert not [row for row in plan_memory(10**9, 64, 10**11, replicate=replicate).rows if "hsdp" in row.strategy]
    with pytest.raises(BadInputError, match=r"^replicate_size=3 must divide the world size \(64 = devices x nodes\)"):
        plan_memory(10**9, 64, 10**11, replicate=3)


def test_auto_on_several_nodes_picks_hsdp_where_it_fits_and_zero2_does_not(monkeypatch):
    from lightning_mlopt.planning import auto

    config = _gpt_config(devices=4)  # 2 nodes of 4: ZeRO-2 holds 6 bytes a parameter in fp32, HSDP 16 / 4
    config["trainer"]["num_nodes"] = 2
    monkeypatch.setattr(auto, "device_memory", lambda trainer, per_node: 10**11)
    plan = auto.choose_strategy(config)[1]
    rows = {row.strategy: row.total for row in plan.rows}
    between = int(1.1 * (rows["hsdp2x4"] + rows["zero2"]) / 2)
    monkeypatch.setattr(auto, "device_memory", lambda trainer, per_node: between)
    name, plan, table = auto.choose_strategy(config)
    assert plan.recommendation == "hsdp2x4" and name == "hsdp" and "hsdp2x4" in table


def test_auto_world_size_from_trainer_settings():
    from lightning_mlopt.planning.auto import world_size_of

    assert world_size_of({"accelerator": "cpu", "devices": 2, "num_nodes": 3}) == 6
    assert world_size_of({"accelerator": "cpu", "devices": "auto"}) == 1
    assert world_size_of({"devices": [0, 1, 2, 3]}) == 4


def test_attention_is_counted_as_a_fused_kernel_keeps_it():
    """q, k, v, the output and a log-sum-exp per row: not the (B, H, T, T) weights of the meta reference path."""
    from lightning_mlopt.planning.probe import measure_activations

    batch, heads, length, dim = 2, 4, 256, 32

    class Attention:
        def log(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("measure_activations silences logging")

        def training_step(self, batch_, index):  # type: ignore[no-untyped-def]
            (q,) = batch_
            return torch.nn.functional.scaled_dot_product_attention(q.requires_grad_(), q * 2, q * 3, is_causal=True)

    class Data:
        def setup(self, stage):  # type: ignore[no-untyped-def]
            pass

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return [[torch.zeros(batch, heads, length, dim)]]

    kept = measure_activations(Attention(), Data())
    qkv_and_output = 4 * batch * heads * length * dim * 4
    # q * 2 and q * 3 keep nothing (a constant factor); the fused kernel keeps q, k, v, output and the rows' lse.
    assert kept == qkv_and_output + batch * heads * length * 4
    assert kept < batch * heads * length * length * 4  # less than one attention matrix, which the math path keeps


def test_the_gpt_demo_at_gpu_size_plans_near_what_an_h200_held():
    """The H200 session measured 14.3-16.0 GB (max_memory_allocated after step 1, bf16-mixed); plan above it."""
    from lightning_mlopt.demos import TokenDataModule
    from lightning_mlopt.planning.probe import measure_activations

    size = {"vocab_size": 32768, "block_size": 1024, "n_layer": 12, "n_head": 16, "d_model": 1024}
    with torch.device("meta"):
        model = GPTLanguageModel(**size)
    data = TokenDataModule(vocab_size=32768, block_size=1024, num_sequences=32, batch_size=16)
    params = sum(p.numel() for p in model.parameters())
    plan = plan_memory(params, 1, 140 * 10**9, "mixed", "adam", measure_activations(model, data))
    ddp = next(row for row in plan.rows if row.strategy == "ddp")
    assert 16.0e9 <= ddp.total <= 16.0e9 * 1.3, ddp.total  # on the safe side, within 30%


def test_tensor_parallel_rows_place_each_module_and_divide_as_the_plan_does(tmp_path, monkeypatch):
    fsdp_tp = ["--config", str(CONFIGS / "gpt.yaml"), "--config", str(CONFIGS / "strategies" / "fsdp_tp.yaml")]
    result = run_tool_here("plan", [*fsdp_tp, "--world_size", "4"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "tensor-parallel plan (2 ways, data-parallel 2):"
    assert "  model.layers.0.attn.qkv: colwise, out_features 384 -> 192 a rank" in lines
    rows = {
        line.split()[0]: [float(x) for x in line.split()[1:7]] for line in lines if line.startswith(("ddp ", "fsdp2"))
    }
    ddp, tp = rows["ddp"], rows["fsdp2xtp2"]
    # The plan splits most parameters 2 ways; FSDP halves everything again: a little over a quarter of DDP's.
    assert 0.25 < tp[0] / ddp[0] < 0.27 and tp[2] / ddp[2] == pytest.approx(tp[0] / ddp[0], rel=0.01)
    # Activations are one tensor-parallel rank's, measured under the plan (equal to a real run's: see
    # test_tensor_parallel.py): the heads and the MLP's hidden width split, the rest whole.
    assert 0.5 < tp[3] / ddp[3] < 0.75
    # A plan that does not fit the model is bad input here too.
    bad = run_tool_here("plan", [*fsdp_tp, "--world_size", "3"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and "must divide the world size (3)" in bad.stderr


def test_pipeline_rows_name_each_stage_and_hold_the_busiest_ranks_share(tmp_path, monkeypatch):
    pp = ["--config", str(CONFIGS / "gpt.yaml"), "--config", str(CONFIGS / "strategies" / "pp.yaml")]
    result = run_tool_here("plan", [*pp, "--world_size", "4"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "pipeline plan (2 ranks, 2 stages, 1f1b, 8 micro-batches, data-parallel 2; bubble 11% in theory):",
        "  stage 0 on pipeline rank 0, from (start): 437,504 parameters (50%)",
        "  stage 1 on pipeline rank 1, from model.layers.2: 429,568 parameters (50%)",
    ]
    rows = {
        line.split()[0]: [float(x) for x in line.split()[1:7]] for line in lines if line.startswith(("ddp ", "pp2"))
    }
    ddp, pp2 = rows["ddp"], rows["pp2xfsdp2"]
    assert pp2[0] == pytest.approx(437_504 * 4 / 2 / 1e6, abs=0.01)  # fp32 stage 0, halved by FSDP, in MB
    # 1F1B keeps at most 2 of the 8 micro-batches alive on rank 0, each with its stage's share of activations.
    assert pp2[3] == pytest.approx(ddp[3] * 2 / 8 * 437_504 / (437_504 + 429_568), rel=0.01)
    bad = run_tool_here("plan", [*pp, "--world_size", "3"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and "must divide the world size (3)" in bad.stderr


def test_3d_rows_split_each_stages_planned_parameters_and_shard_the_rest(tmp_path, monkeypatch):
    """PP x FSDP x TP = 2 x 2 x 2: the busiest stage's 427,776 planned elements halved by TP, then all by FSDP."""
    tp2 = tmp_path / "tp2.yaml"
    tp2.write_text("trainer:\n  strategy:\n    init_args:\n      tensor_parallel_size: 2\n")
    pp = ["--config", str(CONFIGS / "gpt.yaml"), "--config", str(CONFIGS / "strategies" / "pp.yaml")]
    result = run_tool_here("plan", [*pp, "--config", str(tp2), "--world_size", "8"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "pipeline plan (2 ranks, 2 stages, 1f1b, 8 micro-batches, data-parallel 2, tensor-parallel 2; bubble 11% in "
        "theory):",
        "  stage 0 on pipeline rank 0, from (start): 437,504 parameters (50%), 427,776 split 2 ways",
        "  stage 1 on pipeline rank 1, from model.layers.2: 429,568 parameters (50%), 427,776 split 2 ways",
        "tensor-parallel plan (2 ways, within each stage):",
    ]
    assert "  model.lm_head: colwise_replicated, out_features 256 -> 128 a rank" in lines
    (row,) = [line.split() for line in lines if line.startswith("pp2xfsdp2xtp2 ")]
    held = (437_504 - 427_776 + 427_776 / 2) / 2  # stage 0's: the embedding's rows go to TP, its norms do not
    assert float(row[1]) == pytest.approx(held * 4 / 1e6, abs=0.01)  # fp32 parameters, in MB
    bad = run_tool_here("plan", [*pp, "--config", str(tp2), "--world_size", "6"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and "x tensor (2) must divide the world size (6)" in bad.stderr


def test_compile_and_float8_lines_name_what_the_fit_would_take(tmp_path, monkeypatch):
    features = [str(CONFIGS / "features" / name) for name in ("compile.yaml", "float8.yaml")]
    configs = [CONFIGS / "gpt.yaml", CONFIGS / "strategies" / "fsdp.yaml", *features]
    args = [arg for path in configs for arg in ("--config", str(path))]
    result = run_tool_here("plan", [*args, "--world_size", "2"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # The GPT demo's four blocks; its 16 block linears (4 x (128x384 + 128x128 + 128x512 + 512x128) weights), the
    # vocabulary head kept.
    assert lines[0].startswith("compile (blocks, inductor): 4 region(s) (model.layers.0, ...)")
    assert lines[1].startswith("float8 (tensorwise): 16 linear layer(s) in float8 matmuls (786,432 of 867,072 ")
    assert "kept in high precision: model.lm_head (the output head)" in lines[1]
    # Nothing to convert is bad input, as fit says.
    (tmp_path / "skip.yaml").write_text("float8:\n  skip: ['*']\n")
    skip_all = ["--config", str(tmp_path / "skip.yaml")]
    bad = run_tool_here("plan", [*args, *skip_all, "--world_size", "2"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and "float8: no linear layer to convert" in bad.stderr


def test_a_context_parallel_row_holds_fsdps_state_over_the_world_and_a_share_of_the_activations(tmp_path, monkeypatch):
    cp = ["--config", str(CONFIGS / "gpt.yaml"), "--config", str(CONFIGS / "strategies" / "cp.yaml")]
    result = run_tool_here("plan", [*cp, "--world_size", "4"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: [float(x) for x in line.split()[1:5]] for line in result.stdout.splitlines()[2:10]}
    fsdp, cp2 = rows["zero3/fsdp"], rows["fsdp2xcp2"]  # shard 2 x context 2
    assert cp2[:3] == fsdp[:3]  # parameters, gradients, optimizer state: FSDP's over all 4 ranks
    assert cp2[3] == pytest.approx(fsdp[3] / 2, abs=0.01)  # each rank holds half of every sequence
    bad = run_tool_here("plan", [*cp, "--world_size", "3"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and "context_parallel_size=2 must divide the world size (3" in bad.stderr
