"""ReplicaConsistencyCheck: bit-exact fingerprints, who disagrees, and a real bit flip found on 2 processes."""

from __future__ import annotations

import pytest
import torch

from lightning_mlopt.callbacks import ReplicaConsistencyCheck
from lightning_mlopt.diagnosis import inject
from lightning_mlopt.diagnosis.bit_hash import bit_hash
from lightning_mlopt.diagnosis.replicas import describe, disagreements
from lightning_mlopt.exceptions import BadInputError
from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_flipped_bit_changes_the_fingerprint_of_any_float_type(dtype):
    tensor = torch.randn(1000).to(dtype)
    for bit in (0, 7, tensor.element_size() * 8 - 2):
        flipped = tensor.clone()
        inject.flip_bit(flipped, bit)
        assert bit_hash(flipped) != bit_hash(tensor)
    assert bit_hash(tensor.clone()) == bit_hash(tensor)
    swapped = tensor.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert bit_hash(swapped) != bit_hash(tensor) or bool(tensor[0] == tensor[1])


def test_a_tensor_fingerprinted_in_passes_gives_the_value_of_one_pass(monkeypatch):
    from lightning_mlopt.diagnosis import bit_hash as module

    tensor = torch.randn(10_001)
    one_pass = bit_hash(tensor)  # 10k elements: one pass
    monkeypatch.setitem(module.CHUNK_ELEMENTS, "cpu", 1_000)
    assert bit_hash(tensor) == one_pass
    assert module.bit_hashes([tensor, tensor[:5]], torch.device("cpu")).tolist() == [one_pass, bit_hash(tensor[:5])]
    flipped = tensor.clone()
    inject.flip_bit(flipped[10_000:], 3)  # a bit in the last pass, one element long
    assert bit_hash(flipped) != one_pass


def test_the_minority_is_named_and_two_replicas_are_both_named():
    rows = [[0, 0, 5, 7], [0, 0, 5, 7], [0, 0, 5, 8], [0, 0, 5, 7]]  # 4 ranks, 2 tensors; rank 2's "b" differs
    (found,) = disagreements(["a", "b"], rows)
    assert (found.name, found.ranks) == ("b", [2])
    assert "b: rank 2 differs from ranks 0, 1, 3" in describe([found], step=10)
    # HSDP: two replica groups (shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3), compared within each.
    hsdp = [[0, 5], [1, 6], [0, 5], [1, 9]]
    (found,) = disagreements(["w"], hsdp)
    assert found.ranks == [1, 3] and found.replicas == [1, 3]
    assert disagreements(["w"], [[0, 5], [1, 6]]) == []  # two different shards are not replicas


def test_a_malformed_injection_is_bad_input():
    with pytest.raises(BadInputError, match="needs step"):
        inject.parse("bitflip:rank=1,param=w")
    with pytest.raises(BadInputError, match="unknown fault 'bitflop'"):
        inject.parse("bitflop:rank=1,step=2,param=w")
    assert inject.parse("bitflip:rank=1,step=7,param=w,repeat=true")[0].due(1, 9)
    with pytest.raises(ValueError, match="on_mismatch"):
        ReplicaConsistencyCheck(on_mismatch="panic")  # type: ignore[arg-type]


def _run(tmp_path, strategy: str, steps: int, injection: str | None, *extra: str):
    return run_cli(
        fit_args(
            "--model.n_layer=1",
            "--model.d_model=64",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.callbacks+=lightning_mlopt.callbacks.ReplicaConsistencyCheck",
            "--trainer.callbacks.every_n_steps=5",
            "--checkpoint.every_n_steps=5",
            *extra,
            strategy=strategy,
            steps=steps,
            run_dir=tmp_path / "run",
        ),
        cwd=tmp_path,
        preloaded=True,
        env={inject.ENV: injection} if injection else None,
    )


