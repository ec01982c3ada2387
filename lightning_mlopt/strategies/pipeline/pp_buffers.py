"""Non-persistent buffers through the pipeline cut: a rotary table or a causal mask never enters a checkpoint."""

from __future__ import annotations

from torch import nn


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s buffers that its ``state_dict`` leaves out (``register_buffer(persistent=False)``).

    Example::

        non_persistent_buffers(llama)   # {'model.model.rotary_emb.inv_freq', ...}
    """
    return {name for name, _ in module.named_buffers()} - set(module.state_dict(keep_vars=True))


def keep_out_of_checkpoints(module: nn.Module, names: set[str]) -> None:
    """Register the buffers of ``module`` named in ``names`` as non-persistent again.

    The traced stages register every buffer they use as persistent (``torch.export`` does not carry the flag):
    a rotary table or a causal mask would enter the checkpoint and fail the strict load of any layout that
    builds the model as written. Called after :func:`install_stages`, with :func:`non_persistent_buffers` of
    the model before the cut.
    """
    for name, buffer in list(module.named_buffers()):
        if name in names:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)


__all__ = ["keep_out_of_checkpoints", "non_persistent_buffers"]
