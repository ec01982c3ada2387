"""Pipeline parallelism's pieces alone: the split check, tied and shared parameters, module stages, the bubble clock,
theory."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import Tensor, nn

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.pipeline.pp_module_split import trace_module_stages
from lightning_mlopt.strategies.pipeline.pp_runner import check_same_batch
from lightning_mlopt.strategies.pipeline.pp_schedule import SCHEDULES, BubbleClock, schedule_named
from lightning_mlopt.strategies.pipeline.pp_split import (
    check_split,
    depends_on_mode,
    install_stages,
    stage_indices,
    trace_stages,
)
from tests.distributed.two_ranks import on_ranks


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied, as many language models do

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.body(self.embed(tokens)))

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def test_per_stage_parameter_counts_follow_the_split_points() -> None:
    model = _Tied()
    model.head.weight = nn.Parameter(torch.zeros(8, 4))  # untied
    assert check_split(model, ["body"], stages=2) == [8 * 4, 4 * 4 + 4 + 8 * 4]


def test_a_parameter_tied_across_stages_is_refused() -> None:
    with pytest.raises(BadInputError, match=r"embed.weight and head.weight are one parameter \(tied\) in stages 0, 1"):
        check_split(_Tied(), ["body"], stages=2)


def test_a_rank_with_two_stages_holds_both_under_one_parent_with_their_names() -> None:
    first, second = nn.Module(), nn.Module()
    first.layers = nn.Module()
    first.layers.add_module("0", nn.Linear(2, 2))
    second.layers = nn.Module()
    second.layers.add_module("2", nn.Linear(2, 2))
    holder = nn.Module()
    holder.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    holder.head = nn.Linear(2, 2)
    install_stages(holder, [first, second])
    assert sorted(name for name, _ in holder.named_parameters()) == [
        "layers.0.bias", "layers.0.weight", "layers.2.bias", "layers.2.weight"
    ]  # fmt: skip
    assert holder.head is None
    assert stage_indices(1, ranks=2, stages_per_rank=2) == [1, 3]


class _Stage:
    def forward_one_chunk(self) -> None:
        time.sleep(0.02)

    def backward_one_chunk(self) -> None:
        time.sleep(0.02)


def test_the_bubble_is_the_step_time_outside_the_stages_compute() -> None:
    stage = _Stage()
    clock = BubbleClock([stage])
    with clock.step():
        stage.forward_one_chunk()
        time.sleep(0.04)  # waiting for a neighbour
        stage.backward_one_chunk()
    # Scheduling on a loaded machine only adds time (to any of the three sleeps): bounds from below, slack above.
    assert 0.3 < clock.bubble() < 0.7
    idle, steps = clock.take()
    assert 0.04 <= idle < 0.04 + 0.04 and 0.08 <= steps < 0.08 + 0.06
    assert clock.take() == (0.0, 0.0), "taken once"


def test_theoretical_bubbles_and_schedule_names() -> None:
    assert SCHEDULES["gpipe"].theoretical_bubble(ranks=2, microbatches=4) == pytest.approx(0.2)
    assert SCHEDULES["1f1b"].theoretical_bubble(ranks=4, microbatches=8) == pytest.approx(3 / 11)
    assert SCHEDULES["interleaved_1f1b"].theoretical_bubble(2, 4, stages_per_rank=2) == pytest.approx(1 / 9)
    assert schedule_named("1F1B") is SCHEDULES["1f1b"]
    with pytest.raises(ValueError, match="schedule: unknown 'zb'; choose one of: gpipe"):
        schedule_named("zb")


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 2)

    def forward(self, skipped: Tensor, x: Tensor) -> Tensor:
        return self.out(torch.cat([skipped, x], dim=-1))


class _Skips(nn.Module):
    """Three stages where the first one's output skips the second (a value that must pass through stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(4, 4), nn.Linear(4, 4), _Join()

    def forward(self, x: Tensor) -> Tensor:
        early = self.first(x)
        return self.third(early, self.second(early.relu()))


