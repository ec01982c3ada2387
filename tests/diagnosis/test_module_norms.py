"""ModuleNorms in-process: names and groups by depth, and its sums of squares against torch.linalg.vector_norm."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import Tensor, nn

from lightning_mlopt.diagnosis.module_norms import ModuleNorms
from lightning_mlopt.distributed.sharding import Piece, TensorSharding

CPU = torch.device("cpu")


class _Net(nn.Module):
    """layers.0, layers.1 and head under one wrapper attribute, as a LightningModule holds its model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Linear(3, 2), nn.Linear(2, 2)])
        self.model.head = nn.Linear(2, 1, bias=False)


class _Halves(TensorSharding):
    """A fake sharded strategy: this rank holds the first half of every flattened tensor, each on ``copies`` ranks."""

    def __init__(self, copies: int, names: tuple[str, ...] | None = None) -> None:
        self.copies = copies
        self.model_parameter_names = names

    def gradients_replicated(self, params: Sequence[Tensor]) -> bool:
        return False

    def gradient_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        for param in params:
            if param.grad is not None:
                flat = param.grad.reshape(-1)
                yield Piece(param, flat[: (flat.numel() + 1) // 2], self.copies)

    def parameter_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        for param in params:
            flat = param.detach().reshape(-1)
            yield Piece(param, flat[: (flat.numel() + 1) // 2], self.copies)


def _net_with_grads() -> _Net:
    """Every parameter and gradient set to known values (gradient k-th entry of parameter i: i + k/10)."""
    net = _Net()
    with torch.no_grad():
        for i, param in enumerate(net.parameters()):
            param.copy_(torch.linspace(-1.0, 1.0, param.numel()).reshape(param.shape) * (i + 1))
            param.grad = (i + torch.arange(param.numel(), dtype=torch.float32) / 10).reshape(param.shape)
    return net


def _squares(tensors: list[Tensor]) -> float:
    """The reference: the square of torch's vector norm of everything, concatenated."""
    if not tensors:
        return 0.0
    return torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors])).item() ** 2


def _grads(net: _Net, prefix: str) -> list[Tensor]:
    return [p.grad for name, p in net.named_parameters() if name.startswith(prefix)]  # type: ignore[misc]


def test_names_lose_the_single_wrapper_attribute_and_groups_follow_the_depth_in_parameter_order():
    net = _Net()
    norms = ModuleNorms(net, TensorSharding(), depth=2)
    assert norms.prefix == "model."
    assert sorted(norms.names.values()) == sorted(name[len("model.") :] for name, _ in net.named_parameters())
    assert norms.groups == ["layers.0", "layers.1", "head"]
    assert ModuleNorms(net, TensorSharding(), depth=1).groups == ["layers", "head"]
    assert ModuleNorms(net, TensorSharding(), depth=3).groups == ["layers.0", "layers.1", "head"]
    assert ModuleNorms(net, TensorSharding(), depth=0).groups == []


def test_a_module_with_several_top_level_attributes_keeps_its_names_whole():
    net = nn.Module()
    net.encoder, net.head = nn.Linear(2, 2), nn.Linear(2, 1)
    norms = ModuleNorms(net, TensorSharding(), depth=2)
    assert norms.prefix == ""
    assert sorted(norms.names.values()) == ["encoder.bias", "encoder.weight", "head.bias", "head.weight"]
    assert norms.groups == ["encoder", "head"]


def test_replicated_gradient_sums_match_torch_s_vector_norm_in_total_and_per_group():
    net = _net_with_grads()
    norms = ModuleNorms(net, TensorSharding(), depth=2)
    assert norms.replicated
    total, groups, device = norms.gradient_sums(per_group=True, default=CPU)
    assert device == CPU
    assert total.dtype == groups.dtype == torch.float32
    assert total.item() == pytest.approx(_squares(_grads(net, "")), rel=1e-6)
    expected = [_squares(_grads(net, f"model.{group}.")) for group in norms.groups]
    assert groups.tolist() == pytest.approx(expected, rel=1e-6)
    assert sum(expected) == pytest.approx(total.item(), rel=1e-6)
    # The figures themselves, not only their agreement: parameter 0 (layers.0.weight, 6 entries) has gradient
    # 0, 0.1, ..., 0.5, whose squares sum to 0.55; layers.0.bias: 1 and 1.1.
    assert groups[0].item() == pytest.approx(0.55 + 1.0 + 1.21, rel=1e-6)


def test_without_per_group_the_group_vector_is_zeros_of_the_right_length():
    net = _net_with_grads()
    total, groups, _ = ModuleNorms(net, TensorSharding(), depth=2).gradient_sums(per_group=False, default=CPU)
    assert groups.tolist() == [0.0, 0.0, 0.0]
    assert total.item() == pytest.approx(_squares(_grads(net, "")), rel=1e-6)


def test_parameters_without_a_gradient_count_zero_and_none_at_all_gives_zeros_on_the_default_device():
    net = _net_with_grads()
    net.model.layers[1].weight.grad = None
    net.model.layers[1].bias.grad = None
    norms = ModuleNorms(net, TensorSharding(), depth=2)
    total, groups, _ = norms.gradient_sums(per_group=True, default=CPU)
    assert groups[1].item() == 0.0
    assert total.item() == pytest.approx(_squares([g for g in _grads(net, "") if g is not None]), rel=1e-6)
    net.zero_grad(set_to_none=True)
    total, groups, device = norms.gradient_sums(per_group=True, default=torch.device("meta"))
    assert device == torch.device("meta")  # nothing held a gradient: the caller's device
    assert total.shape == () and groups.shape == (3,)


def test_the_cached_plan_keeps_the_groups_and_reads_each_step_s_new_gradients():
    net = _net_with_grads()
    norms = ModuleNorms(net, TensorSharding(), depth=1)
    first_total, first_groups, _ = norms.gradient_sums(per_group=True, default=CPU)
    for param in net.parameters():
        param.grad.mul_(3.0)  # type: ignore[union-attr]
    total, groups, _ = norms.gradient_sums(per_group=True, default=CPU)
    assert total.item() == pytest.approx(9.0 * first_total.item(), rel=1e-6)
    assert groups.tolist() == pytest.approx([9.0 * v for v in first_groups.tolist()], rel=1e-6)


def test_sharded_pieces_are_divided_by_their_replication():
    net = _net_with_grads()
    norms = ModuleNorms(net, _Halves(copies=4), depth=2)
    assert not norms.replicated
    total, groups, device = norms.gradient_sums(per_group=True, default=CPU)
    halves = [g.reshape(-1)[: (g.numel() + 1) // 2] for g in _grads(net, "")]
    assert device == CPU
    assert total.item() == pytest.approx(_squares(halves) / 4, rel=1e-6)
    head = net.model.head.weight.grad.reshape(-1)[:1]  # type: ignore[union-attr]
    assert groups[2].item() == pytest.approx(_squares([head]) / 4, rel=1e-6)
    # The parameters likewise: the held halves, divided by 4.
    param_total, param_groups = norms.parameter_sums(per_group=True, device=CPU)
    held = [p.detach().reshape(-1)[: (p.numel() + 1) // 2] for p in net.parameters()]
    assert param_total.item() == pytest.approx(_squares(held) / 4, rel=1e-6)
    assert param_groups.sum().item() == pytest.approx(param_total.item(), rel=1e-6)


def test_replicated_parameter_sums_are_the_whole_parameters_unweighted():
    net = _net_with_grads()
    norms = ModuleNorms(net, TensorSharding(), depth=2)
    total, groups = norms.parameter_sums(per_group=True, device=CPU)
    assert total.item() == pytest.approx(_squares(list(net.parameters())), rel=1e-6)
    assert groups[2].item() == pytest.approx(_squares([net.model.head.weight]), rel=1e-6)


def test_a_pipeline_stage_lays_its_groups_out_on_the_whole_model_s_names():
    stage = nn.Module()
    stage.model = nn.Module()
    stage.model.layers = nn.ModuleList([nn.Identity(), nn.Linear(2, 2, bias=False)])  # this rank: layers.1 only
    whole = ("model.embed.weight", "model.layers.0.weight", "model.layers.1.weight", "model.head.weight")
    norms = ModuleNorms(stage, _Halves(copies=1, names=whole), depth=2)
    assert norms.groups == ["embed", "layers.0", "layers.1", "head"]
    stage.model.layers[1].weight.grad = torch.tensor([[3.0, 4.0], [12.0, 0.0]])
    total, groups, _ = norms.gradient_sums(per_group=True, default=CPU)
    assert groups.tolist() == [0.0, 0.0, 25.0, 0.0]  # its half (3, 4), in the slot every rank agrees on
    assert total.item() == 25.0


def test_a_gradient_of_a_parameter_the_tables_do_not_know_is_refused():
    net = _net_with_grads()
    stranger = nn.Parameter(torch.ones(2))
    stranger.grad = torch.ones(2)

    class _WithStranger(_Halves):
        def gradient_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
            yield from super().gradient_pieces([*params, stranger])

    norms = ModuleNorms(net, _WithStranger(copies=1), depth=2)
    message = r"^GradNormMonitor: a gradient belongs to no known parameter \(did the model change\?\)$"
    with pytest.raises(RuntimeError, match=message):
        norms.gradient_sums(per_group=True, default=CPU)


def test_metrics_take_the_square_root_of_each_group_and_clamp_rounding_below_zero_to_zero():
    norms = ModuleNorms(_Net(), TensorSharding(), depth=2)
    assert norms.metrics("grad_norm", 5.0, [9.0, 16.0, -1e-9]) == {
        "grad_norm/total": 5.0,
        "grad_norm/layers.0": 3.0,
        "grad_norm/layers.1": 4.0,
        "grad_norm/head": 0.0,
    }
    assert ModuleNorms(_Net(), TensorSharding(), depth=0).metrics("p", 2.0, []) == {"p/total": 2.0}


def test_update_ratios_are_the_change_s_norm_over_the_new_parameters_norm_per_group_and_in_total():
    net = _net_with_grads()
    norms = ModuleNorms(net, TensorSharding(), depth=2)
    before = norms.snapshot_parameters()
    with torch.no_grad():
        net.model.layers[0].weight.add_(0.5)  # only layers.0 moves
    ratios = norms.update_ratios(before, world_size=1, default=CPU)
    layer0 = [net.model.layers[0].weight, net.model.layers[0].bias]
    change = 0.5 * torch.ones(6)
    assert set(ratios) == {"update_ratio/total", "update_ratio/layers.0", "update_ratio/layers.1", "update_ratio/head"}
    assert ratios["update_ratio/layers.0"] == pytest.approx((_squares([change]) / _squares(layer0)) ** 0.5, rel=1e-5)
    assert ratios["update_ratio/total"] == pytest.approx(
        (_squares([change]) / _squares(list(net.parameters()))) ** 0.5, rel=1e-5
    )
    assert ratios["update_ratio/layers.1"] == ratios["update_ratio/head"] == 0.0


def test_an_update_ratio_of_an_all_zero_group_is_zero_not_a_division_error():
    net = _Net()
    with torch.no_grad():
        for param in net.parameters():
            param.zero_()
    norms = ModuleNorms(net, TensorSharding(), depth=1)
    assert norms.update_ratios(norms.snapshot_parameters(), world_size=1, default=CPU) == {
        "update_ratio/total": 0.0,
        "update_ratio/layers": 0.0,
        "update_ratio/head": 0.0,
    }


def test_the_snapshot_is_a_copy_that_an_in_place_update_does_not_change():
    net = _net_with_grads()
    norms = ModuleNorms(net, TensorSharding(), depth=2)
    snapshot = norms.snapshot_parameters()
    expected = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for param in net.parameters():
            param.sub_(param.grad)  # type: ignore[arg-type]  # SGD's step at lr 1, in place
    assert all(torch.equal(copy, old) for copy, old in zip(snapshot, expected, strict=True))


def test_non_finite_gradients_are_named_by_group_and_at_depth_zero_by_top_module():
    net = _net_with_grads()
    net.model.layers[1].bias.grad[0] = float("nan")  # type: ignore[index]
    net.model.head.weight.grad[0, 1] = float("inf")  # type: ignore[index]
    assert ModuleNorms(net, TensorSharding(), depth=2).nonfinite_gradient_modules() == ["layers.1", "head"]
    assert ModuleNorms(net, TensorSharding(), depth=0).nonfinite_gradient_modules() == ["layers", "head"]
    # Sharded: only the half this rank holds is judged; head's infinity sits in the half it does not hold.
    assert ModuleNorms(net, _Halves(copies=2), depth=2).nonfinite_gradient_modules() == ["layers.1"]
