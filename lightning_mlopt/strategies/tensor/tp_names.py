"""The names a tensor-parallel plan's glob that matches nothing was nearest to: what the user meant to write."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn


def nearest_names(glob: str, modules: Mapping[str, nn.Module], limit: int = 3) -> str:
    """The globs nearest ``glob`` that would match, as a sentence for its refusal: last name components compared.

    Example::

        nearest_names("*.qkv_proj", dict(llama.named_modules()))
        # " Nearest names: *.self_attn.q_proj, *.self_attn.k_proj, *.self_attn.v_proj"
    """
    # Names with their indices starred: `layers.*.attn.qvk` is near `layers.*.attn.qkv`, one suggestion for all.
    starred = list(dict.fromkeys(_starred(name) for name in modules if name))
    # What the user wrote after the last `*` is what they meant to name: `*.qkv_proj` compares `qkv_proj` with
    # each name's last component (a whole-name ratio ranks by the long shared prefix, not by that).
    tail = glob.rpartition("*")[2].lstrip(".") or glob
    depth = tail.count(".") + 1

    similarity = {
        name: difflib.SequenceMatcher(None, tail, ".".join(name.split(".")[-depth:])).ratio() for name in starred
    }
    ranked = sorted(starred, key=similarity.__getitem__, reverse=True)  # stable: ties keep the model's order
    # Only the names as near as the nearest: `*.qkv_proj` is as near q_proj, k_proj and v_proj, and nearer
    # them than o_proj, which would only crowd the suggestion.
    cutoff = max(0.6, similarity[ranked[0]] - 0.05) if ranked else 1.0
    close = [name for name in ranked if similarity[name] >= cutoff]
    suggestions = list(dict.fromkeys(_matching_glob(glob, name, depth, modules) for name in close))[:limit]
    if suggestions:
        return f" Nearest names: {', '.join(suggestions)}"
    # Nothing near: the modules a plan can split (Linear, Embedding) say more than the first few containers.
    splittable = [_starred(name) for name, child in modules.items() if isinstance(child, nn.Linear | nn.Embedding)]
    listed = dict.fromkeys(_matching_glob(glob, name, 1, modules) for name in splittable or starred)
    return f" Its modules include: {', '.join(list(listed)[:6])}"


def _starred(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _matching_glob(glob: str, starred: str, depth: int, modules: Mapping[str, nn.Module]) -> str:
    # A glob that starts with `*` gets a suggestion of its own shape, with one more name component for context
    # (`*.self_attn.q_proj`); a glob naming a whole path gets the whole starred name.
    parts = starred.split(".")
    shapes = [f"*.{'.'.join(parts[-n:])}" for n in (depth + 1, depth) if glob.startswith("*") and len(parts) > n]
    for shape in [shape for shape in shapes if not shape.startswith("*.*")] + [starred]:
        if any(fnmatchcase(name, shape) for name in modules if name):
            return shape
    return starred


__all__ = ["nearest_names"]