def test_module_stages_call_the_models_own_modules_and_pass_skipped_values_through() -> None:
    model, x = _Skips(), torch.randn(3, 4)
    stages = trace_module_stages(model, (x,), ["second", "third"], training=True)
    modules = [stages.get_stage_module(index) for index in range(stages.num_stages)]
    assert [dict(module.named_parameters()).keys() for module in modules] == [
        {"first.weight", "first.bias"},
        {"second.weight", "second.bias"},
        {"third.out.weight", "third.out.bias"},
    ]
    assert modules[1].second is model.second  # the same object: a tensor-parallel style hooks it in place
    sent = modules[0](x)  # the first's output (for the third) and its relu (for the second), as the stage sends them
    assert isinstance(sent, tuple) and len(sent) == 2
    passed = modules[1](*sent)
    assert isinstance(passed, tuple) and len(passed) == 2  # the first's output passed on, and the second's
    torch.testing.assert_close(modules[2](*passed), model(x))


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x)) if x.sum() > 0 else x


class _SendsAnInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        width = self.first(x).shape[-1]
        return self.second(x)[..., :width]


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.first(x)


@pytest.mark.parametrize(
    ("model", "split", "message"),
    [
        (
            _Branches(),
            ["second"],
            "traces the forward with torch.fx (module calls kept for the plan's hooks), which failed",
        ),
        (_SendsAnInt(), ["second"], "at 'second' the stages would pass a int (only tensors travel between stages)"),
        (_Unused(), ["spare"], "the forward never calls 'spare'"),
    ],
    ids=["branch", "int", "unused"],
)
def test_module_stages_refuse_what_a_pipeline_cannot_carry(model: nn.Module, split: list[str], message: str) -> None:
    with pytest.raises(BadInputError, match=re.escape(message)):
        trace_module_stages(model, (torch.randn(3, 4),), split, training=True)


class _HeadReadsTheEmbedding(nn.Module):
    """An LM head written as ``F.linear`` on the embedding's weight: no module of stage 1 holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body = nn.Embedding(8, 4), nn.Linear(4, 4)

    def forward(self, tokens: Tensor) -> Tensor:
        return nn.functional.linear(self.body(self.embed(tokens)), self.embed.weight)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


@pytest.mark.parametrize("trace", [trace_stages, trace_module_stages], ids=["export", "fx"])
def test_a_weight_two_stages_read_is_refused_by_either_tracer(trace) -> None:
    model = _HeadReadsTheEmbedding()
    check_split(model, ["body"], stages=2)  # no module of stage 1 holds it: only the traced graphs show the use
    with pytest.raises(BadInputError, match=r"embed.weight is used by stages 0 and 1 .* untie it"):
        trace(model, (torch.randint(0, 8, (2, 3)),), ["body"], training=True)


class _ScaledLinear(nn.Linear):
    """A subclass of nn.Linear, which torch.fx traces into unless told to keep its call."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _ScaledLinear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).relu()


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Block(), _Block()

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x))


def test_module_stages_keep_the_plans_modules_as_calls_so_their_hooks_run() -> None:
    model, x = _TwoBlocks(), torch.randn(3, 4)
    called: list[str] = []
    for name in ("first", "second.proj"):  # a block (gather_sequence's kind) and a subclass of nn.Linear
        model.get_submodule(name).register_forward_pre_hook(lambda module, args, name=name: called.append(name))
    plain = trace_module_stages(model, (x,), ["second"], training=True)
    called.clear()  # the tracer itself ran them, on proxies
    plain.get_stage_module(1)(plain.get_stage_module(0)(x))
    assert called == [], "traced into: torch.fx inlines both, so their hooks never run"
    stages = trace_module_stages(model, (x,), ["second"], training=True, kept_calls=["first", "second.proj"])
    called.clear()
    out = stages.get_stage_module(1)(stages.get_stage_module(0)(x))
    assert called == ["first", "second.proj"]
    torch.testing.assert_close(out, model(x))


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.second = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.norm(self.first(x)))


