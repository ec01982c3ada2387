"""``python -m lightning_mlopt k8s --config X.yaml --image IMG``: a Kubernetes manifest for the same run.

The same YAML (and overlays, and ``--a.b=v`` overrides) as ``fit``, checked the same way, becomes a JobSet (or
a Kubeflow TrainJob, or a PyTorchJob) whose pods run ``python -m lightning_mlopt launch ... fit`` as PID 1,
restart on preemption without spending their restart budget, fail at once on bad input, and resume from the
run directory on a PersistentVolumeClaim. The resolved config goes in a ConfigMap beside it, unedited (a
config holding a secret is refused: secrets go through ``--secret_env``). See ``k8s_manifests.py`` for what
each scheduler does with the launcher's exit statuses.

Example::

    python -m lightning_mlopt k8s --config configs/gpt.yaml --image registry.example/gpt:1 \
        --nodes 2 --gpus_per_node 8 --checkpoint_claim ckpt --queue team-a > gpt.yaml
    kubectl apply -f gpt.yaml
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.redaction import redact
from lightning_mlopt.run_dir import CONFIG_NAME, config_fingerprint
from lightning_mlopt.tools._preamble import (
    WRITTEN_BY,
    ToolArgumentParser,
    bad_input,
    check_output,
    fit_arguments,
    without_options,
)
from lightning_mlopt.tools.k8s_manifests import (
    ManifestSpec,
    config_map_manifest,
    jobset_manifest,
    pytorchjob_manifest,
    trainjob_manifests,
)
from lightning_mlopt.tools.slurm import check_task_count

FLAVORS = ("jobset", "trainjob", "pytorchjob")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_NAME = 40  # pod names add "-node-<i>-<j>" (and TrainJob "-runtime") within the 63-character DNS limit
_SECRET_REF = re.compile(r"^([A-Z_][A-Z0-9_]*)=([a-z0-9]([-.a-z0-9]*[a-z0-9])?):([-._a-zA-Z0-9]+)$")


class _BlockDumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (the ConfigMap's config) written as readable ``|`` blocks."""


