"""A small GPT-style causal language model built from ``torch.nn``."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_mlopt.demos._progress import progress_bar_shown


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused, head-major QKV projection; tensor-parallel-correct.

    The fused projection's output features are laid out head by head (head 0's q, k and v, then head 1's...),
    and the head count is read from the width this rank holds: a column-wise split of ``qkv`` across
    tensor-parallel ranks gives each rank whole heads, and ``proj`` (row-wise) sums their outputs.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head  # the tensor-parallel plan check reads it: the split must keep whole heads
        self.head_dim = d_model // n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    @override
    def forward(self, x: Tensor) -> Tensor:
        batch, time, _ = x.shape
        # (B, T, heads * 3 * head_dim) -> (B, heads, T, 3 * head_dim): `heads` is this rank's, never fixed.
        qkv = self.qkv(x).view(batch, time, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        dropout = self.dropout if self.training else 0.0
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, time, -1))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    The unit that FSDP wraps and activation checkpointing recomputes: refer to it in YAML as
    ``lightning_mlopt.demos.gpt.TransformerBlock``.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` :class:`TransformerBlock` s, a final norm and an LM head."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, d_model: int, dropout: float
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.layers = nn.ModuleList(TransformerBlock(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        # No weight tying with the embedding: a tied weight is shared across FSDP units and ZeRO
        # partitions, which complicates sharding for no gain at this size.
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so activations stay O(1) with depth.
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @override
    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        # Positions from the batch when it has them: under context parallelism a rank holds a slice of the sequence.
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


class GPTLanguageModel(pl.LightningModule):
    """Causal language model for training-infrastructure work: small, deterministic, any size by YAML.

    Args:
        vocab_size: number of token ids.
        block_size: longest sequence (context length).
        n_layer: number of transformer blocks.
        n_head: attention heads; must divide ``d_model``.
        d_model: embedding width.
        dropout: dropout probability (0 keeps runs bitwise reproducible across strategies).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay (applied to matrices, not to biases and norms).
        warmup_steps: linear warm-up steps of the LR schedule; 0 keeps the LR constant. A config's
            ``optimizer:`` (and ``lr_scheduler:``) replaces this default AdamW and schedule; ``lr``,
            ``weight_decay`` and ``warmup_steps`` are then unused.

    Example::

        model = GPTLanguageModel(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
        logits = model(torch.randint(0, 256, (2, 64)))  # (2, 64, 256)

    """

    # Megatron's split, used by `trainer.strategy: tp` when the YAML gives no plan: column-wise then
    # row-wise in attention and in the MLP (one all-reduce each), the vocabulary split in the embedding, and
    # the LM head's logits gathered for the loss. Block size and norms stay whole on every rank.
    tp_plan = {
        "model.token_embedding": "embedding_rowwise",
        "model.layers.*.attn.qkv": "colwise",
        "model.layers.*.attn.proj": "rowwise",
        "model.layers.*.mlp.0": "colwise",
        "model.layers.*.mlp.2": "rowwise",
        "model.lm_head": "colwise_replicated",
    }

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"n_head ({n_head}) must divide d_model ({d_model})")
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.save_hyperparameters()
        self.tokens_per_sample = block_size  # read by PerformanceMonitor for perf/tokens_per_sec
        self.model = GPT(vocab_size, block_size, n_layer, n_head, d_model, dropout)

    @override
    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean next-token cross-entropy of ``output`` (logits) against ``target``.

        One micro-batch's loss under pipeline parallelism, and the loss of every step elsewhere.
        """
        return nn.functional.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def _loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        inputs, targets, *positions = batch  # (tokens, targets[, positions]): data.init_args.positions
        # The network directly, positions given: forward keeps one input for the pipeline's tracers.
        return self.pipeline_loss(self.model(inputs, *positions), targets)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=progress_bar_shown(self))
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test/loss", self._loss(batch), sync_dist=True)

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    @override
    def configure_optimizers(self) -> Any:
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for param in self.parameters():
            (decay if param.dim() >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams["lr"],
            betas=(0.9, 0.95),
        )
        warmup = self.hparams["warmup_steps"]
        if warmup == 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
