"""Bad input: one short message that names the file, key or value and the valid choices; exit status 2.

jsonargparse reports errors well but verbosely (usage text, every Union subtype tried, the whole value);
these helpers keep the part that names the cause, add the fix where we know it, and cap the length.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from lightning_mlopt.exceptions import BadInputError


class Renamed(NamedTuple):
    """What an earlier release called a setting, and what replaced it.

    Args:
        keys: dotted config keys -> their new key (``checkpoint.keep_last`` -> ``checkpoint.keep.last``).
        arguments: a class's name -> its old init arguments -> their new keys, for classes given by
            ``class_path`` (``NCCLHealthCheck``: ``hang_timeout`` -> ``watchdog.timeout``).

    """

    keys: Mapping[str, str]
    arguments: Mapping[str, Mapping[str, str]]


MAX_LINES = 15
_NOISE = re.compile(
    r"^\s*(Subtypes:|Given value type:|Errors:|- Expected a <class 'NoneType'>"
    r"|Does not validate against any of the Union subtypes)"
)
_CLASS = re.compile(r"<class '([\w.]+)'>")
_UNKNOWN = re.compile(r"(?:does not accept option|unrecognized arguments:)\s+'?-*([\w.]+)")
_NOT_ACCEPTED = re.compile(r"Option '(\w+)' is not accepted")
_RESTRICTION = re.compile(r"Not of type \w+: does not conform to restriction v\s*(.+)")  # NonNegativeFloat, ...
_BAD_CLASS = re.compile(r"Problem with given class_path '([\w.]+)'")
_RENAMED_LINE = re.compile(r"\bis now \S+ \(renamed in 0\.2; see CHANGELOG\.md\)")
_WHERE = re.compile(r" \(set (?:in [^)]*|on the command line)\)")
# Names other tools give a setting (the Hugging Face Trainer, Keras, hand-written scripts): an unknown key that
# is one of them is offered our key that means the same, e.g. `learning_rate` -> `model.init_args.lr`.
_SYNONYMS = {
    "learning_rate": ("lr",),
    "lr": ("learning_rate",),
    "wd": ("weight_decay",),
    "epochs": ("max_epochs",),
    "num_epochs": ("max_epochs",),
    "n_epochs": ("max_epochs",),
    "steps": ("max_steps",),
    "num_steps": ("max_steps",),
    "max_iters": ("max_steps",),
    "bs": ("batch_size",),
    "train_batch_size": ("batch_size",),
    "seed": ("seed_everything",),
    "workers": ("num_workers",),
    "gpus": ("devices",),
    "nodes": ("num_nodes",),
}
# What `model:` and `data:` can name without writing a class of one's own.
DEMO_CLASSES = {
    "model": ("lightning_mlopt.demos.ResNetClassifier", "lightning_mlopt.demos.GPTLanguageModel"),
    "data": (
        "lightning_mlopt.demos.DigitsDataModule",
        "lightning_mlopt.demos.CIFAR10DataModule",
        "lightning_mlopt.demos.TokenDataModule",
    ),
}


def config_paths(argv: Sequence[str]) -> list[str]:
    """The ``--config``/``-c`` file arguments of a command line, in order."""
    paths: list[str] = []
    for index, arg in enumerate(argv):
        if arg in ("--config", "-c") and index + 1 < len(argv):
            paths.append(argv[index + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def check_config_files(paths: Iterable[str]) -> None:
    """Fail fast, naming the file, when a config file is missing, unreadable or not valid YAML.

    Raises:
        BadInputError: with the file name and, for YAML errors, the line and column.

    """
    for path in paths:
        file = Path(path)
        if file.is_dir():
            inside = sorted(p.name for p in file.glob("*.yaml"))[:3]
            hint = f", e.g. {file / inside[0]}" if inside else ""
            raise BadInputError(f"--config {path} is a folder, not a file; give a YAML file{hint}")
        if not file.is_file():
            raise BadInputError(f"config file not found: {path} (working directory: {Path.cwd()})")
        try:
            content = yaml.safe_load(file.read_text())
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
            raise BadInputError(f"{path}: invalid YAML at {where}: {error.problem}") from None
        except (OSError, yaml.YAMLError) as error:
            raise BadInputError(f"{path}: cannot read it as YAML: {error}") from None
        if content is None:
            raise BadInputError(
                f"{path} is empty; a config file is a mapping of keys such as trainer:, model:, data: "
                "(see configs/quickstart.yaml), or leave it out"
            )
        if not isinstance(content, dict):
            raise BadInputError(f"{path}: a config file must be a mapping of keys, got {type(content).__name__}")


def explain_parser_error(
    message: str, known_keys: Iterable[str], argv: Sequence[str], renamed: Renamed | None = None
) -> str:
    """Shorten a jsonargparse error and add what fixes it: where the key was set and the valid choices.

    ``renamed``: keys and init arguments of an earlier release, named with what replaced them instead of a guess.
    """
    known = list(known_keys)
    kept = [line for line in message.splitlines() if line.strip() and not _NOISE.match(line)]
    lines = [_CLASS.sub(r"\1", line).replace("Expected a ", "expected ") for line in kept]
    lines = [_RESTRICTION.sub(r"expected a number \1", _shorten_value(line)) for line in lines]
    if len(lines) == 1:
        lines = [lines[0].strip().removeprefix("- ")]
    unknown = _UNKNOWN.search(message)
    if unknown:
        key = unknown.group(1)
        lines = [f"unknown key {key!r}{_where(key, argv)}", *_key_choices(key, [*known, *_init_keys(argv)])]
        if renamed and key in renamed.keys:
            lines = [f"{key}{_where(key, argv)} is now {renamed.keys[key]} (renamed in 0.2; see CHANGELOG.md)"]
        elif "." not in key:  # a bare name, as other tools write them: the keys it most likely meant to set
            lines += _init_key_lines(argv)
    else:
        key_match = re.match(r'Parser key "([\w.]+)"', lines[0]) if lines else None
        key = key_match.group(1) if key_match else ""
        nested = [found.group(1) for line in lines[1:] if (found := re.match(r"\s*- (\w+):\s*$", line))]
        if key and "." not in key and len(set(nested)) == 1:  # a class's init argument: name it, and where it is set
            lines = [line for line in lines[1:] if not re.match(r"\s*(- \w+:\s*$|got: NestedArg\()", line)]
            key = f"{key}.init_args.{nested[0]}"
            lines.insert(0, "")
        if key:
            lines[0] = f"{key}{_where(key, argv)}:"
        section = key.split(".")[0]
        bad_class = _BAD_CLASS.search(message)
        if bad_class and section in DEMO_CLASSES:
            lines.append(f"valid class_path values include: {', '.join(DEMO_CLASSES[section])}")
        not_accepted = _NOT_ACCEPTED.search(message)
        option = not_accepted.group(1) if not_accepted else ""
        moved = [
            f"{owner}: {option} is now {arguments[option]} (renamed in 0.2; see CHANGELOG.md)"
            for owner, arguments in (renamed.arguments.items() if renamed else ())
            if option in arguments
        ]
        if moved:  # an init argument of one of our classes that a settings group replaced
            lines = [lines[0], *moved] if key else moved
        elif not_accepted and section:
            accepted = _accepted_arguments(_class_path_of(section, argv))
            close = difflib.get_close_matches(not_accepted.group(1), accepted, n=3, cutoff=0.6)
            if close:
                lines.append(f"did you mean: {', '.join(f'{section}.init_args.{name}' for name in close)}?")
            if accepted:
                lines.append(f"valid keys under {section}.init_args: {', '.join(accepted)}")
    # A nested parser named the renamed key already: that line is the cause, the union's other tries are noise.
    explained = list(dict.fromkeys(line.strip().removeprefix("- ") for line in lines if _RENAMED_LINE.search(line)))
    if explained and not _RENAMED_LINE.search(lines[0]):
        lines = [lines[0], *(f"  {line}" for line in explained)]
    if len(lines) > MAX_LINES:
        lines = [*lines[: MAX_LINES - 1], "..."]
    return "\n".join(line.rstrip() for line in lines)


def _shorten_value(line: str) -> str:
    """``Given value: <long repr>`` -> ``got: <repr, cut at 80 characters>``."""
    if not line.lstrip().startswith("Given value:"):
        return line
    value = line.split(":", 1)[1].strip()
    return f"  got: {value if len(value) <= 80 else value[:77] + '...'}"


def raised_by_lightning(error: BaseException) -> bool:
    """Whether ``error`` was raised inside Lightning (an argument check, e.g. ``devices=two``), not in user code."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}lightning{os.sep}" in frames[-1].filename