def _block_strings(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_BlockDumper.add_representer(str, _block_strings)


def _parser() -> argparse.ArgumentParser:
    parser = ToolArgumentParser(
        prog="python -m lightning_mlopt k8s",
        description="Print a Kubernetes manifest for `fit`. Other arguments (e.g. --trainer.max_steps=1000) go to fit.",
    )
    parser.add_argument("--config", "-c", action="append", required=True, help="config file(s), in order")
    parser.add_argument("--image", required=True, help="container image with lightning_mlopt and the model's code")
    parser.add_argument("--flavor", choices=FLAVORS, default="jobset", help="default: jobset")
    parser.add_argument("--nodes", type=int, default=1, help="pods, one per node (default 1)")
    parser.add_argument("--gpus_per_node", type=int, default=1, help="GPUs per pod, one worker each; 0: CPU")
    parser.add_argument("--cpu_workers", type=int, default=1, help="workers per pod with --gpus_per_node 0")
    parser.add_argument("--checkpoint_mount", default="/checkpoints", help="where the claim is mounted in the pods")
    parser.add_argument("--config_mount", default="/etc/lightning_mlopt", help="where the config is mounted")
    parser.add_argument("--queue", default=None, help="a Kueue LocalQueue (adds the kueue.x-k8s.io/queue-name label)")
    parser.add_argument("--grace_s", type=int, default=30, help="seconds from SIGTERM to the kill, for the workers")
    parser.add_argument("--max_restarts", type=int, default=3, help="restarts for failures other than preemption")
    parser.add_argument(
        "--checkpoint_claim",
        required=True,
        help="the PersistentVolumeClaim for run directories; 'none': an emptyDir, lost when a pod restarts",
    )
    parser.add_argument("--name", default=None, help="the run's name (a DNS label); default: config stems + hash")
    parser.add_argument("--namespace", default=None)
    parser.add_argument(
        "--secret_env",
        action="append",
        default=[],
        metavar="VAR=SECRET:KEY",
        help="an environment variable read from a Secret, e.g. WANDB_API_KEY=wandb:api-key (repeatable)",
    )
    parser.add_argument("--output", default=None, help="write the manifest to this file instead of stdout")
    return parser


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt k8s``; returns the exit status (2 on bad input)."""
    options, extra = _parser().parse_known_args(list(argv))
    fit_args = fit_arguments(options.config, without_options(extra, ["--run_dir"]))
    try:
        _check_options(options)
        config = _checked_config(fit_args, options)
        spec = _spec(options, config)
        documents = _documents(options.flavor, spec, _resolved_config_text(fit_args))
    except BadInputError as error:
        return bad_input(error)
    text = yaml.dump_all(documents, Dumper=_BlockDumper, sort_keys=False, width=120)
    if options.output:
        # The header marks the file as ours: a rerun with the same --output may replace it, nothing else.
        Path(options.output).write_text(f"{WRITTEN_BY}; apply with: kubectl apply -f {options.output}\n{text}")
        sys.stderr.write(
            f"Wrote {options.output}: {_summary(options, spec)}. Apply with: kubectl apply -f {options.output}\n"
        )
    else:
        sys.stdout.write(text)
    return 0


def _check_options(options: argparse.Namespace) -> None:
    """The flags alone, before the config is parsed (cheap)."""
    if options.nodes < 1 or options.gpus_per_node < 0 or options.cpu_workers < 1:
        raise BadInputError("--nodes and --cpu_workers must be >= 1, --gpus_per_node >= 0")
    if options.gpus_per_node and options.cpu_workers != 1:
        raise BadInputError("--cpu_workers is for CPU pods (--gpus_per_node 0); with GPUs there is one worker per GPU")
    for name in ("checkpoint_mount", "config_mount"):
        if not getattr(options, name).startswith("/"):
            raise BadInputError(f"--{name} {getattr(options, name)!r}: an absolute path in the pod")
    if options.grace_s < 5:
        raise BadInputError(f"--grace_s must be >= 5 (a signal save needs time), got {options.grace_s}")
    if options.max_restarts < 0:
        raise BadInputError(f"--max_restarts must be >= 0, got {options.max_restarts}")
    for name in ("name", "namespace", "queue", "checkpoint_claim"):
        value = getattr(options, name)
        if value is not None and not _DNS_LABEL.match(value):
            raise BadInputError(f"--{name} {value!r}: a DNS label (lower-case letters, digits, '-'; a letter first)")
    if options.name is not None and len(options.name) > _MAX_NAME:
        raise BadInputError(f"--name {options.name!r}: at most {_MAX_NAME} characters (pod names add to it)")
    for reference in options.secret_env:
        if not _SECRET_REF.match(reference):
            raise BadInputError(f"--secret_env {reference!r}: give VAR=SECRET:KEY, e.g. WANDB_API_KEY=wandb:api-key")
    if options.output and not Path(options.output).parent.is_dir():
        raise BadInputError(f"--output {options.output}: the folder {Path(options.output).parent} does not exist")
    if options.output:
        check_output(Path(options.output), "--output", "manifest.yaml")


def _checked_config(fit_args: list[str], options: argparse.Namespace) -> dict[str, Any]:
    """The composed config, parsed and checked as ``fit`` would, and its trainer against the placement."""
    from lightning_mlopt.cli.check import check_arguments

    config = check_arguments(fit_args).as_dict()
    trainer = config.get("trainer") or {}
    if options.gpus_per_node == 0 and trainer.get("accelerator") not in ("cpu", None, "auto"):
        raise BadInputError(f"--gpus_per_node 0 runs on CPU but trainer.accelerator is {trainer['accelerator']}")
    check_task_count(trainer, options.nodes, options.gpus_per_node or options.cpu_workers)
    return config


def _spec(options: argparse.Namespace, config: dict[str, Any]) -> ManifestSpec:
    stems = "-".join(Path(path).stem for path in options.config)
    name = options.name or _default_name(stems, config)
    claim = None if options.checkpoint_claim == "none" else options.checkpoint_claim
    mount, config_mount = options.checkpoint_mount.rstrip("/"), options.config_mount.rstrip("/")
    placement = [
        f"--trainer.num_nodes={options.nodes}",
        f"--trainer.devices={options.gpus_per_node or options.cpu_workers}",
        *(["--trainer.accelerator=cpu"] if options.gpus_per_node == 0 else []),
    ]
    return ManifestSpec(
        name=name,
        image=options.image,
        nodes=options.nodes,
        gpus_per_node=options.gpus_per_node,
        fit_args=["--config", f"{config_mount}/{CONFIG_NAME}", *placement, f"--run_dir={mount}/{name}"],
        grace_s=options.grace_s,
        max_restarts=options.max_restarts,
        queue=options.queue,
        checkpoint_claim=claim,
        checkpoint_mount=mount,
        config_map=f"{name}-config",
        config_mount=config_mount,
        secret_env={
            match[1]: (match[2], match[4]) for match in (_SECRET_REF.match(ref) for ref in options.secret_env) if match
        },
        namespace=options.namespace,
        cpu_workers=options.cpu_workers,
        preemption_notices=_notices(config),
    )


def _notices(config: dict[str, Any]) -> str:
    """The config's ``preemption.notices`` as ``launch --preemption-notices`` takes it (the launcher polls)."""
    notices = (config.get("preemption") or {}).get("notices", "auto")
    return notices if isinstance(notices, str) else ",".join(notices) or "off"


def _default_name(stems: str, config: dict[str, Any]) -> str:
    """``<config stems>-<fingerprint>`` as a DNS label: the same name for the same config, like the run dir."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", stems.lower()).strip("-") or "run"
    if not cleaned[0].isalpha():
        cleaned = f"run-{cleaned}"
    return f"{cleaned[: _MAX_NAME - 9].rstrip('-')}-{config_fingerprint(config)}"


def _resolved_config_text(fit_args: list[str]) -> str:
    """The config ``fit`` would resolve, as YAML, without a run directory (the pods name it).

    It is what the pods run, so it is never edited; a config that holds a secret (a secret environment
    variable's value, credentials in a URL) is refused instead, pointing to ``--secret_env``.
    """
    from lightning_mlopt.cli.entry import print_config

    resolved = yaml.safe_load(print_config(fit_args))
    resolved.pop("run_dir", None)
    leaks = _keys_holding_secrets(resolved)
    if leaks:
        raise BadInputError(
            f"{', '.join(leaks)} holds a secret, which a ConfigMap would show to anyone who can read it: take it "
            "out of the config and pass it with --secret_env VAR=SECRET:KEY (a Kubernetes Secret)"
        )
    return yaml.safe_dump(resolved, sort_keys=False)


def _keys_holding_secrets(node: Any, key: str = "") -> list[str]:
    """The dotted keys whose string values contain a secret (``redact`` changes them)."""
    if isinstance(node, dict):
        return [
            leak for name, value in node.items() for leak in _keys_holding_secrets(value, f"{key}.{name}".strip("."))
        ]
    if isinstance(node, list):
        return [leak for index, value in enumerate(node) for leak in _keys_holding_secrets(value, f"{key}[{index}]")]
    return [key] if isinstance(node, str) and redact(node) != node else []


def _documents(flavor: str, spec: ManifestSpec, config_text: str) -> list[dict[str, Any]]:
    config_map = config_map_manifest(spec, config_text)
    if flavor == "trainjob":
        return [config_map, *trainjob_manifests(spec)]
    if flavor == "pytorchjob":
        return [config_map, pytorchjob_manifest(spec)]
    return [config_map, jobset_manifest(spec)]


def _summary(options: argparse.Namespace, spec: ManifestSpec) -> str:
    devices = f"{spec.gpus_per_node} GPU(s)" if spec.gpus_per_node else "CPU"
    return f"{options.flavor} {spec.name}, {spec.nodes} pod(s) x {devices}"
