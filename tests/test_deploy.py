"""``jaxpar deploy`` and ``jaxpar plan --deploy``: Kubernetes manifests for a slice.

The manifests are validated as a cluster would: the built-in kinds (Service,
HorizontalPodAutoscaler, and each pod template as a PodTemplate) against Kubernetes's own
schemas (``kubernetes-validate``, strict: an unknown field fails), the LeaderWorkerSet and
the InferencePool against their CRDs' schemas (tests/fixtures/k8s, made strict the same
way). Their content is checked against the slice: pods x chips per pod = the topology's
chips, node labels, the group restart, the probes. Bad input is refused before anything
is printed, naming what would be legal, and what it names is accepted. Then the launch the
pods describe runs for real: the leader's and the worker's container arguments, expanded
with the variables LWS sets (leader address localhost), as 2 processes x 4 simulated CPU
devices; the leader becomes ready on the readiness probe's path, is alive on the liveness
probe's, exports the autoscaler's metric and serves a completion.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from jaxpar.cli import main
from jaxpar.cli._deploy import legal_strategies
from jaxpar.cli._slices import TPU_ACCELERATORS, tpu_topologies
from tests._serve_util import READY_TIMEOUT_S, ROOT, free_port

FIXTURES = ROOT / "tests" / "fixtures"
CHECKPOINT = "tests/fixtures/llama_chat"  # as the pods see it: relative to the repository
K8S_VERSION = kubernetes_validate.latest_version()
#: (flags, hosts, devices per host, resource) of the slices the manifests are checked on.
SLICES = [
    (
        ["--hardware", "tpu-v5e", "--topology", "4x4", "--dp", "8", "--tp", "2"],
        4,
        4,
        "google.com/tpu",
    ),
    (
        ["--hardware", "tpu-v6e", "--topology", "2x4", "--dp", "4", "--tp", "2"],
        1,
        8,
        "google.com/tpu",
    ),
    (
        ["--hardware", "tpu-v5p", "--topology", "2x2x2", "--dp", "2", "--sp", "2", "--tp", "2"],
        2,
        4,
        "google.com/tpu",
    ),
    (["--hardware", "h100", "--hosts", "2", "--dp", "8", "--tp", "2"], 2, 8, "nvidia.com/gpu"),
]


def _deploy(capsys, *args: str) -> list[dict]:
    assert main(["deploy", *args]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def _refusal(capsys, *args: str) -> str:
    assert main(["deploy", *args]) == 2
    out = capsys.readouterr().out
    assert "apiVersion" not in out  # refused before anything is printed
    return " ".join(out.split())


def _by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds = {doc["kind"]: doc for doc in docs}
    assert len(kinds) == len(docs) == 4, [doc["kind"] for doc in docs]
    return kinds


def _strict(schema):
    """A CRD schema in which an object with listed properties accepts no other field (as
    ``kubectl apply --validate=strict`` refuses unknown fields)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd(file: str) -> tuple[dict, jsonschema.Draft7Validator]:
    crd = json.loads((FIXTURES / "k8s" / file).read_text())
    return crd, jsonschema.Draft7Validator(_strict(crd["openAPIV3Schema"]))


CRDS = {
    "LeaderWorkerSet": _crd("leaderworkerset.x-k8s.io_v1.json"),
    "InferencePool": _crd("inference.networking.k8s.io_v1.json"),
}


def _validate(doc: dict) -> None:
    if doc["kind"] in CRDS:
        crd, validator = CRDS[doc["kind"]]
        assert doc["apiVersion"] == f"{crd['group']}/{crd['version']}"
        errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, errors
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pod_templates(lws: dict) -> dict[str, dict]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return {k: template[k] for k in ("leaderTemplate", "workerTemplate") if k in template}