def without_where(message: str) -> str:
    """A parser message without its ``(set in FILE)`` notes, for a caller that says itself where a key came from."""
    return _WHERE.sub("", message)


def close_keys(key: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Keys in ``known`` that ``key`` may have meant: close spellings, else keys whose last part matches it.

    The last part is compared by name and by synonym, so a bare key from another tool finds ours.

    Example::

        >>> close_keys("learning_rate", ["model.init_args.lr", "trainer.max_epochs"])
        ['model.init_args.lr']
        >>> close_keys("trainer.max_epoch", ["model.init_args.lr", "trainer.max_epochs"])
        ['trainer.max_epochs']
    """
    candidates = sorted(set(known))
    matches = difflib.get_close_matches(key, candidates, n=n, cutoff=0.6)
    if matches:
        return matches
    by_last: dict[str, list[str]] = {}
    for candidate in candidates:
        by_last.setdefault(candidate.rsplit(".", 1)[-1], []).append(candidate)
    last = key.rsplit(".", 1)[-1].lower().replace("-", "_")
    names = [name for name in (last, *_SYNONYMS.get(last, ())) if name in by_last]
    names = names or difflib.get_close_matches(last, list(by_last), n=n, cutoff=0.75)
    # The model's and the data's own arguments first: what a sweep or a one-off override usually means.
    found = [candidate for name in names for candidate in by_last[name]]
    return sorted(found, key=lambda candidate: (not candidate.startswith(("model.", "data.")), len(candidate)))[:n]


def _init_keys(argv: Sequence[str]) -> list[str]:
    """``model.init_args.<name>`` and ``data.init_args.<name>`` for the classes the command line configures."""
    return [
        f"{section}.init_args.{name}"
        for section in ("model", "data")
        for name in _accepted_arguments(_class_path_of(section, argv))
    ]


def _init_key_lines(argv: Sequence[str]) -> list[str]:
    """``valid keys under model.init_args: ...`` and the same for ``data``, for the classes configured."""
    lines = []
    for section in ("model", "data"):
        accepted = _accepted_arguments(_class_path_of(section, argv))
        if accepted:
            lines.append(f"valid keys under {section}.init_args: {', '.join(accepted)}")
    return lines


def _key_choices(key: str, known: list[str]) -> list[str]:
    """Lines of "did you mean" for an unknown dotted key."""
    matches = close_keys(key, known)
    if matches:
        return [f"did you mean: {', '.join(matches)}?"]
    section = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = sorted(k.rsplit(".", 1)[1] for k in known if section and k.startswith(section + "."))
    return [f"valid keys under {section}: {', '.join(siblings)}"] if siblings else []


def _where(key: str, argv: Sequence[str]) -> str:
    """`` (set on the command line)`` or `` (set in FILE)`` for the last place that sets the dotted key."""
    if any(arg == f"--{key}" or arg.startswith(f"--{key}=") for arg in argv):
        return " (set on the command line)"
    for path in reversed(config_paths(argv)):
        if _lookup(_load(path), key) is not _MISSING:
            return f" (set in {path})"
    return ""


def _load(path: str) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None


def _lookup(node: Any, key: str) -> Any:
    """The value at a dotted key of a loaded config, looking through ``init_args``; _MISSING if absent."""
    for part in key.split("."):
        if isinstance(node, dict) and part not in node and isinstance(node.get("init_args"), dict):
            node = node["init_args"]
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _class_path_of(section: str, argv: Sequence[str]) -> str | None:
    """The class_path the command line or config files give a section (the last one wins)."""
    for arg in reversed(argv):
        if arg.startswith(f"--{section}.class_path=") or arg.startswith(f"--{section}="):
            return arg.split("=", 1)[1]
    for path in reversed(config_paths(argv)):
        value = _lookup(_load(path), f"{section}.class_path")
        if isinstance(value, str):
            return value
    return None


def _accepted_arguments(class_path: str | None) -> list[str]:
    """Constructor arguments of a class, following ``**kwargs`` into its parents as jsonargparse does."""
    if not class_path or "." not in class_path:
        return []
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return []
    names: list[str] = []
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[1:]
        names += [p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return list(dict.fromkeys(names))


_MISSING = object()
