"""The Kubernetes objects ``python -m lightning_mlopt k8s`` writes: JobSet, Kubeflow TrainJob, PyTorchJob.

Each flavour runs ``python -m lightning_mlopt launch ... fit`` as the container's command, in exec form, so
the launcher is the container's PID 1 and receives the kubelet's SIGTERM itself (bash, as PID 1, would not pass
it on). What each scheduler does with the launcher's statuses:

- **JobSet** (default) and **TrainJob** (Kubeflow Trainer v2, which runs a JobSet): the Job's
  ``podFailurePolicy`` fails the Job at once on exit 75 (preempted, saved), on exit 2 (bad input) and on the
  ``DisruptionTarget`` pod condition (evicted, preempted by Kueue, node drained); the JobSet's
  ``failurePolicy`` rules then restart the whole JobSet on 75 and on a disruption *without* spending
  ``maxRestarts`` (``RestartJobSetAndIgnoreMaxRestarts``), fail it for good on 2 (``FailJobSet``), and any
  other failure restarts it within ``maxRestarts``. For TrainJob the policy lives in a namespaced
  ``TrainingRuntime`` written beside it (a TrainJob cannot carry one itself).
- **PyTorchJob** (Kubeflow v1): its ``restartPolicy: ExitCode`` retries only exit codes 128-255 and treats
  1-127 (75 included) as permanent, so the launcher exits 143 (128 + SIGTERM) when preempted; 2 stays
  permanent; any other failure of a worker (1, 74) is permanent too under that policy.

Every pod mounts the run directory from a PersistentVolumeClaim (``/checkpoints/<name>``), so a restarted
pod resumes the same run; the run's name is the object's name, which gives the run directory and, through
it, the tracker's run id. The resolved config travels in a ConfigMap, unedited (one holding a secret is
refused); secrets reach the pods only through ``secretKeyRef``.

Example::

    >>> spec = ManifestSpec(name="gpt", image="registry/gpt:1", nodes=2, gpus_per_node=8, fit_args=[])
    >>> jobset = jobset_manifest(spec)
    >>> jobset["kind"], jobset["spec"]["failurePolicy"]["rules"][0]["action"]
    ('JobSet', 'RestartJobSetAndIgnoreMaxRestarts')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_mlopt.process import exit_codes

CONTAINER = "trainer"
REPLICATED_JOB = "node"
RENDEZVOUS_PORT = 29400
PYTORCHJOB_PREEMPTED_EXIT = 143  # 128 + SIGTERM: the lowest kind of status PyTorchJob v1's ExitCode retries
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MANAGED_BY = {"app.kubernetes.io/managed-by": "lightning_mlopt"}
_BAD_INPUT = exit_codes.BAD_INPUT
_PREEMPTED = exit_codes.REQUEUE


@dataclass(frozen=True)
class ManifestSpec:
    """What a manifest needs, checked by the tool before it is built.

    Args:
        name: the run's name (a DNS label): the object's name, the run directory, the rendezvous id.
        image: the container image (with lightning_mlopt and the model's code installed).
        nodes: pods, one per node.
        gpus_per_node: devices per pod, one worker each (``nvidia.com/gpu``); 0: CPU workers.
        fit_args: arguments after ``fit`` (the config, the placement, the run directory).
        grace_s: seconds from SIGTERM to SIGKILL that the workers get (torchrun's shutdown timeout).
        max_restarts: restarts for failures other than a preemption or bad input.
        queue: a Kueue LocalQueue, or None.
        checkpoint_claim: the PersistentVolumeClaim holding run directories; None: an emptyDir (lost on restart).
        checkpoint_mount: where the claim is mounted in the pod.
        config_map: the ConfigMap holding the resolved config, or None.
        config_mount: where it is mounted.
        secret_env: environment variables read from secrets: name -> (secret, key).
        namespace: the namespace, or None (kubectl's current one).

    """

    name: str
    image: str
    nodes: int
    gpus_per_node: int
    fit_args: list[str]
    grace_s: int = 30
    max_restarts: int = 3
    queue: str | None = None
    checkpoint_claim: str | None = None
    checkpoint_mount: str = "/checkpoints"
    config_map: str | None = None
    config_mount: str = "/etc/lightning_mlopt"
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)
    namespace: str | None = None
    cpu_workers: int = 1
    preemption_notices: str = "auto"

    @property
    def workers_per_pod(self) -> int:
        """Workers the launcher starts in each pod: one per GPU, or ``cpu_workers`` on CPU."""
        return self.gpus_per_node or self.cpu_workers

    @property
    def termination_grace_s(self) -> int:
        """The pod's grace: the workers' plus time for the launcher to reap them and say so."""
        return self.grace_s + max(10, self.grace_s // 10)


def launch_command(spec: ManifestSpec, rendezvous: list[str], preempted_exit: int = _PREEMPTED) -> list[str]:
    """The container's command: the launcher as PID 1, then ``fit`` with the spec's arguments."""
    return [
        "python",
        "-m",
        "lightning_mlopt",
        "launch",
        f"--nproc-per-node={spec.workers_per_pod}",
        *rendezvous,
        f"--shutdown-timeout={spec.grace_s}",
        f"--preempted-exit-code={preempted_exit}",
        f"--preemption-notices={spec.preemption_notices}",
        "fit",
        *spec.fit_args,
    ]


def jobset_rendezvous(spec: ManifestSpec) -> list[str]:
    """c10d rendezvous at pod 0's stable DNS name (``<jobset>-<job>-0-0.<subdomain>``); one pod: its own."""
    if spec.nodes == 1:
        return ["--standalone", "--max-restarts=0"]
    host = f"{spec.name}-{REPLICATED_JOB}-0-0.{spec.name}"
    return [
        f"--nnodes={spec.nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={host}:{RENDEZVOUS_PORT}",
        f"--rdzv-id={spec.name}",
        "--max-restarts=0",  # the JobSet restarts the pods; a worker failure ends the pod
    ]


def pod_spec(spec: ManifestSpec, command: list[str], container: str = CONTAINER) -> dict[str, Any]:
    """The pod: one container running ``command``, its devices, the claim, the config, the secrets."""
    resources: dict[str, Any] = {}
    if spec.gpus_per_node:
        resources = {"limits": {"nvidia.com/gpu": spec.gpus_per_node}}
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        for name, (secret, key) in sorted(spec.secret_env.items())
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "checkpoints", "mountPath": spec.checkpoint_mount},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "checkpoints", **_checkpoint_volume(spec)},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # data loader workers share tensors through /dev/shm
    ]
    if spec.config_map:
        mounts.append({"name": "config", "mountPath": spec.config_mount, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": spec.config_map}})
    return {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.termination_grace_s,
        "containers": [
            {
                "name": container,
                "image": spec.image,
                "command": command,
                "env": env,
                "resources": resources,
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }


def _checkpoint_volume(spec: ManifestSpec) -> dict[str, Any]:
    if spec.checkpoint_claim:
        return {"persistentVolumeClaim": {"claimName": spec.checkpoint_claim}}
    return {"emptyDir": {}}


def _metadata(spec: ManifestSpec, name: str | None = None, queued: bool = True) -> dict[str, Any]:
    """``queued``: the object Kueue admits (the workload itself), which alone carries the queue label."""
    labels = dict(MANAGED_BY)
    if spec.queue and queued:
        labels[QUEUE_LABEL] = spec.queue
    metadata: dict[str, Any] = {"name": name or spec.name, "labels": labels}
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    return metadata


def pod_failure_policy(container: str = CONTAINER) -> dict[str, Any]:
    """Fail the Job at once on a disruption, a preemption exit (75) or bad input (2); the JobSet decides."""
    return {
        "rules": [
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [_PREEMPTED]},
            },
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [_BAD_INPUT]},
            },
        ]
    }


