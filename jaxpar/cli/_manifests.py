"""Kubernetes manifests of a jaxpar deployment, as plain dicts, and their YAML.

One replica is one slice: a LeaderWorkerSet group of ``hosts`` pods, one ``jaxpar serve``
process each. The leader (LWS worker index 0) is process 0 of the ``jax.distributed`` job
and serves HTTP; the workers replay its schedule. Every pod learns its place from the
variables LWS sets in its containers (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``,
``LWS_WORKER_INDEX``), which Kubernetes expands in the container's arguments (``$(NAME)``):
``jaxpar --coordinator $(LWS_LEADER_ADDRESS):PORT --num-processes $(LWS_GROUP_SIZE)
--process-id $(LWS_WORKER_INDEX) serve ...``. With ``RecreateGroupOnPodRestart`` a pod that
fails restarts its whole group, as a job that lost a process must.

Besides the LeaderWorkerSet: a Service in front of the leaders, an InferencePool (the
Gateway API Inference Extension's, GA group ``inference.networking.k8s.io/v1``) over them
for an inference gateway, and a HorizontalPodAutoscaler on the replicas (LWS's scale
subresource selects the leaders) driven by ``vllm:num_requests_waiting``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar.cli._slices import Slice
from jaxpar.spec import MESH_AXES, ParallelConfig

#: The probes' paths: readiness (200 only when a request can be served now) and liveness
#: (503 once a process is lost or the decode loop is stuck; see the fleet page).
READINESS_PATH = "/health"
LIVENESS_PATH = "/live"
#: Where the pods keep JAX's persistent compile cache (a volume per pod that outlives it).
COMPILE_CACHE_PATH = "/var/cache/jaxpar"
#: Where a model downloaded from the Hugging Face hub is put (an ``emptyDir`` per pod).
MODELS_PATH = "/models"
#: The leaders' label; the Service and the InferencePool select it.
ROLE_LABEL = "jaxpar.dev/role"
LWS_API = "leaderworkerset.x-k8s.io/v1"
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
#: The endpoint picker's gRPC port (the Gateway API Inference Extension's default).
EPP_PORT = 9002
#: What the leader's shutdown takes past ``--shutdown-timeout`` before SIGKILL is due.
SHUTDOWN_MARGIN_S = 15


@dataclasses.dataclass(frozen=True)
class Deployment:
    """Everything the manifests say; :func:`jaxpar.cli._deploy.deployment` builds it from
    the command line (or a plan) and checks it."""

    name: str
    image: str
    model_dir: str  # the checkpoint directory as the pods see it
    parallel: ParallelConfig
    slice: Slice
    hf_id: str | None = None  # downloaded into model_dir by an init container
    serve_args: tuple[str, ...] = ()  # further `jaxpar serve` flags
    replicas: int = 1
    max_replicas: int = 4
    hpa_metric: str = "vllm:num_requests_waiting"
    hpa_target: int = 4  # waiting requests per replica the autoscaler aims at
    port: int = 8000
    coordinator_port: int = 8482  # JAX's own on Cloud TPU; libtpu takes 8476
    compile_cache_size: str = "20Gi"
    storage_class: str | None = None
    kv_events_config: str | None = None
    kv_events_port: int | None = None
    startup_timeout_s: int = 1800  # load + warm-up before the liveness probe counts
    shutdown_timeout_s: int = 30

    @property
    def labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": self.name}

    @property
    def leader_labels(self) -> dict[str, str]:
        return {**self.labels, ROLE_LABEL: "leader"}


def manifests(d: Deployment) -> list[dict[str, Any]]:
    """The LeaderWorkerSet, the leaders' Service, the InferencePool and the autoscaler."""
    return [leader_worker_set(d), service(d), inference_pool(d), autoscaler(d)]


def jaxpar_args(d: Deployment) -> list[str]:
    """The container's arguments (``jaxpar`` is its command): the same on every pod; the
    ``$(LWS_*)`` variables make each one its process."""
    args = ["--compile-cache", COMPILE_CACHE_PATH]
    if d.slice.hosts > 1:
        args += ["--coordinator", f"$(LWS_LEADER_ADDRESS):{d.coordinator_port}"]
        args += ["--num-processes", "$(LWS_GROUP_SIZE)", "--process-id", "$(LWS_WORKER_INDEX)"]
    args += ["serve", "--hf", d.model_dir]
    for axis in MESH_AXES:
        if d.parallel.degree(axis) > 1:
            args += [f"--{axis}", str(d.parallel.degree(axis))]
    args += ["--host", "0.0.0.0", "--port", str(d.port)]
    args += ["--shutdown-timeout", str(d.shutdown_timeout_s)]
    if d.kv_events_config is not None:
        args += ["--kv-events-config", d.kv_events_config]
    return [*args, *d.serve_args]


def leader_worker_set(d: Deployment) -> dict[str, Any]:
    template: dict[str, Any] = {
        "size": d.slice.hosts,
        "restartPolicy": "RecreateGroupOnPodRestart",
        "volumeClaimTemplates": [_compile_cache_claim(d)],
    }
    if d.slice.hosts > 1:
        template["leaderTemplate"] = _pod(d, leader=True)
        template["workerTemplate"] = _pod(d, leader=False)
    else:  # a group of one: LWS runs the worker template as the leader
        template["workerTemplate"] = _pod(d, leader=True)
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": d.name, "labels": d.labels},
        "spec": {
            "replicas": d.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": template,
        },
    }


