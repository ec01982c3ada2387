"""A sweep file, checked, and the trials it names: grid or random draws, as ``--key=value`` arguments."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_mlopt.exceptions import BadInputError

_LOCAL_DISTRIBUTIONS = ("uniform", "log_uniform_values", "int_uniform", "q_uniform", "normal", "categorical")
Trial = dict[str, Any]


@dataclass(frozen=True)
class SweepSpec:
    """A sweep file, checked.

    Attributes:
        method: ``grid``, ``random`` or ``bayes``.
        metric: the logged metric that ranks trials (a key of ``metrics.json``, e.g. ``val/acc``).
        goal: ``maximize`` or ``minimize``.
        parameters: dotted CLI key -> W&B parameter spec (``value``, ``values``, or a distribution).
        run_cap: the most trials to run (random search needs it, or ``--count``).
        raw: the file's content, as W&B receives it.
        path: the file it was read from, named in messages about its keys.

    Example::

        spec = load_sweep("lr_sweep.yaml")
        trials = grid_trials(spec)  # [{"model.init_args.lr": 0.01}, ...]

    """

    method: str
    metric: str
    goal: str
    parameters: dict[str, dict[str, Any]]
    run_cap: int | None
    raw: dict[str, Any]
    path: str = "the sweep file"


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and check a sweep file.

    Raises:
        BadInputError: naming the file and what is wrong in it.

    """
    where = Path(path)
    if not where.is_file():
        raise BadInputError(f"sweep file not found: {where}")
    try:
        raw = yaml.safe_load(where.read_text()) or {}
    except yaml.YAMLError as error:
        raise BadInputError(f"{where} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise BadInputError(f"{where}: expected a mapping with method, metric and parameters")
    method = raw.get("method", "grid")
    if method not in ("grid", "random", "bayes"):
        raise BadInputError(f"{where}: method must be grid, random or bayes; got {method!r}")
    metric = raw.get("metric") or {}
    if not isinstance(metric, dict) or not metric.get("name"):
        raise BadInputError(f"{where}: metric.name is required (e.g. metric: {{name: val/acc, goal: maximize}})")
    goal = metric.get("goal", "minimize")
    if goal not in ("maximize", "minimize"):
        raise BadInputError(f"{where}: metric.goal must be maximize or minimize; got {goal!r}")
    parameters = raw.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise BadInputError(f"{where}: parameters is empty; name at least one dotted key to sweep")
    for key, spec in parameters.items():
        if isinstance(spec, dict) and "parameters" in spec:
            raise BadInputError(f"{where}: parameters.{key}: write nested keys dotted (model.init_args.lr)")
        if not isinstance(spec, dict) or not ({"value", "values", "distribution", "min"} & spec.keys()):
            raise BadInputError(f"{where}: parameters.{key} needs value, values, or a distribution with min/max")
        if "values" in spec and (not isinstance(spec["values"], list) or not spec["values"]):
            # An empty grid axis makes zero trials, and random search has nothing to draw from.
            raise BadInputError(
                f"{where}: parameters.{key}.values must be a non-empty list, got {spec['values']!r}; "
                "give at least one, e.g. values: [0.001, 0.01] (or value: 0.01 to hold it fixed)"
            )
    run_cap = raw.get("run_cap")
    if run_cap is not None and (not isinstance(run_cap, int) or run_cap < 1):
        raise BadInputError(f"{where}: run_cap must be a positive integer; got {run_cap!r}")
    return SweepSpec(method, str(metric["name"]), goal, parameters, run_cap, raw, str(where))


def grid_trials(spec: SweepSpec) -> list[Trial]:
    """Every combination of the parameters' values, in file order.

    Example::

        >>> spec = SweepSpec("grid", "m", "minimize", {"a": {"values": [1, 2]}, "b": {"value": 0}}, None, {})
        >>> grid_trials(spec)
        [{'a': 1, 'b': 0}, {'a': 2, 'b': 0}]
    """
    choices = []
    for key, parameter in spec.parameters.items():
        if "value" in parameter:
            choices.append([parameter["value"]])
        elif "values" in parameter:
            choices.append(list(parameter["values"]))
        else:
            raise BadInputError(f"grid search needs values for every parameter; {key} has a distribution")
    return [dict(zip(spec.parameters, values, strict=True)) for values in itertools.product(*choices)]


def random_trials(spec: SweepSpec, count: int, seed: int) -> list[Trial]:
    """``count`` independent draws from the parameters' distributions; the same seed draws the same trials."""
    generator = random.Random(seed)
    return [{key: _draw(key, parameter, generator) for key, parameter in spec.parameters.items()} for _ in range(count)]


def _draw(key: str, parameter: dict[str, Any], generator: random.Random) -> Any:
    if "value" in parameter:
        return parameter["value"]
    if "values" in parameter and parameter.get("distribution", "categorical") == "categorical":
        return generator.choice(list(parameter["values"]))
    kind = parameter.get("distribution", "int_uniform" if isinstance(parameter.get("min"), int) else "uniform")
    if kind not in _LOCAL_DISTRIBUTIONS:
        raise BadInputError(f"parameters.{key}: distribution {kind!r} is W&B-only; use --mode wandb or values")
    if kind == "normal":
        return generator.gauss(float(parameter.get("mu", 0.0)), float(parameter.get("sigma", 1.0)))
    low, high = parameter.get("min"), parameter.get("max")
    if low is None or high is None or float(low) > float(high):
        raise BadInputError(f"parameters.{key}: {kind} needs min <= max; got min={low!r}, max={high!r}")
    if kind == "int_uniform":
        return generator.randint(int(low), int(high))
    if kind == "log_uniform_values":
        if float(low) <= 0:
            raise BadInputError(f"parameters.{key}: log_uniform_values needs min > 0; got {low!r}")
        return math.exp(generator.uniform(math.log(float(low)), math.log(float(high))))
    value = generator.uniform(float(low), float(high))
    if kind == "q_uniform":
        step = float(parameter.get("q", 1.0))
        value = round(value / step) * step
    return value


def local_trials(spec: SweepSpec, count: int | None, seed: int) -> list[Trial]:
    """The trials a local sweep runs: the grid (its first ``count``), or ``count`` random draws.

    ``count`` None takes the file's ``run_cap``.

    Raises:
        BadInputError: a method only the W&B server runs (bayes), or random search without a count.

    """
    count = count or spec.run_cap
    if spec.method == "bayes":
        raise BadInputError("method: bayes needs the W&B server (--mode wandb); use grid or random here")
    if spec.method == "grid":
        return grid_trials(spec)[:count] if count else grid_trials(spec)
    if count is None:
        raise BadInputError("random search needs a number of trials: --count N, or run_cap in the file")
    return random_trials(spec, count, seed)


def trial_arguments(trial: Trial) -> list[str]:
    """``--key=value`` arguments, the form W&B's ``${args}`` passes to an agent's command.

    Example::

        >>> trial_arguments({"model.init_args.lr": 0.1, "trainer.deterministic": True})
        ['--model.init_args.lr=0.1', '--trainer.deterministic=true']
    """
    return [f"--{key}={_format_value(value)}" for key, value in trial.items()]


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def check_trials(base_args: Sequence[str], spec: SweepSpec, trials: Sequence[Trial]) -> None:
    """Parse the base config, each swept key, then every trial, as ``fit`` would; nothing is built.

    Raises:
        BadInputError: naming the base config, the swept key or the trial, with the parser's reason.

    """
    from lightning_mlopt.cli.bad_input import without_where
    from lightning_mlopt.cli.check import ArgumentChecker

    check_arguments = ArgumentChecker()  # one parser for every command line below

    try:
        check_arguments(base_args)
    except BadInputError as error:
        raise BadInputError(f"the base config does not parse:\n{error}") from None
    for key, parameter in spec.parameters.items():
        # Each key alone first, with its bounds or first value, so the message names the key. It names the
        # sweep file as where the key was set: the parser sees it as a command-line argument.
        for probe in _probe_values(parameter):
            try:
                check_arguments([*base_args, *trial_arguments({key: probe})])
            except BadInputError as error:
                raise BadInputError(
                    f"sweep parameter {key!r} (value {probe!r}) in {spec.path}:\n{without_where(str(error))}"
                ) from None
    for number, trial in enumerate(trials):
        try:
            check_arguments([*base_args, *trial_arguments(trial)])
        except BadInputError as error:
            raise BadInputError(f"trial {number} ({describe_trial(trial)}):\n{error}") from None


def _probe_values(parameter: dict[str, Any]) -> list[Any]:
    if "value" in parameter:
        return [parameter["value"]]
    if "values" in parameter:
        return list(parameter["values"])
    return [parameter[bound] for bound in ("min", "max") if bound in parameter]


def describe_trial(trial: Trial) -> str:
    """A short description of a trial's values for progress lines: ``lr=0.01, weight_decay=0.0001``."""
    return ", ".join(
        f"{key.rsplit('.', 1)[-1]}={value:.4g}" if isinstance(value, float) else f"{key.rsplit('.', 1)[-1]}={value}"
        for key, value in trial.items()
    )