@pytest.mark.parametrize(
    "flags, hosts, per_host, resource", SLICES, ids=["v5e-4x4", "v6e-2x4", "v5p-2x2x2", "h100-2x8"]
)
def test_manifests_validate_and_describe_the_slice(capsys, flags, hosts, per_host, resource):
    docs = _deploy(capsys, "--hf", CHECKPOINT, *flags)
    for doc in docs:
        _validate(doc)
    kinds = _by_kind(docs)
    lws = kinds["LeaderWorkerSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == hosts and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    templates = _pod_templates(lws)
    # A group of one runs its worker template as the leader; otherwise both are given.
    assert set(templates) == (
        {"workerTemplate"} if hosts == 1 else {"leaderTemplate", "workerTemplate"}
    )
    degrees = dict(zip(flags[::2], flags[1::2], strict=True))
    for role, pod in templates.items():
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": role.lower()},
                "template": pod,
            },
            K8S_VERSION,
            strict=True,
        )
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"] == {resource: str(per_host)}
        selector = pod["spec"]["nodeSelector"]
        if resource == "google.com/tpu":
            kind, topology = degrees["--hardware"], degrees["--topology"]
            assert selector["cloud.google.com/gke-tpu-accelerator"] == TPU_ACCELERATORS[kind]
            assert selector["cloud.google.com/gke-tpu-topology"] == topology
            chips = math.prod(map(int, topology.split("x")))
            assert hosts * per_host == chips  # every chip of the slice, one process per host
        args = container["args"]
        serve = args.index("serve")
        for flag in ("--dp", "--sp", "--tp"):  # the strategy, as given
            assert (flag in degrees) == (flag in args[serve:])
            if flag in degrees:
                assert args[args.index(flag) + 1] == degrees[flag]
        distributed = " ".join(args[:serve])
        assert ("$(LWS_LEADER_ADDRESS)" in distributed) == (hosts > 1)
        if hosts > 1:
            assert (
                "--num-processes $(LWS_GROUP_SIZE) --process-id $(LWS_WORKER_INDEX)" in distributed
            )
        cache = args[args.index("--compile-cache") + 1]  # on the persistent volume
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["compile-cache"]
        assert (
            cache == mount
            and group["volumeClaimTemplates"][0]["metadata"]["name"] == "compile-cache"
        )
    leader = templates.get("leaderTemplate", templates["workerTemplate"])
    (container,) = leader["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    if hosts > 1:
        assert "livenessProbe" not in templates["workerTemplate"]["spec"]["containers"][0]
    # The Service, the pool and the autoscaler all point at the leaders.
    leader_labels = leader["metadata"]["labels"]
    assert kinds["Service"]["spec"]["selector"] == leader_labels
    assert kinds["InferencePool"]["spec"]["selector"]["matchLabels"] == leader_labels
    hpa = kinds["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == lws["metadata"]["name"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"


KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'


def test_the_validators_refuse_what_a_cluster_refuses(capsys):
    # Not vacuous: a field the schema does not have, or a value it forbids, fails.
    flags = ["--hf-id", "org/Some.Model-7B", "--hardware", "tpu-v5p", "--tp", "8"]
    docs = _by_kind(_deploy(capsys, *flags, "--kv-events-config", KV_EVENTS))
    assert docs["LeaderWorkerSet"]["metadata"]["name"] == "some-model-7b"
    bad = copy.deepcopy(docs["LeaderWorkerSet"])
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnFailure"
    with pytest.raises(AssertionError):
        _validate(bad)
    bad = copy.deepcopy(docs["InferencePool"])
    bad["spec"]["targetPort"] = bad["spec"].pop("targetPorts")
    with pytest.raises(AssertionError):
        _validate(bad)
    bad = copy.deepcopy(docs["HorizontalPodAutoscaler"])
    bad["spec"]["metrics"][0]["pods"]["target"]["averageValues"] = "4"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    # A hub model is downloaded by an init container into the directory the pods serve.
    pod = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    (init,) = pod["spec"]["initContainers"]
    args = pod["spec"]["containers"][0]["args"]
    assert init["command"][-2:] == ["org/Some.Model-7B", args[args.index("--hf") + 1]]
    # KV events: the servers get the config, the leaders expose its port; a bad one is
    # refused as jaxpar serve refuses it.
    assert args[args.index("--kv-events-config") + 1] == KV_EVENTS
    ports = pod["spec"]["containers"][0]["ports"]
    assert {"name": "kv-events", "containerPort": 5557} in ports
    text = _refusal(capsys, *flags, "--kv-events-config", '{"publisher": "zmq", "port": 1}')
    assert "unknown key 'port'" in text


def test_bad_topology_and_strategy_are_refused_naming_the_legal_ones(capsys):
    text = _refusal(
        capsys, "--hf", CHECKPOINT, "--hardware", "tpu-v5e", "--topology", "3x3", "--tp", "8"
    )
    assert "3x3" in text and ", ".join(tpu_topologies("tpu-v5e")) in text
    text = _refusal(capsys, "--hf", CHECKPOINT, "--hardware", "tpu-v9", "--tp", "8")
    assert "tpu-v9" in text and "tpu-v5e, tpu-v6e, tpu-v5p" in text
    # 8 devices' strategy on a 16-chip slice: refused, with strategies for this model that
    # fit it; each one named is accepted.
    text = _refusal(
        capsys, "--hf", CHECKPOINT, "--hardware", "tpu-v5e", "--topology", "4x4", "--tp", "8"
    )
    assert "uses 8 devices" in text and "has 16" in text
    named = re.search(r"for this model: (.*?)(?: \(and \d+ more\))?$", text).group(1).split("; ")
    assert len(named) >= 2
    for flags in named:
        assert (
            main(
                [
                    "deploy",
                    "--hf",
                    CHECKPOINT,
                    "--hardware",
                    "tpu-v5e",
                    "--topology",
                    "4x4",
                    *flags.split(),
                ]
            )
            == 0
        )
        capsys.readouterr()
    # Pipelined: served (a stage on each 4 chips), but not disaggregated as well.
    pipelined = ["--hf", CHECKPOINT, "--hardware", "tpu-v6e", "--topology", "2x4"]
    pipelined += ["--pp", "2", "--tp", "4"]
    assert main(["deploy", *pipelined]) == 0
    assert "- --pp - '2' - --tp - '4'" in " ".join(capsys.readouterr().out.split())
    text = _refusal(capsys, *pipelined, "--serve-args", "--prefill tp=4")
    assert "pp=1 in both" in text and "--dp 4 --tp 2" in text
    # Without the model here, the strategies named are the dense ones of the slice's size.
    text = _refusal(capsys, "--hf-id", "org/m", "--hardware", "h100", "--hosts", "3", "--tp", "16")
    assert "legal --hosts: 2" in text
    assert legal_strategies(16)[0].tp == 16


def test_plan_deploy_serves_the_plan_s_strategy(capsys):
    model = str(FIXTURES / "configs" / "llama-3-8b")
    plan = ["plan", "--hf", model, "--hardware", "tpu-v5e", "--devices", "16", "--batch", "32"]
    plan += ["--prompt-len", "512", "--gen-len", "128", "--objective", "throughput"]
    assert main([*plan, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main([*plan, "--deploy"]) == 0
    docs = _by_kind(list(yaml.safe_load_all(capsys.readouterr().out)))
    for doc in docs.values():
        _validate(doc)
    lws = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert lws["size"] == 4  # v5e 4x4: 4 VMs of 4 chips
    args = lws["leaderTemplate"]["spec"]["containers"][0]["args"]
    served = " ".join(args[args.index("serve") :])

    # The best plan serve runs across hosts: disaggregated only unpipelined, into groups
    # of as many devices.
    def serves(p: dict) -> bool:
        if not p["disaggregated"]:
            return True
        decode = math.prod(p["degrees"].values())
        unpipelined = p["degrees"]["pp"] == 1 and "pp=" not in p["prefill_strategy"]
        return unpipelined and p["devices"] == 2 * decode

    chosen = next(p for p in data["plans"] if serves(p))
    for axis, degree in chosen["degrees"].items():
        assert (f"--{axis} {degree}" in served) == (degree > 1)
    assert ("--prefill" in served) == chosen["disaggregated"]
    assert f"--max-num-seqs {chosen['batch']}" in served
    assert f"--prefill-batch {chosen['prefill_batch']}" in served


def test_the_docs_page_shows_what_its_command_prints(capsys):
    page = (ROOT / "scripts" / "docs" / "pages" / "deploy.md").read_text()
    (command,) = re.findall(r"^```bash deploy\n(.*?)^```", page, flags=re.M | re.S)
    (shown,) = re.findall(r"^```yaml deploy\n(.*?)^```", page, flags=re.M | re.S)
    argv = shlex.split(command)
    assert argv[:2] == ["jaxpar", "deploy"]
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out == shown
    for doc in yaml.safe_load_all(shown):
        _validate(doc)


# --- the launch the manifests describe, run here --------------------------------------------

#: jaxpar serve's flags of tests/test_serve_multihost.py's pair (the same programs: a run that
#: has both compiles them once).
SERVE_ARGS = "--max-seq-len 32 --max-num-seqs 16 --prefill-batch 2"


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes's expansion of a container argument: ``$(NAME)`` of a variable the
    container has, ``$$`` an escaped ``$``; anything else stays as written."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)


class Pod:
    """A pod's container as a process here: ``jaxpar`` is ``python -m jaxpar.cli``, with
    ``--cpu-devices 4`` (no accelerator), its volumes directories of this machine."""

    def __init__(self, container: dict, env: dict[str, str], volumes: dict[str, Path], log: Path):
        assert container["command"] == ["jaxpar"]
        args = [_expand(a, env) for a in container["args"]]
        for mount in container["volumeMounts"]:
            args = [a.replace(mount["mountPath"], str(volumes[mount["name"]]), 1) for a in args]
        self.log = log
        full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        full_env.pop("XLA_FLAGS", None)
        command = [sys.executable, "-m", "jaxpar.cli", "--cpu-devices", "4", *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """The LWS group of a v5p 2x2x2 slice (2 pods) started as LWS starts it."""
    port, coordinator = free_port(), free_port()
    argv = ["deploy", "--hf", CHECKPOINT, "--hardware", "tpu-v5p", "--topology", "2x2x2"]
    argv += ["--dp", "2", "--sp", "2", "--tp", "2", "--port", str(port)]
    argv += ["--coordinator-port", str(coordinator), "--serve-args", SERVE_ARGS]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    docs = _by_kind(list(yaml.safe_load_all(out.getvalue())))
    template = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    logs = tmp_path_factory.mktemp("lws")
    # The compile cache volume: the run's cache (tests/conftest.py), shared with the other
    # servers' identical programs.
    volumes = {"compile-cache": Path(os.environ["JAX_COMPILATION_CACHE_DIR"])}
    pods = []
    try:
        for index, role in enumerate(("leaderTemplate", "workerTemplate")):
            (container,) = template[role]["spec"]["containers"]
            env = {
                "LWS_LEADER_ADDRESS": "localhost",
                "LWS_GROUP_SIZE": str(template["size"]),
                "LWS_WORKER_INDEX": str(index),
            }
            pods.append(Pod(container, env, volumes, logs / f"{role}.log"))
        yield docs, pods
    finally:
        for pod in pods:
            pod.stop()


def _wait_ready(url: str, pods: list[Pod]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        for pod in pods:
            assert pod.proc.poll() is None, pod.log.read_text()[-3000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, pods[0].log.read_text()[-3000:]
        time.sleep(0.25)


@pytest.mark.server
def test_the_group_the_manifests_describe_serves(group):
    docs, pods = group
    leader = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    (container,) = leader["spec"]["containers"]
    (http,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    base = f"http://127.0.0.1:{http}"
    _wait_ready(base + container["readinessProbe"]["httpGet"]["path"], pods)
    assert (
        httpx.get(base + container["livenessProbe"]["httpGet"]["path"], timeout=10).status_code
        == 200
    )
    body = {"model": "llama_chat", "prompt": [1, 40, 41, 42], "max_tokens": 5, "temperature": 0.0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    response = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    health = httpx.get(base + "/health", timeout=10).json()
    assert health["lockstep"]["processes"] == 2  # the worker pod is process 1 of the job
    # The autoscaler's metric is one the leader exports.
    metric = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert re.search(rf"^{re.escape(metric)}\{{", metrics, flags=re.M), metric
