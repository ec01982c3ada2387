"""Synthetic token streams for the GPT demo: a sparse Markov chain, so the loss has something to learn."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_mlopt.demos._loader import InMemoryTensors, LoaderDataModule


def markov_sequences(num_sequences: int, length: int, vocab_size: int, branching: int, seed: int) -> Tensor:
    """Sample ``(num_sequences, length)`` token ids from a fixed random chain with ``branching`` successors.

    The chain's table depends on ``vocab_size`` and ``branching`` only, so every split and rank shares it;
    the best achievable loss is ``log(branching)``.
    """
    table = torch.randint(0, vocab_size, (vocab_size, branching), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(num_sequences, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab_size, (num_sequences,), generator=generator)
    choices = torch.randint(0, branching, (num_sequences, length), generator=generator)
    for position in range(1, length):  # vectorised over sequences; `length` is the context, ~64-1024
        tokens[:, position] = table[tokens[:, position - 1], choices[:, position]]
    return tokens


class TokenDataModule(LoaderDataModule):
    """Next-token prediction on synthetic Markov-chain streams; items are ``(tokens[:-1], tokens[1:])``.

    With ``positions``, items are ``(tokens[:-1], tokens[1:], positions)``: context parallelism splits each
    sequence across ranks, and the model takes its positions from the batch (``configs/strategies/cp.yaml``).

    Args:
        vocab_size: token ids are in ``[0, vocab_size)``; match the model's.
        block_size: tokens per training sequence; at most the model's ``block_size``.
        num_sequences: training sequences (validation gets a tenth, at least one batch).
        branching: successors per token in the chain; the loss floor is ``log(branching)``.
        positions: add each token's position (``0 .. block_size - 1``) as a third tensor of the batch.
        **loader: DataLoader knobs, see :class:`LoaderDataModule`.

    Example::

        data = TokenDataModule(vocab_size=256, block_size=64, num_sequences=2048, batch_size=16)

    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        num_sequences: int = 2048,
        branching: int = 4,
        positions: bool = False,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        for name, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("num_sequences", num_sequences),
            ("branching", branching),
        ):
            if value < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_sequences = num_sequences
        self.branching = branching
        self.positions = positions

    def _split(self, num_sequences: int, seed: int) -> InMemoryTensors:
        tokens = markov_sequences(num_sequences, self.block_size + 1, self.vocab_size, self.branching, seed)
        if not self.positions:
            return InMemoryTensors(tokens[:, :-1], tokens[:, 1:])
        positions = torch.arange(self.block_size).expand(num_sequences, -1)
        return InMemoryTensors(tokens[:, :-1], tokens[:, 1:], positions)

    @override
    def setup(self, stage: str) -> None:
        self.train_set = self._split(self.num_sequences, seed=1)
        self.val_set = self._split(max(self.batch_size, self.num_sequences // 10), seed=2)