def test_the_trial_forwards_before_training_leave_batch_norms_statistics_alone() -> None:
    model, x = _Normed(), torch.randn(6, 4)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    assert depends_on_mode(model, (x,))  # batch statistics against running ones
    trace_module_stages(model, (x,), ["second"], training=True)  # runs the stages once on x
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def _compare_batches(rank: int) -> dict[str, bool]:
    """A 2 x 2 mesh: pipelines {0, 2} and {1, 3}, tensor groups {0, 1} and {2, 3}; whether each case is refused."""
    import torch.distributed as dist

    pipelines = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group, in one order
    tensors = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    both = [pipelines[rank % 2], tensors[rank // 2]]
    inputs, target = torch.arange(8.0).reshape(2, 4), torch.arange(2.0)
    cases = {
        # Ranks 1 and 3 (one pipeline) load another batch: the pipelines agree within, the tensor groups do not.
        "tensor_peers_differ_pipeline_only": ((inputs + (rank % 2), target), [pipelines[rank % 2]]),
        "tensor_peers_differ": ((inputs + (rank % 2), target), both),
        # Rank 3 has the same samples in another order (the sums agree), inputs only.
        "reordered": ((inputs.flip(0) if rank == 3 else inputs, target), both),
        "same": ((inputs, target), both),
    }
    refused = {}
    for name, (batch, groups) in cases.items():
        try:
            check_same_batch(batch, groups)
            refused[name] = False
        except BadInputError as error:
            refused[name] = "loaded different batches" in str(error)
    return refused


@pytest.mark.multiprocess
def test_the_ranks_of_a_pipeline_and_of_its_stages_tensor_groups_must_load_one_batch(tmp_path) -> None:
    records = on_ranks(_compare_batches, tmp_path, world=4)
    assert (
        records
        == [{"tensor_peers_differ_pipeline_only": False, "tensor_peers_differ": True, "reordered": True, "same": False}]
        * 4
    ), "every rank refuses alike, whichever group saw it"


def test_fewer_than_four_microbatches_per_pipeline_rank_are_warned_of_with_the_bubble() -> None:
    one_f_one_b = SCHEDULES["1f1b"]
    assert one_f_one_b.few_microbatches(ranks=2, microbatches=8) is None
    assert one_f_one_b.few_microbatches(ranks=2, microbatches=4) == (
        "pipeline: 4 micro-batches for 2 pipeline ranks leave a bubble of 20% in theory; 8 or more keep it under 20%"
    )


class _SharesAFrozenWeight(_HeadReadsTheEmbedding):
    def __init__(self) -> None:
        super().__init__()
        self.embed.weight.requires_grad_(False)  # frozen: each stage's copy stays the same


def test_a_frozen_weight_two_stages_read_is_allowed() -> None:
    stages = trace_module_stages(_SharesAFrozenWeight(), (torch.randint(0, 8, (2, 3)),), ["body"], training=True)
    assert stages.num_stages == 2


class _Caches(nn.Module):
    """A forward that replaces a buffer with one of another shape (a cache), and updates another in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(1))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.cache = x.detach().mean(0)
        self.count += 1
        return self.proj(x)


def test_trial_forwards_put_back_a_buffer_the_forward_replaced() -> None:
    model = _Caches()
    cache = model.cache
    depends_on_mode(model, (torch.randn(3, 4),))
    assert model.cache is cache and torch.equal(cache, torch.zeros(1))
    assert model.count.item() == 0


def test_a_pipeline_warning_is_said_where_the_pipeline_finds_it() -> None:
    # Not at the caller's line: for the warnings raised while setting up, that was FSDPStrategy.setup's.
    from pathlib import Path

    from lightning_mlopt.strategies import PipelineParallelStrategy

    strategy = PipelineParallelStrategy(microbatches=2)
    strategy._batch_size = 4  # the training loader's, fixed when the stages were traced
    with pytest.warns(UserWarning, match="pipeline: val/loss leaves out batches of 3 samples, not 4") as said:
        assert strategy._evaluate((torch.zeros(3, 2), torch.zeros(3)), "val/loss") is None
    assert [Path(w.filename).name for w in said] == ["pipeline_parallel.py"]
