"""``python -m lightning_mlopt k8s``: manifests that validate against the real schemas (the core types through
kubernetes-validate, the JobSet, TrainJob/TrainingRuntime and PyTorchJob CRDs from their projects' releases, in
tests/k8s/schemas), the scheduling invariants over a grid of placements, bad input, and the container's command
run here as PID 1 of a new PID namespace: SIGTERM to PID 1 alone, exit 75, and a relaunch bitwise equal to an
uninterrupted run."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.tools._preamble import WRITTEN_BY
from lightning_mlopt.tools.k8s_manifests import (
    PYTORCHJOB_PREEMPTED_EXIT,
    QUEUE_LABEL,
    ManifestSpec,
    jobset_manifest,
    pytorchjob_manifest,
    trainjob_manifests,
)
from tests.conftest import CONFIGS, REPO_PYTHONPATH, run_tool_here

SCHEMAS = Path(__file__).resolve().parents[1] / "k8s" / "schemas"
KUBERNETES_VERSION = "1.33"
CRD_SCHEMA = {
    "JobSet": "jobset.json",
    "TrainJob": "trainjob.json",
    "TrainingRuntime": "clustertrainingruntime.json",  # the same spec as ClusterTrainingRuntime
    "PyTorchJob": "pytorchjob.json",
}


@functools.cache
def _crd_validator(kind: str) -> jsonschema.Draft7Validator:
    """The CRD's schema with unknown fields refused, as the API server's strict field validation does."""
    schema = json.loads((SCHEMAS / CRD_SCHEMA[kind]).read_text())
    return jsonschema.Draft7Validator(_closed(schema))


def _closed(node: Any) -> Any:
    if isinstance(node, dict):
        node = {key: _closed(value) for key, value in node.items()}
        if (
            node.get("type") == "object"
            and "properties" in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node.setdefault("additionalProperties", False)
        return node
    return [_closed(item) for item in node] if isinstance(node, list) else node


def validate(document: dict[str, Any]) -> None:
    """Raise unless ``document`` is valid: core kinds by kubernetes-validate (strict), CRDs by their schema, and
    the Job and pod templates inside a CRD by kubernetes-validate too (the CRDs embed older copies of them)."""
    kind = document["kind"]
    if kind not in CRD_SCHEMA:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        return
    _crd_validator(kind).validate(document)
    for job in _job_templates(document):
        kubernetes_validate.validate(
            {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job}, KUBERNETES_VERSION, True
        )
    for pod in _pod_templates(document):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": {"restartPolicy": "Never", **pod}},
            KUBERNETES_VERSION,
            True,
        )


def _job_templates(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document["spec"]
    if document["kind"] == "TrainingRuntime":
        spec = spec["template"]["spec"]
    return [job["template"]["spec"] for job in spec.get("replicatedJobs", [])]


def _pod_templates(document: dict[str, Any]) -> list[dict[str, Any]]:
    if document["kind"] == "PyTorchJob":
        return [replica["template"]["spec"] for replica in document["spec"]["pytorchReplicaSpecs"].values()]
    return []


def _spec(**overrides: Any) -> ManifestSpec:
    fields: dict[str, Any] = {
        "name": "gpt-1a2b3c4d",
        "image": "registry.example/gpt:1",
        "nodes": 2,
        "gpus_per_node": 8,
        "fit_args": ["--config", "/etc/lightning_mlopt/config.yaml", "--run_dir=/checkpoints/gpt-1a2b3c4d"],
        "checkpoint_claim": "ckpt",
        "config_map": "gpt-1a2b3c4d-config",
        "secret_env": {"WANDB_API_KEY": ("wandb", "api-key")},
    }
    return ManifestSpec(**{**fields, **overrides})


GRID = [
    {"nodes": nodes, "gpus_per_node": gpus, "queue": queue, "grace_s": grace, "max_restarts": restarts}
    for nodes, gpus, queue, grace, restarts in itertools.product([1, 4], [0, 8], [None, "team-a"], [30, 120], [0, 5])
]


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return container


def _check_pod(pod: dict[str, Any], spec: ManifestSpec, preempted_exit: int) -> None:
    container = _container(pod)
    command = container["command"]
    assert command[:4] == ["python", "-m", "lightning_mlopt", "launch"], "the launcher is PID 1, in exec form"
    assert f"--shutdown-timeout={spec.grace_s}" in command and f"--preempted-exit-code={preempted_exit}" in command
    assert pod["terminationGracePeriodSeconds"] > spec.grace_s, "the kubelet waits longer than the workers' grace"
    assert f"--nproc-per-node={spec.workers_per_pod}" in command
    limits = container["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == (spec.gpus_per_node or None)
    for variable in container["env"]:  # secrets only through secretKeyRef, never inline
        if variable["name"] in spec.secret_env:
            assert "value" not in variable and variable["valueFrom"]["secretKeyRef"]["name"] == "wandb"
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "ckpt"
    assert "--run_dir=/checkpoints/gpt-1a2b3c4d" in command, "the run directory is on the claim, named by the run"


@pytest.mark.parametrize("placement", GRID, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_jobset_validates_and_restarts_on_preemption_without_spending_restarts(placement):
    spec = _spec(**placement)
    jobset = jobset_manifest(spec)
    validate(jobset)
    assert (QUEUE_LABEL in jobset["metadata"]["labels"]) == (spec.queue is not None)
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == spec.max_restarts
    preempted, bad_input = policy["rules"]
    assert preempted["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert bad_input["action"] == "FailJobSet"
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completions"] == job["parallelism"] == spec.nodes and job["backoffLimit"] == 0
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    exits = [rule["onExitCodes"]["values"] for rule in rules[1:]]
    assert exits == [[75], [2]]
    # The Job's messages name the exit code; each JobSet rule matches its own code only (2 is not 20-29).
    message = "Container trainer for pod ns/p failed with exit code {} matching FailJob rule at index 1"

    def matches(rule: dict[str, Any], code: int) -> bool:
        return any(re.search(pattern, message.format(code)) for pattern in rule["onJobFailureMessagePatterns"])

    assert matches(preempted, 75) and not matches(preempted, 2) and not matches(preempted, 1)
    assert matches(bad_input, 2) and not matches(bad_input, 25) and not matches(bad_input, 75)
    pod = job["template"]["spec"]
    _check_pod(pod, spec, preempted_exit=75)
    command = _container(pod)["command"]
    if spec.nodes > 1:
        assert f"--rdzv-endpoint={spec.name}-node-0-0.{spec.name}:29400" in command, "pod 0's stable DNS name"
        assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": spec.name}


@pytest.mark.parametrize("nodes,gpus", [(1, 0), (3, 8)])
def test_trainjob_and_its_runtime_validate_and_carry_the_failure_policy(nodes, gpus):
    spec = _spec(nodes=nodes, gpus_per_node=gpus, queue="team-a")
    runtime, train_job = trainjob_manifests(spec)
    validate(runtime)
    validate(train_job)
    assert train_job["spec"]["runtimeRef"] == {
        "name": runtime["metadata"]["name"],
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
    }
    assert train_job["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"]["rules"][0]["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    pod = jobset["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert _container(pod)["name"] == "node", "Trainer v2 finds the trainer container by this name"
    _check_pod(pod, spec, preempted_exit=75)


@pytest.mark.parametrize("nodes", [1, 4])
def test_pytorchjob_exits_with_a_code_its_exit_code_policy_retries(nodes):
    spec = _spec(nodes=nodes)
    job = pytorchjob_manifest(spec)
    validate(job)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas.get("Worker", {}).get("replicas", 0) == nodes - 1
    assert {replica["restartPolicy"] for replica in replicas.values()} == {"ExitCode"}
    assert PYTORCHJOB_PREEMPTED_EXIT >= 128, "v1 retries 128-255 only (IsRetryableExitCode)"
    for replica in replicas.values():
        pod = replica["template"]["spec"]
        assert _container(pod)["name"] == "pytorch"
        _check_pod(pod, spec, preempted_exit=PYTORCHJOB_PREEMPTED_EXIT)


def test_the_schemas_refuse_what_the_api_server_refuses():
    """The validation can fail: a typo, a wrong enum, a missing required field are each caught."""
    jobset = jobset_manifest(_spec())
    typo = copy.deepcopy(jobset)
    typo["spec"]["failurePolicy"]["maxRestart"] = 3
    bad_enum = copy.deepcopy(jobset)
    bad_enum["spec"]["successPolicy"]["operator"] = "Most"
    nameless = copy.deepcopy(jobset)
    del nameless["spec"]["failurePolicy"]["rules"][0]["name"]
    unsorted_status = copy.deepcopy(jobset)
    job = unsorted_status["spec"]["replicatedJobs"][0]["template"]["spec"]
    del job["podFailurePolicy"]["rules"][0]["onPodConditions"][0]["status"]
    for broken in (typo, bad_enum, nameless, unsorted_status):
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(broken)


def _k8s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setenv("WANDB_API_KEY", "k8s-test-secret-value")
    done = run_tool_here("k8s", args, tmp_path, monkeypatch)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("flavor", ["jobset", "trainjob", "pytorchjob"])
@pytest.mark.slow
def test_the_tool_writes_a_valid_manifest_from_the_same_yaml(tmp_path, monkeypatch, flavor):
    code, out, err = _k8s(
        tmp_path,
        monkeypatch,
        "--config",
        str(CONFIGS / "gpt.yaml"),
        "--config",
        str(CONFIGS / "strategies" / "fsdp.yaml"),
        "--image=registry.example/gpt:1",
        f"--flavor={flavor}",
        "--nodes=2",
        "--gpus_per_node=8",
        "--checkpoint_claim=ckpt",
        "--secret_env=WANDB_API_KEY=wandb:api-key",
        "--trainer.max_steps=1000",
        "--performance.tokens_per_sample=64",  # a key whose name says "token": kept as it is (the pods run it)
    )
    assert code == 0, err
    documents = list(yaml.safe_load_all(out))
    for document in documents:
        validate(document)
    config_map = documents[0]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["trainer"]["max_steps"] == 1000 and config["trainer"]["strategy"]["class_path"].endswith(
        "FSDPStrategy"
    )
    name = documents[-1]["metadata"]["name"]
    assert name.startswith("gpt-fsdp-") and len(name) <= 40


@pytest.mark.parametrize(
    "args,says",
    [
        (["--trainer.devices=4", "--gpus_per_node=8"], "trainer.devices is 4 in the config but --gpus_per_node is 8"),
        (["--name=Bad_Name"], "--name 'Bad_Name': a DNS label"),
        (["--grace_s=2"], "--grace_s must be >= 5"),
        (["--secret_env=WANDB_API_KEY=abc123"], "give VAR=SECRET:KEY"),
        (["--trainer.max_stepz=5"], "max_stepz"),
        (["--trainer.default_root_dir=/data/k8s-test-secret-value"], "trainer.default_root_dir holds a secret"),
        (["--trainer.default_root_dir=s3://me:hunter22@host/x"], "pass it with --secret_env"),
    ],
)
def test_bad_arguments_exit_2_with_a_short_message_and_write_nothing(tmp_path, monkeypatch, args, says):
    output = tmp_path / "manifest.yaml"
    kept = f"{WRITTEN_BY}; a manifest of an earlier run, which bad input must not replace\n"
    output.write_text(kept)
    code, out, err = _k8s(
        tmp_path,
        monkeypatch,
        "--config",
        str(CONFIGS / "gpt.yaml"),
        "--image=x",
        "--checkpoint_claim=ckpt",
        f"--output={output}",
        *args,
    )
    assert code == 2, err
    assert says in err and err.startswith("error: ") and len(err.strip().splitlines()) <= 2, err
    assert output.read_text() == kept and out == ""


# ---------------------------------------------------------------------- the container's command as PID 1


def _pid_namespaces_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0


def _manifest_command(tmp_path: Path, mount: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict[str, str]]:
    """The JobSet container's command and environment, with the ConfigMap written where the pod mounts it."""
    fit = [
        "--trainer.max_steps=12",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        "--model.init_args.dropout=0.1",
        "--data.init_args.num_sequences=160",
        "--checkpoint.every_n_steps=2",
        "--trainer.callbacks+=tests.support.recorders.RecordEverything",
        f"--trainer.callbacks.out_dir={mount / 'record'}",
        "--trainer.callbacks+=tests.support.faults.Pace",
        f"--trainer.callbacks.out_dir={mount / 'pace'}",
        "--trainer.callbacks.seconds_per_step=0.25",
    ]
    code, out, err = _k8s(
        tmp_path,
        monkeypatch,
        "--config",
        str(CONFIGS / "gpt.yaml"),
        "--config",
        str(CONFIGS / "strategies" / "ddp.yaml"),
        "--image=x",
        "--name=gpt-pid1",
        "--gpus_per_node=0",
        "--cpu_workers=2",
        "--checkpoint_claim=ckpt",
        f"--checkpoint_mount={mount / 'claim'}",
        f"--config_mount={mount / 'config'}",
        *fit,
    )
    assert code == 0, err
    config_map, jobset = yaml.safe_load_all(out)
    (mount / "config").mkdir(parents=True)
    (mount / "config" / "config.yaml").write_text(config_map["data"]["config.yaml"])
    container = _container(jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])
    command = [sys.executable if part == "python" else part for part in container["command"]]  # the image's python
    env = {
        **os.environ,
        "PYTHONPATH": REPO_PYTHONPATH,
        **{v["name"]: v["value"] for v in container["env"] if "value" in v},
    }
    env.pop("MASTER_PORT", None)
    env.pop("WANDB_API_KEY", None)  # _k8s's stand-in secret: the pod gets it from a Secret, here from nowhere
    return command, env


