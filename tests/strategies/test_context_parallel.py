"""Context parallelism (all-to-all) through the real CLI on CPU (gloo), and what it refuses.

- ``configs/strategies/cp.yaml`` on 2 processes (context 2: each rank holds half of every sequence, attention
  over the whole through the all-to-all) trains the GPT demo as one process does on the same batches: the mean of
  the two ranks' losses is the one-process loss, and the final parameters are equal (fp32, 1e-4, clipping
  active: the norm over the parameters FSDP shards across the context ranks). Preempted and relaunched, it ends
  bitwise where the uninterrupted run did. PerformanceMonitor counts the pair's batch once, each rank half.
  Context 2 x shard 2 and HSDP's replicate 2 x context 2, on 4 processes, train as one process does.
- A Hugging Face Llama (grouped-query attention, rotary positions from ``position_ids`` in a dict batch) at
  context 2 trains as one process does; a sliding-window Qwen2 is refused.
- Refused, never run wrong: a batch without positions, a sequence the size does not divide, heads it does not
  divide, an ``attn_mask`` built for a slice, a model whose attention never went through the exchange, and the
  combinations not offered yet (TP, activation checkpointing), before launch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.nn import functional

from lightning_mlopt.distributed.mesh_plan import MeshPlan
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies import FSDPStrategy
from lightning_mlopt.strategies.context.context_steps import ContextParallelSteps, refuse_with_context
from lightning_mlopt.strategies.context.sdpa_mode import AllToAllAttention
from lightning_mlopt.strategies.context.sequence_split import split_sequences, token_weight
from lightning_mlopt.strategies.fsdp_options import FSDPOptions
from tests.conftest import SHARED_RUN_CLIP
from tests.support.strategy_runs import TrainedRun, train
from tests.support.user_models import llama, write_user_config

STEPS = 4
PERF = "--trainer.callbacks+=lightning_mlopt.callbacks.PerformanceMonitor"
BLOCK = "lightning_mlopt.demos.gpt.TransformerBlock"
LLAMA_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


@pytest.mark.multiprocess
def test_cp2_trains_the_one_process_model_and_a_preempted_run_resumes_bitwise(tmp_path):
    cp = train(tmp_path, "cp", "cp", STEPS, devices=2, extra=(SHARED_RUN_CLIP, PERF))
    one = train(tmp_path, "one", "ddp", STEPS, devices=1, extra=(SHARED_RUN_CLIP, PERF))  # positions numbered inside
    # Each rank's loss is the mean over its half of every sequence: their mean is the one-process loss.
    per_rank = torch.tensor([record["losses"] for record in cp.records])
    expected = torch.tensor(one.records[0]["losses"])
    torch.testing.assert_close(per_rank.mean(dim=0), expected, rtol=1e-4, atol=0)
    assert not torch.allclose(per_rank[0], per_rank[1]), "the ranks held different halves"
    assert expected[-1] < expected[0], "the reference trained: agreeing on doing nothing proves nothing"
    assert cp.params.keys() == one.params.keys()
    for name, value in one.params.items():
        torch.testing.assert_close(cp.params[name], value, rtol=0, atol=1e-4, msg=name)
    # PerformanceMonitor: the context pair trained on one batch a step, each half of its samples (tokens) and
    # FLOPs (half the positions through every linear; half the heads over the whole sequence in attention).
    summaries = [json.loads((run.run_dir / "perf" / "summary.json").read_text()) for run in (one, cp)]
    (alone,), pair = summaries[0]["ranks"], summaries[1]["ranks"]
    assert [rank["samples"] for rank in pair] == [alone["samples"] / 2] * 2
    assert [rank["flops"] for rank in pair] == pytest.approx([alone["flops"] / 2] * 2, rel=1e-6)
    # Preempted at step 3 (every rank signalled; exit 75), launched again with the same command: it resumes from
    # the checkpoint the signal wrote (DCP shards over shard x context) and ends where the uninterrupted run did.
    signal = ("--trainer.callbacks+=tests.support.faults.SignalAtStep", "--trainer.callbacks.step=3")
    with pytest.raises(AssertionError, match=r"preempted failed \(exit 75\)"):
        train(tmp_path, "preempted", "cp", STEPS, devices=2, extra=(SHARED_RUN_CLIP, *signal))
    relaunched = train(tmp_path, "preempted", "cp", STEPS, devices=2, extra=(SHARED_RUN_CLIP, *signal))
    assert [len(record["losses"]) for record in relaunched.records] == [STEPS - 3] * 2
    for name, value in cp.params.items():
        torch.testing.assert_close(relaunched.params[name], value, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def one_process_at_32(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """The one-process run on the global batch of two data ranks of 16: 32 samples a step."""
    root = tmp_path_factory.mktemp("one32")
    return train(root, "one", "ddp", STEPS, devices=1, extra=(SHARED_RUN_CLIP, "--data.init_args.batch_size=32"))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "knobs", "said"),
    [
        # Ranks 0-1 and 2-3 are the context pairs of data ranks 0 and 1: two batches of 16 a step, each split.
        ("shard 2 x context 2", (), None),
        # Two replicas, each a context pair: FSDP shards over each pair (2 shards), all-reduced across replicas.
        ("replicate 2 x context 2", ("--trainer.strategy.init_args.replicate_size=2",), "2 replicas x 2 shards"),
    ],
)
def test_context_2_with_fsdp_or_hsdp_on_4_processes_trains_the_one_process_model(
    tmp_path, one_process_at_32, layout, knobs, said
):
    cp = train(tmp_path, "cp", "cp", STEPS, devices=4, extra=(SHARED_RUN_CLIP, *knobs))
    if said is not None:  # HSDP's start-up line names the mesh
        assert f"hybrid sharding (HSDP): {said} ({layout})" in (tmp_path / "cp" / "output.txt").read_text()
    per_rank = torch.tensor([record["losses"] for record in cp.records])
    expected = torch.tensor(one_process_at_32.records[0]["losses"])
    torch.testing.assert_close(per_rank.mean(dim=0), expected, rtol=1e-4, atol=0)
    for name, value in one_process_at_32.params.items():
        torch.testing.assert_close(cp.params[name], value, rtol=0, atol=1e-4, msg=name)


def test_a_slice_without_a_labelled_token_is_refused():
    labels = torch.tensor([[-100, -100, 5, 6], [-100, -100, 7, 8]])
    with pytest.raises(BadInputError, match="a slice of a batch has no label other than -100"):
        token_weight({"labels": labels}, rank=1, size=2)
    assert token_weight({"labels": labels}, rank=0, size=1) == 1.0  # one slice: the whole batch
    assert token_weight((labels, labels), rank=0, size=2) == 1.0  # a tuple names no labels: equal slices


def test_each_rank_keeps_its_slice_of_every_sequence_tensor_and_positions_are_required():
    tokens, positions = torch.arange(8).reshape(2, 4), torch.arange(4).expand(2, 4)
    inputs, targets, where = split_sequences((tokens, tokens + 1, positions), rank=1, size=2, position_key=2)
    assert inputs.tolist() == [[2, 3], [6, 7]] and targets.tolist() == [[3, 4], [7, 8]]
    assert where.tolist() == [[2, 3], [2, 3]]  # the model numbers the slice from its place in the sequence
    batch = split_sequences({"ids": tokens, "position_ids": positions, "scale": torch.ones(2)}, 0, 2, "position_ids")
    assert batch["ids"].tolist() == [[0, 1], [4, 5]] and batch["scale"].tolist() == [1.0, 1.0]
    with pytest.raises(BadInputError, match="no positions under position_key=2"):
        split_sequences((tokens, tokens), rank=0, size=2, position_key=2)
    with pytest.raises(BadInputError, match="sequences of 4 positions do not split over context_parallel_size=3"):
        split_sequences((tokens, tokens, positions), rank=0, size=3, position_key=2)


def test_attention_the_exchange_cannot_honour_is_refused_before_any_collective(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    q = torch.randn(1, 4, 2, 8)
    with AllToAllAttention(group=None), pytest.raises(BadInputError, match="4 query heads, which context_parallel_"):
        functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with AllToAllAttention(group=None), pytest.raises(BadInputError, match="passes scaled_dot_product_attention an"):
        functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(2, 2, dtype=torch.bool))


def test_a_model_whose_attention_never_went_through_the_exchange_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    class Base:
        def training_step(self) -> torch.Tensor:
            q = torch.randn(1, 2, 4, 8)
            return (q @ q.transpose(-1, -2)).softmax(-1).sum()  # attention by hand: the mode never sees it

    class Host(ContextParallelSteps, Base):
        context_parallel_size, position_key = 2, 2
        device_mesh = {"context": SimpleNamespace(get_group=lambda: None)}

    with pytest.raises(BadInputError, match=r"made no torch\.nn\.functional\.scaled_dot_product_attention call"):
        Host().training_step()


@pytest.mark.parametrize(
    ("plan", "options", "named"),
    [
        (MeshPlan.fill(4, context=2, tensor=2), FSDPOptions(), "tensor_parallel_size"),
        (
            MeshPlan.fill(2, context=2),
            FSDPOptions.from_keys(activation_checkpointing=[BLOCK]),
            "activation_checkpointi",
        ),
    ],
)
def test_what_context_parallelism_does_not_combine_with_yet_is_refused(plan, options, named):
    with pytest.raises(BadInputError, match=re.escape(f"context_parallel_size=2 with {named}")):
        refuse_with_context(plan, options)
    refuse_with_context(MeshPlan.fill(2, context=2), FSDPOptions())  # FSDP x context alone runs
    with pytest.raises(ValueError, match="context_parallel_size must be >= 1"):
        FSDPStrategy(context_parallel_size=0)


def test_compile_is_refused_under_context_parallelism():
    from lightning_mlopt.callbacks import CompileModel

    trainer = SimpleNamespace(strategy=FSDPStrategy(context_parallel_size=2))
    with pytest.raises(BadInputError, match="compile: context parallelism routes attention"):
        CompileModel().setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_a_sequence_length_the_size_does_not_divide_is_refused_before_launch():
    from lightning_mlopt.cli.support import check_fits_strategy
    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule

    strategy = FSDPStrategy(context_parallel_size=2)
    data = TokenDataModule(block_size=63, positions=True)
    with pytest.raises(BadInputError, match=r"context_parallel_size=2 must divide the sequence length \(data block"):
        check_fits_strategy(strategy, GPTLanguageModel(n_layer=1), data)


def _llama_on_dict_batches(folder: Path, ignored_prefix: bool = False) -> tuple[str, ...]:
    """A config training the Hugging Face Llama on dicts of input_ids, labels and position_ids."""
    config = yaml.safe_load(Path(write_user_config(folder, llama(), "llama.yaml")).read_text())
    config["data"]["class_path"] = "tests.support.user_models.DictTokens"
    config["data"]["init_args"].update(positions=True, ignored_prefix=ignored_prefix)
    (folder / "llama.yaml").write_text(yaml.safe_dump(config))
    return ("--config", str(folder / "llama.yaml"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("ignored_prefix", [False, True], ids=["every_label", "ignored_prefixes"])
def test_cp2_trains_a_hugging_face_llama_on_dict_batches_as_one_process_does(tmp_path, ignored_prefix):
    # Grouped-query attention (4 heads, 2 key/value heads: one each after the exchange), rotary positions from
    # position_ids, Hugging Face's own sdpa attention: its causal mask left to is_causal, which the exchange serves.
    # With prompts' labels ignored (-100), the halves hold unequal counts of labelled tokens: each rank's mean is
    # weighted by its share, so the average is still the per-token mean over the batch.
    config = _llama_on_dict_batches(tmp_path, ignored_prefix)
    context = (
        "--trainer.strategy.init_args.context_parallel_size=2",
        "--trainer.strategy.init_args.position_key=position_ids",
    )
    layers = f"--trainer.strategy.init_args.wrap_classes=[{LLAMA_LAYER}]"
    cp = train(tmp_path, "cp", "fsdp", STEPS, devices=2, extra=(*config, *context, layers, SHARED_RUN_CLIP))
    one = train(tmp_path, "one", "ddp", STEPS, devices=1, extra=(*config, SHARED_RUN_CLIP))
    per_rank = torch.tensor([record["losses"] for record in cp.records])
    expected = torch.tensor(one.records[0]["losses"])
    torch.testing.assert_close(per_rank.mean(dim=0), expected, rtol=1e-4, atol=0)
    assert expected[-1] < expected[0]
    for name, value in one.params.items():
        torch.testing.assert_close(cp.params[name], value, rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
def test_a_sliding_window_or_indivisible_heads_are_refused_before_launch():
    from tests.support.user_models import HFCausalLM

    with pytest.raises(BadInputError, match=r"declares sliding-window attention \(sliding_window=32\)"):
        refuse_with_context(MeshPlan.fill(2, context=2), FSDPOptions(), HFCausalLM(family="qwen2"))
    refuse_with_context(MeshPlan.fill(2, context=2), FSDPOptions(), HFCausalLM(family="llama"))  # full attention
    # Heads are exchanged: a size that does not divide the key/value heads (2 of them) is refused before launch.
    with pytest.raises(BadInputError, match="num_key_value_heads=2, which context_parallel_size=4 does not divide"):
        refuse_with_context(MeshPlan.fill(4, context=4), FSDPOptions(), HFCausalLM(family="llama"))