@pytest.mark.multiprocess
def test_a_bit_flipped_on_rank_1_under_ddp_stops_both_ranks_at_the_next_check(tmp_path):
    result = _run(tmp_path, "ddp", 20, "bitflip:rank=1,step=7,param=layers.0.attn.qkv.weight")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "replica mismatch at step 10: model.layers.0.attn.qkv.weight" in output, failure_report(result)
    assert "ranks 0 and 1 disagree" in output
    assert "the newest checkpoint saved before it: " in output and "step-000000005" in output
    committed = sorted(path.name for path in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert committed == ["step-000000005"]  # the diverged state at step 10 was not saved


@pytest.mark.multiprocess
def test_a_bit_flipped_on_rank_1_under_zero2_is_reported_and_training_goes_on_under_warn(tmp_path):
    flip = "bitflip:rank=1,step=7,param=layers.0.attn.qkv.weight,repeat=true"
    result = _run(tmp_path, "zero2", 10, flip, "--trainer.callbacks.on_mismatch=warn")
    assert result.returncode == 0, failure_report(result)
    assert "replica mismatch at step 10: model.layers.0.attn.qkv.weight: ranks 0 and 1 disagree" in result.stderr


@pytest.mark.multiprocess
def test_under_tp_what_the_plan_leaves_whole_or_replicated_is_compared_and_the_split_pieces_are_not(tmp_path):
    # Step 5: the tensor-parallel ranks hold different pieces of every planned matrix, and no alarm is raised.
    # Step 10: a norm's weight (left out of the plan, held whole on both ranks) was flipped on rank 1 after
    # step 7. Rank 1 has computed with it since, so the other tensors the ranks must hold identically have
    # drifted too: the row-wise layers' biases (DTensors replicated over the tensor dimension), the position
    # embedding, their Adam moments. The split pieces are never compared: they differ by design.
    flip = "bitflip:rank=1,step=7,param=layers.0.ln1.weight"
    result = _run(tmp_path, "tp", 10, flip, "--trainer.callbacks.on_mismatch=warn")
    assert result.returncode == 0, failure_report(result)
    output = result.stdout + result.stderr
    assert (
        "compare 2 parameter shards, each across its replicas; 7 parameters and optimizer states held whole" in output
    )
    assert output.count("replica mismatch at step") == 1
    assert "replica mismatch at step 10: model.layers.0.attn.proj.bias: ranks 0 and 1 disagree" in output
    for drifted in ("layers.0.ln1.weight", "position_embedding.weight", "layers.0.mlp.2.bias"):
        assert f"model.{drifted}: ranks 0 and 1 disagree" in output, drifted
    for split in ("attn.qkv", "mlp.0", "token_embedding", "lm_head"):
        assert split not in output, split


@pytest.mark.multiprocess
def test_under_pp_x_tp_each_stages_tensor_ranks_compare_and_a_flip_stops_every_rank(tmp_path):
    # Pipeline x tensor 2 x 2: ranks 0, 1 hold stage 0 (split between them), ranks 2, 3 stage 1. What the plan
    # leaves whole (the norms) or replicated is held by both tensor ranks of a stage: compared within the stage,
    # and the verdict reaches the other stage's ranks too. Rank 1's norm, flipped after step 2, has drifted its
    # stage's replicated tensors by the check at step 5 (before that step's save).
    flip = "bitflip:rank=1,step=2,param=layers.0.ln1.weight"
    pp_x_tp = ("--model.n_layer=4", "--trainer.devices=4", "--trainer.strategy.init_args.tensor_parallel_size=2")
    result = _run(tmp_path, "pp", 6, flip, *pp_x_tp)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "ReplicaConsistencyCheck: every 5 steps, 4 ranks compare within each pipeline stage, " in output, (
        failure_report(result)
    )
    assert output.count("ReplicaMismatchError: replica mismatch at step 5: ") == 4, "every rank stopped"
    assert "model.layers.0.attn.proj.bias: ranks 0 and 1 disagree" in output
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*")), "the diverged state was not saved"
    for split in ("attn.qkv.weight", "mlp.0.weight", "lm_head"):
        assert split not in output, split


@pytest.mark.multiprocess
# ZeRO-1 is left out: it holds whole parameters on every rank exactly as ZeRO-2 does (the stages differ only in
# gradient partitioning), so the fingerprints compared are the same, and the suite's time is spent elsewhere.
@pytest.mark.parametrize(
    ("strategy", "extra"),
    [
        ("ddp", ()),
        ("zero2", ()),
        ("fsdp", ("--trainer.strategy.init_args.replicate_size=2",)),
    ],
    ids=["ddp", "zero2", "hsdp"],
)
def test_no_false_alarm_over_20_clean_steps(tmp_path, strategy, extra):
    # Four checks (steps 5 to 20), each after a save: the shared runs' length, not 50 steps (issue 59).
    result = _run(tmp_path, strategy, 20, None, *extra)
    assert result.returncode == 0, failure_report(result)
    assert "replica mismatch" not in result.stdout + result.stderr
    assert "ReplicaConsistencyCheck: every 5 steps, 2 ranks compare" in result.stdout + result.stderr


@pytest.mark.multiprocess
def test_every_checkpoint_is_checked_first_and_a_diverged_state_is_not_saved(tmp_path):
    # The check's own interval (100) never comes; the saves every 5 steps are each checked first.
    flip = "bitflip:rank=1,step=7,param=layers.0.attn.qkv.weight"
    result = _run(tmp_path, "ddp", 20, flip, "--trainer.callbacks.every_n_steps=100")
    assert result.returncode != 0
    assert "ReplicaMismatchError: replica mismatch at step 10" in result.stderr, failure_report(result)
    committed = sorted(path.name for path in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert committed == ["step-000000005"]