def _compile_cache_claim(d: Deployment) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": d.compile_cache_size}},
    }
    if d.storage_class is not None:
        spec["storageClassName"] = d.storage_class
    return {"metadata": {"name": "compile-cache"}, "spec": spec}


def _pod(d: Deployment, *, leader: bool) -> dict[str, Any]:
    """A pod template: the leader's serves HTTP and has the probes."""
    labels = d.leader_labels if leader else {**d.labels, ROLE_LABEL: "worker"}
    metadata: dict[str, Any] = {"labels": labels}
    if leader:
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(d.port),
            "prometheus.io/path": "/metrics",
        }
    spec: dict[str, Any] = {
        "nodeSelector": dict(d.slice.node_selector),
        "terminationGracePeriodSeconds": d.shutdown_timeout_s + SHUTDOWN_MARGIN_S,
        "containers": [_container(d, leader=leader)],
    }
    if d.hf_id is not None:
        spec["initContainers"] = [_download(d)]
        spec["volumes"] = [{"name": "models", "emptyDir": {}}]
    return {"metadata": metadata, "spec": spec}


def _container(d: Deployment, *, leader: bool) -> dict[str, Any]:
    devices = str(d.slice.devices_per_host)
    container: dict[str, Any] = {
        "name": "jaxpar",
        "image": d.image,
        "command": ["jaxpar"],
        "args": jaxpar_args(d),
    }
    if leader:  # HTTP, and the coordinator of jax.distributed (process 0 runs it)
        ports = [{"name": "http", "containerPort": d.port}]
        if d.slice.hosts > 1:
            ports.append({"name": "coordinator", "containerPort": d.coordinator_port})
        if d.kv_events_port is not None:
            ports.append({"name": "kv-events", "containerPort": d.kv_events_port})
        container["ports"] = ports
    container["resources"] = {
        "requests": {d.slice.resource: devices},
        "limits": {d.slice.resource: devices},
    }
    container["volumeMounts"] = _mounts(d)
    if leader:
        container |= _probes(d)
    return container


def _probes(d: Deployment) -> dict[str, Any]:
    """Start-up: ``/health`` until warmed up (at most ``startup_timeout_s``); then
    readiness on ``/health`` and liveness on ``/live`` (two failures 5 s apart restart the
    pod, and with it the group)."""

    def get(path: str) -> dict[str, Any]:
        return {"path": path, "port": "http"}

    period = 10
    return {
        "startupProbe": {
            "httpGet": get(READINESS_PATH),
            "periodSeconds": period,
            "failureThreshold": -(-d.startup_timeout_s // period),
        },
        "readinessProbe": {"httpGet": get(READINESS_PATH), "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": get(LIVENESS_PATH),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
    }


def _mounts(d: Deployment) -> list[dict[str, str]]:
    mounts = [{"name": "compile-cache", "mountPath": COMPILE_CACHE_PATH}]
    if d.hf_id is not None:
        mounts.append({"name": "models", "mountPath": MODELS_PATH})
    return mounts


#: The init container's download: huggingface_hub comes with jaxpar (through tokenizers).
_DOWNLOAD = (
    "import sys; from huggingface_hub import snapshot_download; "
    "snapshot_download(sys.argv[1], local_dir=sys.argv[2])"
)


def _download(d: Deployment) -> dict[str, Any]:
    """The init container that fetches ``hf_id`` from the hub (``HF_TOKEN`` from the
    optional Secret ``hf-token``, for gated models)."""
    token = {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}}
    return {
        "name": "download",
        "image": d.image,
        "command": ["python", "-c", _DOWNLOAD, d.hf_id, d.model_dir],
        "env": [{"name": "HF_TOKEN", "valueFrom": token}],
        "volumeMounts": [{"name": "models", "mountPath": MODELS_PATH}],
    }


def service(d: Deployment) -> dict[str, Any]:
    """The leaders' HTTP endpoint (LWS makes a headless Service of the set's own name for
    the pods' DNS; this one is ``<name>-leader``)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{d.name}-leader", "labels": d.labels},
        "spec": {
            "selector": d.leader_labels,
            "ports": [{"name": "http", "port": d.port, "targetPort": "http"}],
        },
    }


def inference_pool(d: Deployment) -> dict[str, Any]:
    """The leaders as one pool of model servers for an inference gateway; its endpoint
    picker (``<name>-epp``) is deployed with the gateway (its Helm chart or llm-d)."""
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": d.name, "labels": d.labels},
        "spec": {
            "selector": {"matchLabels": d.leader_labels},
            "targetPorts": [{"number": d.port}],
            "endpointPickerRef": {"name": f"{d.name}-epp", "port": {"number": EPP_PORT}},
        },
    }


def autoscaler(d: Deployment) -> dict[str, Any]:
    """Replicas between ``replicas`` and ``max_replicas``, aiming at ``hpa_target`` waiting
    requests per leader (a Pods metric: LWS's scale subresource selects the leaders)."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": d.name, "labels": d.labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": d.name},
            "minReplicas": d.replicas,
            "maxReplicas": d.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": d.hpa_metric},
                        "target": {"type": "AverageValue", "averageValue": str(d.hpa_target)},
                    },
                }
            ],
        },
    }


def to_yaml(documents: list[dict[str, Any]], header: str = "") -> str:
    """The documents as one multi-document YAML stream (``---`` between them), after
    ``header`` as comment lines."""
    import yaml

    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False, width=4096)
    return comments + body
