"""Where a non-finite value was born, in-process: the report's lines, the forward watch, the bad gradients' modules."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mlopt.diagnosis.nonfinite import nonfinite_gradient_modules, nonfinite_report, watching_outputs
from lightning_mlopt.distributed.sharding import Piece


class _Times(nn.Module):
    """Multiplies its input by ``factor`` (inf: the first non-finite output)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


class _Pair(nn.Module):
    """Returns a tuple, as attention modules do: its first element is the one watched."""

    def __init__(self, first: float, second: float) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * self.first, x * self.second


class _Lookup(nn.Module):
    """An output that is not a tensor (a dict of token ids): passed over, never a culprit."""

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"ids": torch.zeros_like(x, dtype=torch.long)}


class _OutOfOrder(nn.Module):
    """``late`` is registered first but runs second; ``body.1`` makes the first non-finite output."""

    def __init__(self, pair: _Pair | None = None) -> None:
        super().__init__()
        self.late = _Times(float("inf"))
        self.body = nn.Sequential(nn.Identity(), _Times(float("nan")), _Times(2.0))
        self.pair = pair or _Pair(1.0, 1.0)
        self.ids = _Lookup()

    def forward(self, x: Tensor) -> Any:
        self.ids(x)
        x = self.pair(x)[0]
        return self.late(self.body(x))


def _culprit(model: nn.Module, x: Tensor) -> str | None:
    with torch.no_grad(), watching_outputs(model) as (first, names):
        model(x)
    return names[first[0] - 1] if first[0] else None


def test_the_report_lists_each_rank_s_culprit_in_rank_order():
    report = nonfinite_report(7, float("nan"), 3.25, {2: "head", 0: "layers.1.mlp.0", 1: "embed"}, 0, ["x"])
    assert report == (
        "non-finite values at step 7 (gradient norm nan, mean loss 3.25)\n"
        "  rank 0: first non-finite output in forward order: layers.1.mlp.0\n"
        "  rank 1: first non-finite output in forward order: embed\n"
        "  rank 2: first non-finite output in forward order: head"
    )


def test_a_finite_forward_names_this_rank_s_modules_with_bad_gradients_in_order():
    report = nonfinite_report(12, float("inf"), float("-inf"), {}, 3, ["layers.2", "head"])
    assert report == (
        "non-finite values at step 12 (gradient norm inf, mean loss -inf)\n"
        "  the forward pass was finite on every rank; modules with non-finite gradients on rank 3: layers.2, head"
    )


def test_a_finite_forward_and_no_bad_gradient_here_says_none_here():
    assert nonfinite_report(1, 1e30, 0.5, {}, 1, []).splitlines() == [
        "non-finite values at step 1 (gradient norm 1e+30, mean loss 0.5)",
        "  the forward pass was finite on every rank; modules with non-finite gradients on rank 1: none here",
    ]


def test_the_watch_names_the_first_module_in_forward_order_not_registration_order_nor_its_container():
    model = _OutOfOrder()
    # ``late`` (registered first) and the container ``body`` (its hook fires after its children's) are not finite
    # either: the innermost module that ran first is the culprit.
    assert _culprit(model, torch.ones(2, 3)) == "body.1"


def test_the_watch_lists_every_named_submodule_in_registration_order_and_leaves_out_the_root():
    with watching_outputs(_OutOfOrder()) as (first, names):
        assert first == [0]
    assert names == ["late", "body", "body.0", "body.1", "body.2", "pair", "ids"]


def test_a_tuple_output_is_judged_by_its_first_element():
    assert _culprit(_OutOfOrder(_Pair(float("inf"), 1.0)), torch.ones(2)) == "pair"
    # A non-finite second element is not the watched one: the culprit is found further on.
    assert _culprit(_OutOfOrder(_Pair(1.0, float("nan"))), torch.ones(2)) == "body.1"


def test_a_finite_forward_leaves_the_watch_at_zero():
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    assert _culprit(model, torch.ones(4, 3)) is None


def test_outputs_that_are_not_tensors_or_are_empty_tuples_are_passed_over():
    class _Nothing(nn.Module):
        def forward(self, x: Tensor) -> tuple[()]:
            return ()

    model = nn.ModuleDict({"lookup": _Lookup(), "nothing": _Nothing(), "last": _Times(float("nan"))})
    with torch.no_grad(), watching_outputs(model) as (first, names):
        for module in model.values():
            module(torch.ones(2))
    assert names == ["lookup", "nothing", "last"]
    assert names[first[0] - 1] == "last"


def test_the_hooks_are_removed_when_the_block_ends_even_when_it_raises():
    model = _OutOfOrder()
    try:
        with watching_outputs(model) as (first, _):
            raise KeyError("inside")
    except KeyError:
        pass
    model(torch.ones(2))  # not finite again: a hook left behind would write 4 (body.1)
    assert first == [0]


def _piece(param: Tensor, values: list[float]) -> Piece:
    return Piece(param, torch.tensor(values), 1)


def test_bad_gradients_are_named_by_module_cut_to_depth_each_once_in_piece_order():
    params = [torch.zeros(1) for _ in range(5)]
    names = {
        id(params[0]): "layers.3.attn.qkv.weight",
        id(params[1]): "layers.3.mlp.weight",
        id(params[2]): "layers.0.mlp.weight",
        id(params[3]): "head.weight",
        id(params[4]): "embed.weight",
    }
    pieces = [
        _piece(params[0], [1.0, float("nan")]),
        _piece(params[1], [float("inf")]),
        _piece(params[2], [1.0, 2.0]),  # finite
        _piece(params[3], [-float("inf")]),
        _piece(params[4], []),  # an empty shard: nothing to judge
    ]
    assert nonfinite_gradient_modules(pieces, names, depth=2) == ["layers.3", "head"]
    assert nonfinite_gradient_modules(pieces, names, depth=3) == ["layers.3.attn", "layers.3.mlp", "head"]
    # Depth 0 (no groups) still names something: the top-level module.
    assert nonfinite_gradient_modules(pieces, names, depth=0) == ["layers", "head"]


def test_a_bad_gradient_of_an_unnamed_parameter_is_called_a_question_mark():
    unknown = torch.zeros(1)
    assert nonfinite_gradient_modules([_piece(unknown, [float("nan")])], {}, depth=2) == ["?"]
    assert nonfinite_gradient_modules([], {}, depth=2) == []
