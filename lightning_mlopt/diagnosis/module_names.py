"""Parameter and module names as a user reads them: grouped by module, without the LightningModule's wrapper."""

from __future__ import annotations


def module_group(name: str, depth: int) -> str:
    """The module a parameter belongs to, cut to ``depth`` components: ``layers.3.attn.qkv.weight`` -> ``layers.3``.

    Example::

        >>> module_group("layers.3.attn.qkv.weight", 2)
        'layers.3'
        >>> module_group("token_embedding.weight", 2)
        'token_embedding'
    """
    module_path = name.split(".")[:-1] or name.split(".")
    return ".".join(module_path[:depth])


def common_root(names: list[str]) -> str:
    """``model.`` when every parameter lives under one attribute of the LightningModule, else empty.

    Example::

        >>> common_root(["model.layers.0.weight", "model.head.bias"])
        'model.'
        >>> common_root(["encoder.weight", "head.bias"])
        ''
    """
    roots = {name.split(".", 1)[0] for name in names}
    return f"{roots.pop()}." if len(roots) == 1 and all("." in n for n in names) else ""
