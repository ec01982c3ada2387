"""Models shaped as users bring them: tiny Hugging Face models built from their configs, and a nanoGPT.

Nobody here wrote these shapes, which is the point: each breaks something our demos never show.

- :class:`HFCausalLM`: a LightningModule as a user writes one around ``transformers``' ``*ForCausalLM``, built
  from its config (no download) in three families that differ where parallelism and checkpoints care:

  ========= =========================================================================================
  llama     grouped-query attention (fewer key/value heads), a non-persistent rotary buffer, no biases
  gpt2      ``Conv1D`` (a transposed Linear) and a fused ``c_attn``: what a tensor plan must refuse
  qwen2     biases on q/k/v, GQA, sliding-window attention in its config
  ========= =========================================================================================

- :class:`NanoGPT`: a hand-written transformer as nanoGPT writes it, with its blocks in a ``ModuleList`` that is
  a direct child of the LightningModule, tied input/output embeddings left untied, and a non-persistent causal
  mask buffer.

Both train on the GPT demo's token data (``(inputs, targets)`` batches, or dicts of ``input_ids``/``labels``; with
positions from the batch, the Hugging Face model takes them as ``position_ids``: :class:`DictTokens`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import yaml
from torch import Tensor, nn

from lightning_mlopt.demos import TokenDataModule
from lightning_mlopt.demos._loader import InMemoryTensors
from tests.conftest import CONFIGS

Family = Literal["llama", "gpt2", "qwen2"]


def hf_config(
    family: Family, vocab_size: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2
) -> Any:
    """A tiny ``transformers`` config of ``family`` (GPT-2 has no GQA: ``kv_heads`` is ignored there)."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size, n_positions=128, n_embd=hidden, n_layer=layers, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    if family == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    return transformers.LlamaConfig(**common)


class _TokenSteps(pl.LightningModule):
    """The steps a user writes once for a causal LM: the loss from the logits, as ``pipeline_loss`` needs it."""

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def _loss(self, batch: Any) -> Tensor:
        inputs, targets, positions = _unpack(batch)
        logits = self(inputs) if positions is None else self(inputs, positions)  # positions: context parallelism
        return self.pipeline_loss(logits, targets)


class HFCausalLM(_TokenSteps):
    """A user's LightningModule around a ``transformers`` causal LM built from its config; AdamW at a fixed rate.

    Its loss is computed here from the logits (as ``pipeline_loss`` needs it), so one process and every layout
    compute the same thing.
    """

    def __init__(
        self,
        family: Family = "llama",
        vocab_size: int = 256,
        hidden: int = 64,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        import transformers

        self.save_hyperparameters()
        config = hf_config(family, vocab_size, hidden, layers, heads, kv_heads)
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, tokens: Tensor, position_ids: Tensor | None = None) -> Tensor:
        return self.model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class _NanoBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)
        # nanoGPT's causal mask: recomputed at construction, so never part of a checkpoint.
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
        att = att.masked_fill(~self.bias[:, :, :time, :time], float("-inf")).softmax(dim=-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).reshape(batch, time, channels))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(_TokenSteps):
    """nanoGPT's shape: ``wte``, ``wpe``, ``layers`` (a root ``ModuleList``), ``ln_f``, ``lm_head``."""

    def __init__(
        self, vocab_size: int = 256, block_size: int = 64, n_layer: int = 2, n_head: int = 4, d_model: int = 64
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.layers = nn.ModuleList(_NanoBlock(d_model, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _unpack(batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(inputs, targets, positions or None)`` of a tuple batch, or of a dict (``input_ids``, ``labels``, ...)."""
    if isinstance(batch, dict):
        return batch["input_ids"], batch["labels"], batch.get("position_ids")
    inputs, targets, *positions = batch
    return inputs, targets, positions[0] if positions else None


class DictTokens(TokenDataModule):
    """The GPT demo's token data as Hugging Face users batch it: dicts of input_ids, labels, position_ids.

    ``ignored_prefix``: sequence ``i``'s first ``7 i mod 40`` labels are -100 (a prompt, say), so the halves of a
    batch hold unequal counts of labelled tokens.
    """

    def __init__(self, ignored_prefix: bool = False, **token_data: Any) -> None:
        super().__init__(**token_data)
        self.ignored_prefix = ignored_prefix

    def _split(self, num_sequences: int, seed: int) -> InMemoryTensors:
        inputs, labels, *rest = super()._split(num_sequences, seed).tensors
        if self.ignored_prefix:
            labels = labels.clone()
            for index in range(num_sequences):
                labels[index, : (7 * index) % 40] = -100
        return _InMemoryDicts(inputs, labels, *rest)


class _InMemoryDicts(InMemoryTensors):
    def __getitems__(self, indices: list[int]) -> dict[str, Tensor]:  # type: ignore[override]
        return dict(zip(("input_ids", "labels", "position_ids"), super().__getitems__(indices), strict=False))


def write_user_config(folder: Path, model: dict[str, Any], name: str = "user.yaml", **trainer: Any) -> str:
    """A config file in ``folder`` training ``model`` (a class_path/init_args dict) on the GPT demo's data."""
    data = yaml.safe_load((CONFIGS / "gpt.yaml").read_text())["data"]
    data["init_args"].update(num_sequences=512, batch_size=8)
    config = {"seed_everything": 1234, "model": model, "data": data, "trainer": dict(trainer)}
    (folder / name).write_text(yaml.safe_dump(config))
    return str(folder / name)


def llama(**init_args: Any) -> dict[str, Any]:
    """The model block of a config training :class:`HFCausalLM` (Llama unless ``family`` says otherwise)."""
    return {"class_path": "tests.support.user_models.HFCausalLM", "init_args": init_args}


def nanogpt(**init_args: Any) -> dict[str, Any]:
    """The model block of a config training :class:`NanoGPT`."""
    return {"class_path": "tests.support.user_models.NanoGPT", "init_args": init_args}