def _run(command: list[str], env: dict[str, str], log: Path) -> int:
    with log.open("w") as handle:
        return subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=300).returncode


@pytest.mark.multiprocess
@pytest.mark.skipif(not _pid_namespaces_available(), reason="needs root and unshare --pid (a new PID namespace)")
def test_the_manifest_command_as_pid_1_exits_75_on_sigterm_and_resumes_bitwise(tmp_path, monkeypatch):
    import torch

    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    command, env = _manifest_command(tmp_path, reference, monkeypatch)
    assert _run(command, env, tmp_path / "reference.log") == 0, (tmp_path / "reference.log").read_text()[-3000:]
    command, env = _manifest_command(tmp_path, interrupted, monkeypatch)
    log = tmp_path / "pid1.log"
    with log.open("w") as handle:
        # PID 1 of a new PID namespace, as in a container: the kernel delivers it only signals it handles.
        outer = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", *command], env=env, stdout=handle, stderr=subprocess.STDOUT
        )
    checkpoints = interrupted / "claim" / "gpt-pid1" / "checkpoints"
    try:
        deadline = time.monotonic() + 240
        while not (checkpoints / "step-000000002").is_dir():
            assert outer.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)
        (pid_1,) = subprocess.run(["pgrep", "-P", str(outer.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(pid_1), signal.SIGTERM)  # to PID 1 alone, as the kubelet does
        code = outer.wait(timeout=60)
    finally:
        if outer.poll() is None:
            outer.kill()
    output = log.read_text()
    assert code == 75, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output
    launcher_lines = [line for line in output.splitlines() if line.startswith("launch:")]
    assert len(launcher_lines) == 1 and "a relaunch resumes from" in launcher_lines[0], output[-2000:]
    newest = CheckpointStore(checkpoints).newest_valid()
    assert newest is not None and newest.manifest.reason == "signal"
    assert _run(command, env, tmp_path / "relaunch.log") == 0, (tmp_path / "relaunch.log").read_text()[-3000:]
    expected = torch.load(reference / "record" / "params.pt", weights_only=False)
    actual = torch.load(interrupted / "record" / "params.pt", weights_only=False)
    assert all(torch.equal(actual[name], expected[name]) for name in expected), "bitwise equal to the reference"
