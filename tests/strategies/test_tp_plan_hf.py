"""The tensor-parallel plan check on real ``transformers`` models, built from their configs (no download).

transformers 5's attention modules hold no head counts of their own (they read them from their ``config``), and
GPT-2's projections are ``Conv1D`` (a transposed Linear): each plan that would start and crash in ``forward`` on
every rank is refused here, before any process group exists, with one line naming the cause and the fix.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from functools import cache
from pathlib import Path

import pytest
import yaml
from torch import nn

from lightning_mlopt.cli import main
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.tensor.tp_plan import resolve

transformers = pytest.importorskip("transformers")

from tests.support.user_models import HFCausalLM, llama, write_user_config  # noqa: E402  (needs transformers)

TP_HF = Path(__file__).resolve().parents[2] / "configs" / "strategies" / "tp_hf.yaml"
HF_PLAN: dict[str, str] = yaml.safe_load(TP_HF.read_text())["trainer"]["strategy"]["init_args"]["tp_plan"]
MLP_PLAN = {"*.gate_proj": "colwise", "*.up_proj": "colwise", "*.down_proj": "rowwise"}
ATTENTION = "model.model.layers.0.self_attn"


@cache
def _model(family: str = "llama", hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> HFCausalLM:
    # Cached: the checks only read the model, and each build costs a transformers model's initialisation.
    return HFCausalLM(family=family, hidden=hidden, heads=heads, kv_heads=kv_heads)  # type: ignore[arg-type]


def _refusal(module: nn.Module, plan: dict[str, str], size: int) -> str:
    with pytest.raises(BadInputError) as refused:
        resolve(module, plan, size)
    message = str(refused.value)
    assert "\n" not in message, "one line"
    return message


def test_the_counts_live_in_the_config_not_on_the_attention_module():
    # What the check has to cope with: if transformers gives its attention modules their counts back, the old
    # attribute path covers them again and this test says the config path is no longer the one exercised.
    attention = _model(kv_heads=1).get_submodule(ATTENTION)
    assert not hasattr(attention, "num_key_value_heads") and not hasattr(attention, "num_heads")
    config = attention.config
    assert (config.num_attention_heads, config.num_key_value_heads, attention.head_dim) == (4, 1, 16)


def test_one_key_value_head_cannot_be_split_two_ways():
    message = _refusal(_model(kv_heads=1), HF_PLAN, 2)
    assert message.startswith(
        f"tp_plan: {ATTENTION}.config.num_key_value_heads=1 does not divide by tensor_parallel_size=2 "
        f"(1 key/value head), and {ATTENTION}.k_proj is split: each rank must hold whole heads; "
    )
    assert f"1 key/value head cannot be split: leave {ATTENTION}'s projections out of the plan" in message
    # The config is shared by the MLP and the wrappers too: a plan that splits no attention is not refused.
    assert len(resolve(_model(kv_heads=1), MLP_PLAN, 2).styles) == 2 * 3


def test_three_query_heads_cannot_be_split_two_ways_and_the_message_says_which_sizes_can():
    # 48 wide: every projection's width divides by 2, only the heads do not.
    model = _model(hidden=48, heads=3, kv_heads=3)
    message = _refusal(model, HF_PLAN, 2)
    assert message.startswith(
        f"tp_plan: {ATTENTION}.config.num_attention_heads=3 does not divide by tensor_parallel_size=2 "
        f"(3 query heads), and {ATTENTION}.q_proj is split"
    )
    assert "use tensor_parallel_size 3, or leave" in message
    # Three ranks hold one head each (the 256-token vocabulary does not divide by 3: the blocks only).
    blocks = {glob: style for glob, style in HF_PLAN.items() if glob.endswith("_proj")}
    assert len(resolve(model, blocks, 3).styles) == 2 * 7


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_grouped_query_attention_splits_as_far_as_its_key_value_heads(family):
    # 4 query heads, 2 key/value heads: two ranks take one key/value head each; four ranks cannot.
    assert len(resolve(_model(family), HF_PLAN, 2).styles) == 2 + 2 * 7
    message = _refusal(_model(family), HF_PLAN, 4)
    assert f"{ATTENTION}.config.num_key_value_heads=2 does not divide by tensor_parallel_size=4" in message
    assert "use tensor_parallel_size 2, or leave" in message


def test_the_cli_refuses_a_one_key_value_head_llama_under_tp_hf_before_launch(tmp_path, monkeypatch, capsys):
    # Before the fix both ranks started and crashed in forward; now: exit 2, one line, nothing written.
    config = write_user_config(tmp_path, llama(kv_heads=1), accelerator="cpu", devices=2)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, "--config", str(TP_HF)])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("error: ") and f"{ATTENTION}.config.num_key_value_heads=1 does not divide" in message
    assert [path.name for path in tmp_path.iterdir()] == ["user.yaml"]


class _WidthsOnly(nn.Module):
    """An attention module that keeps only ``head_dim``: its projections' widths are all that count its heads."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 8
        self.q_proj = nn.Linear(32, 32)  # 4 query heads
        self.k_proj = nn.Linear(32, 8)  # 1 key/value head
        self.v_proj = nn.Linear(32, 8)
        self.o_proj = nn.Linear(32, 32)