def jobset_failure_policy(max_restarts: int) -> dict[str, Any]:
    """Restart on a preemption or a disruption without spending ``max_restarts``; never on bad input.

    The Job's failure message names the matched rule ("... failed with exit code 75 matching FailJob rule at
    index 1", "Pod ... has condition DisruptionTarget matching FailJob rule at index 0"); the patterns keep
    ``exit code 2 `` from matching 20-29.
    """
    return {
        "maxRestarts": max_restarts,
        "rules": [
            {
                "name": "Preempted",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [
                    "has condition DisruptionTarget matching",
                    f"failed with exit code {_PREEMPTED} matching",
                ],
            },
            {
                "name": "BadInput",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [f"failed with exit code {_BAD_INPUT} matching"],
            },
        ],
    }


def _jobset_spec(spec: ManifestSpec, container: str) -> dict[str, Any]:
    """A JobSet's ``spec``: one indexed Job of ``nodes`` pods, stable DNS names, the failure policy."""
    command = launch_command(spec, jobset_rendezvous(spec))
    return {
        "network": {"enableDNSHostnames": True, "subdomain": spec.name},
        "failurePolicy": jobset_failure_policy(spec.max_restarts),
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
        "replicatedJobs": [
            {
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "spec": {
                        "parallelism": spec.nodes,
                        "completions": spec.nodes,
                        "completionMode": "Indexed",
                        "backoffLimit": 0,  # any pod failure fails the Job; the JobSet's rules decide what next
                        "podFailurePolicy": pod_failure_policy(container),
                        "template": {
                            "metadata": {"labels": dict(MANAGED_BY)},
                            "spec": pod_spec(spec, command, container),
                        },
                    }
                },
            }
        ],
    }


