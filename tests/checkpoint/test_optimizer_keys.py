"""Numbered and named optimizer states, matched through the live optimizer's groups (never the module's order)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mlopt.checkpoint.optimizer_keys import group_names, is_keyed_by_name, keyed_by_index, keyed_by_name
from lightning_mlopt.exceptions import BadInputError


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Biases first, then weights: the groups' order is not the module's (``first.weight, first.bias, ...``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": biases, "weight_decay": 0.0}, {"params": weights}], lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_numbered_state_is_named_in_the_optimizers_order_and_numbered_back():
    model, optimizer = _model_and_optimizer()
    live = group_names(optimizer, model)
    assert live == [["0.bias", "1.bias"], ["0.weight", "1.weight"]]
    numbered = optimizer.state_dict()
    named = keyed_by_name(numbered, live)
    assert is_keyed_by_name(named) and not is_keyed_by_name(numbered)
    for name, parameter in model.named_parameters():  # each moment is its own parameter's, by shape and value
        torch.testing.assert_close(named["state"][name]["exp_avg"], optimizer.state[parameter]["exp_avg"])
    assert named["param_groups"][0]["weight_decay"] == 0.0 and named["param_groups"][0]["params"] == live[0]
    back = keyed_by_index(named, live)
    assert back["param_groups"] == numbered["param_groups"]
    fresh_model, fresh = _model_and_optimizer()
    fresh.load_state_dict(back)
    for (_, mine), (_, theirs) in zip(model.named_parameters(), fresh_model.named_parameters(), strict=True):
        torch.testing.assert_close(fresh.state[theirs]["exp_avg_sq"], optimizer.state[mine]["exp_avg_sq"])


def test_other_groups_are_refused_with_the_first_difference_named():
    model, optimizer = _model_and_optimizer()
    named = keyed_by_name(optimizer.state_dict(), group_names(optimizer, model))
    with pytest.raises(BadInputError, match=r"parameter group 0 .* \(first difference: 0.weight\)"):
        keyed_by_index(named, [["0.bias", "0.weight"], ["1.bias", "1.weight"]])
    with pytest.raises(BadInputError, match=r"groups of sizes \[2, 2\]; this run's has \[4\]"):
        keyed_by_name(optimizer.state_dict(), [["0.bias", "1.bias", "0.weight", "1.weight"]])