def test_the_projection_widths_count_the_heads_where_nothing_else_does():
    plan = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise", "*.o_proj": "rowwise"}
    model = nn.ModuleDict({"attn": _WidthsOnly()})
    message = _refusal(model, plan, 2)
    assert message.startswith(
        "tp_plan: attn.k_proj.out_features/head_dim=8/8 does not divide by tensor_parallel_size=2 (1 key/value head)"
    )
    # The query side is four heads wide: splitting it alone is fine as far as heads go.
    assert resolve(model, {"*.q_proj": "colwise", "*.o_proj": "rowwise"}, 2).styles == {
        "attn.q_proj": "colwise",
        "attn.o_proj": "rowwise",
    }


def test_gpt2_fused_conv1d_projection_is_refused_as_a_transposed_linear():
    gpt2 = _model("gpt2")
    c_attn = gpt2.get_submodule("model.transformer.h.0.attn.c_attn")
    assert isinstance(c_attn, transformers.pytorch_utils.Conv1D) and not isinstance(c_attn, nn.Linear)
    message = _refusal(gpt2, {"*.c_attn": "colwise", "*.attn.c_proj": "rowwise"}, 2)
    assert message.startswith(
        "tp_plan: model.transformer.h.0.attn.c_attn (Conv1D) cannot be colwise: it is transformers' Conv1D, a "
        "transposed Linear (weight [in, out] = [64, 192]), and tensor-parallel plans split an nn.Linear"
    )
    assert "its output fuses q, k and v" in message
    assert "train this model with ddp, fsdp or zero instead, or convert its Conv1D modules to nn.Linear" in message
    # An unfused Conv1D (the MLP's) gets the same refusal, without the fused-projection part.
    message = _refusal(gpt2, {"*.mlp.c_fc": "colwise", "*.mlp.c_proj": "rowwise"}, 2)
    assert "model.transformer.h.0.mlp.c_fc (Conv1D) cannot be colwise" in message and "fuses" not in message


@pytest.mark.parametrize(
    ("glob", "suggested"),
    [
        ("*.qkv_proj", ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj"]),
        ("*.o_prj", ["*.self_attn.o_proj"]),  # o_proj is nearer than q/k/v_proj: they are left out
        ("*lmhead", ["*.lm_head"]),
        ("model.model.layer.*.self_attn.q_proj", ["model.model.layers.*.self_attn.q_proj"]),  # a whole path
    ],
)
def test_a_glob_that_matches_nothing_gets_the_nearest_globs_that_would(glob, suggested):
    model = _model()
    message = _refusal(model, {glob: "colwise"}, 2)
    assert message == f"tp_plan: {glob!r} matches no module of the model. Nearest names: {', '.join(suggested)}"
    names = [name for name, _ in model.named_modules() if name]
    assert all(any(fnmatchcase(name, glob) for name in names) for glob in suggested)


def test_a_glob_near_nothing_lists_the_modules_a_plan_can_split():
    message = _refusal(_model(), {"*.zzzz": "colwise"}, 2)
    listed = re.sub(r".*Its modules include: ", "", message).split(", ")
    assert listed[:3] == ["*.model.embed_tokens", "*.self_attn.q_proj", "*.self_attn.k_proj"]
    assert len(listed) == 6 and "model.model.layers" not in listed  # no containers