def jobset_manifest(spec: ManifestSpec) -> dict[str, Any]:
    """A ``jobset.x-k8s.io/v1alpha2`` JobSet running the spec."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(spec),
        "spec": _jobset_spec(spec, CONTAINER),
    }


def trainjob_manifests(spec: ManifestSpec) -> list[dict[str, Any]]:
    """A namespaced ``TrainingRuntime`` carrying the failure policy, and the ``TrainJob`` that uses it."""
    runtime_name = f"{spec.name}-runtime"
    jobset_spec = _jobset_spec(spec, REPLICATED_JOB)  # Trainer v2 finds the trainer container by this name
    runtime = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainingRuntime",
        "metadata": _metadata(spec, runtime_name, queued=False),
        "spec": {
            "mlPolicy": {"numNodes": spec.nodes, "torch": {}},
            "template": {"spec": jobset_spec},
        },
    }
    trainer: dict[str, Any] = {"image": spec.image, "numNodes": spec.nodes, "numProcPerNode": spec.workers_per_pod}
    if spec.gpus_per_node:
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": spec.gpus_per_node}}
    train_job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(spec),
        "spec": {
            "runtimeRef": {"name": runtime_name, "apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime"},
            "trainer": trainer,
        },
    }
    return [runtime, train_job]


def pytorchjob_manifest(spec: ManifestSpec) -> dict[str, Any]:
    """A ``kubeflow.org/v1`` PyTorchJob: a Master and ``nodes - 1`` Workers, ``restartPolicy: ExitCode``.

    The operator sets ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which the
    launcher (torchrun's parser) reads; the launcher exits 143 when preempted, a status ExitCode retries.
    """
    command = launch_command(spec, ["--max-restarts=0"], preempted_exit=PYTORCHJOB_PREEMPTED_EXIT)
    replica_pod = pod_spec(spec, command, container="pytorch")  # the operator requires this container name
    del replica_pod["restartPolicy"]  # the operator derives the pod's from the replica's ExitCode
    replicas: dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": {"spec": replica_pod}},
    }
    if spec.nodes > 1:
        replicas["Worker"] = {
            "replicas": spec.nodes - 1,
            "restartPolicy": "ExitCode",
            "template": {"spec": replica_pod},
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(spec),
        "spec": {
            "nprocPerNode": str(spec.workers_per_pod),
            "runPolicy": {"backoffLimit": spec.max_restarts},
            "pytorchReplicaSpecs": replicas,
        },
    }


def config_map_manifest(spec: ManifestSpec, config_yaml: str) -> dict[str, Any]:
    """The ConfigMap holding the resolved config (``config.yaml``), mounted read-only in every pod."""
    assert spec.config_map is not None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(spec, spec.config_map, queued=False),
        "data": {"config.yaml": config_yaml},
    }
