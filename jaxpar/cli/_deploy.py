"""``jaxpar deploy``: Kubernetes manifests that serve a model on a slice with a strategy.

Prints YAML for ``kubectl apply -f -``: a LeaderWorkerSet (one replica per slice: the
leader is process 0 and serves HTTP, the workers are the other processes of the
``jax.distributed`` job), the leaders' Service, an InferencePool for an inference gateway
and a HorizontalPodAutoscaler on ``vllm:num_requests_waiting``
(:mod:`jaxpar.cli._manifests`). The strategy flags are ``jaxpar serve``'s; the slice is a
TPU topology (v5e, v6e, v5p) or GPU hosts (:mod:`jaxpar.cli._slices`). Everything is
checked before anything is printed: the topology is one of the kind's slices, the
strategy's degrees multiply to the slice's devices, and (when ``--hf`` is a directory here)
the strategy is legal for the model. ``jaxpar plan ... --deploy`` prints the same for the
plan's best strategy.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import re
import shlex
from pathlib import Path

from jaxpar.cli._manifests import Deployment, manifests, to_yaml
from jaxpar.cli._slices import Slice, deployable_kinds, gpu_slice, tpu_slice
from jaxpar.errors import ConfigError, IllegalStrategyError
from jaxpar.spec import MESH_AXES, ParallelConfig

#: A name LWS can build its pods' names and labels from: a DNS label, with room for
#: ``-<group>-<worker>`` and the Service's ``-leader``.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
#: How many legal strategies a refusal names.
SHOWN_LEGAL = 6


def add_deploy_args(parser: argparse.ArgumentParser) -> None:
    """``jaxpar deploy``'s own flags: the model, the slice, then the deployment's."""
    parser.add_argument(
        "--hf",
        default=None,
        metavar="DIR",
        help="the checkpoint directory the pods serve (in the image or on a volume you mount); "
        "when it is a directory here too, its config.json checks the strategy against the model",
    )
    parser.add_argument(
        "--hardware",
        required=True,
        metavar="KIND",
        help=f"the accelerator: {', '.join(deployable_kinds())}",
    )
    parser.add_argument(
        "--topology",
        default=None,
        metavar="AxB[xC]",
        help="TPU: the slice's torus shape (e.g. 2x4, 4x4, 2x2x2); default: Cloud TPU's slice "
        "of as many chips as the strategy's devices",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="GPU: nodes per replica (default: as few as hold the strategy's GPUs, 8 a node)",
    )
    add_deploy_options(parser)
    parser.set_defaults(model=None, default_model=None, dtype=None)


def add_deploy_options(parser: argparse.ArgumentParser) -> None:
    """The flags ``jaxpar deploy`` and ``jaxpar plan --deploy`` share."""
    group = parser.add_argument_group("Kubernetes deployment")
    group.add_argument(
        "--hf-id",
        default=None,
        metavar="ORG/NAME",
        help="a Hugging Face hub model the pods download at start (an init container; the "
        "Secret hf-token, key token, for gated models) and serve",
    )
    group.add_argument("--image", default="jaxpar:latest", help="container image with jaxpar")
    group.add_argument(
        "--name", default=None, help="the LeaderWorkerSet's name (default: from the model's)"
    )
    group.add_argument("--replicas", type=int, default=1, help="slices to start with (default 1)")
    group.add_argument(
        "--max-replicas", type=int, default=4, help="the autoscaler's ceiling (default 4)"
    )
    group.add_argument(
        "--hpa-metric",
        default="vllm:num_requests_waiting",
        help="the autoscaler's per-leader metric as the cluster's metrics adapter names it "
        "(default vllm:num_requests_waiting; GKE managed Prometheus: "
        "'prometheus.googleapis.com|vllm:num_requests_waiting|gauge')",
    )
    group.add_argument(
        "--hpa-target",
        type=int,
        default=4,
        help="waiting requests per replica the autoscaler aims at (default 4)",
    )
    group.add_argument("--port", type=int, default=8000, help="the leader's HTTP port")
    group.add_argument(
        "--coordinator-port",
        type=int,
        default=8482,
        help="jax.distributed's coordinator port on the leader (default 8482)",
    )
    group.add_argument(
        "--compile-cache-size",
        default="20Gi",
        help="each pod's persistent compile-cache volume (default 20Gi)",
    )
    group.add_argument("--storage-class", default=None, help="of the compile-cache volumes")
    group.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="jaxpar serve's --kv-events-config for the leaders (its port is exposed)",
    )
    group.add_argument(
        "--serve-args",
        default="",
        metavar="FLAGS",
        help="further jaxpar serve flags, one string (e.g. '--max-num-seqs 64 --max-seq-len 4096')",
    )
    group.add_argument(
        "--startup-timeout",
        type=int,
        default=1800,
        metavar="S",
        help="seconds a leader may take to load and warm up before its probes count (default 1800)",
    )


def run_deploy(args: argparse.Namespace, console) -> int:
    """``jaxpar deploy``: prints the manifests."""
    from jaxpar.cli._common import degrees_given, parallel_config

    if not degrees_given(args):
        raise ConfigError(
            "jaxpar deploy needs a strategy: degrees (--tp, --dp, --sp, --ep) whose product is "
            "the slice's devices, or `jaxpar plan ... --deploy` to take the plan's"
        )
    parallel = parallel_config(args)
    slice_ = _slice_of(args, parallel.size)
    d = deployment(args, parallel, slice_, _serve_args(args.serve_args))
    print(render(d), end="")
    return 0


def _slice_of(args: argparse.Namespace, devices: int) -> Slice:
    if args.hardware.startswith("tpu"):
        if args.hosts is not None:
            raise ConfigError("--hosts: a TPU slice's hosts follow from --topology; drop --hosts")
        return tpu_slice(args.hardware, args.topology, devices)
    if args.topology is not None:
        raise ConfigError(f"--topology {args.topology}: {args.hardware} is not a TPU")
    if args.hardware not in deployable_kinds():
        raise ConfigError(
            f"--hardware {args.hardware}: not a kind jaxpar deploys; legal: "
            f"{', '.join(deployable_kinds())}"
        )
    from jaxpar.plan import load_hardware

    return gpu_slice(args.hardware, args.hosts, devices, load_hardware(args.hardware).domain_size)


def deployment(
    args: argparse.Namespace,
    parallel: ParallelConfig,
    slice_: Slice,
    serve_args: tuple[str, ...],
) -> Deployment:
    """The deployment the flags describe, checked.

    Raises:
        ConfigError: no model, a strategy that does not use exactly the slice's devices
            (the legal ones named), one ``jaxpar serve`` would refuse (disaggregated and
            pipelined, or disaggregated across hosts into groups of unequal size), a bad name, count or ``--kv-events-config``.
        IllegalStrategyError: the strategy breaks a rule for the model (``--hf`` here).
    """
    if args.hf is None and args.hf_id is None:
        raise ConfigError("jaxpar deploy needs a model: --hf DIR or --hf-id ORG/NAME")
    model = _model_here(args)
    prefill = _prefill(serve_args)
    if slice_.hosts > 1 and prefill is not None and prefill.size != parallel.size:
        raise ConfigError(
            f"--prefill {prefill}: across hosts the prefill and decode groups must have as "
            f"many devices (the K/V move one device to one device); decode {parallel} has "
            f"{parallel.size}, prefill {prefill.size} (or serve colocated: drop --prefill)"
        )
    _check_strategy(parallel, slice_, model, prefill)
    _check_counts(args)
    model_dir = args.hf if args.hf_id is None else f"/models/{args.hf_id.rsplit('/', 1)[-1]}"
    events, events_port = _kv_events(args.kv_events_config)
    return Deployment(
        name=_name(args),
        image=args.image,
        model_dir=str(model_dir),
        parallel=parallel,
        slice=slice_,
        hf_id=args.hf_id,
        serve_args=serve_args,
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        hpa_metric=args.hpa_metric,
        hpa_target=args.hpa_target,
        port=args.port,
        coordinator_port=args.coordinator_port,
        compile_cache_size=args.compile_cache_size,
        storage_class=args.storage_class,
        kv_events_config=events,
        kv_events_port=events_port,
        startup_timeout_s=args.startup_timeout,
    )


def _model_here(args: argparse.Namespace):
    """The model of ``--hf`` when it is a checkpoint directory on this machine, else None."""
    if args.hf is None or not (Path(args.hf) / "config.json").is_file():
        return None
    from jaxpar.cli._common import model_config

    return model_config(args)


def _check_strategy(parallel: ParallelConfig, slice_: Slice, model, prefill) -> None:
    """``parallel`` (and a disaggregated ``prefill`` strategy, on the devices after
    decode's) must use exactly the slice's devices."""
    if prefill is not None and (parallel.pp > 1 or prefill.pp > 1):
        raise ConfigError(
            f"{parallel} with prefill {prefill}: jaxpar serve runs disaggregated groups "
            "unpipelined (pp=1 in both); serve pipelined without --prefill, or "
            + _legal_text(slice_, model)
        )
    used = parallel.size + (prefill.size if prefill is not None else 0)
    if used != slice_.devices:
        what = f"{parallel} with prefill {prefill}" if prefill is not None else f"{parallel}"
        raise ConfigError(
            f"strategy {what} uses {used} devices but the slice ({slice_.describe()}) "
            f"has {slice_.devices}, and every process of a multi-host job must use all of its "
            "own; " + _legal_text(slice_, model)
        )
    if model is not None:
        from jaxpar.spec import validate

        validate(model, parallel, n_devices=parallel.size)
        if prefill is not None:
            validate(model, prefill, n_devices=prefill.size)


def _prefill(serve_args: tuple[str, ...]) -> ParallelConfig | None:
    """The ``--prefill STRATEGY`` among ``jaxpar serve``'s flags (disaggregated), if any."""
    for i, arg in enumerate(serve_args):
        if arg == "--prefill" and i + 1 < len(serve_args):
            return ParallelConfig.parse(serve_args[i + 1])
        if arg.startswith("--prefill="):
            return ParallelConfig.parse(arg.split("=", 1)[1])
    return None


def _legal_text(slice_: Slice, model) -> str:
    """``legal on these 8 devices: --tp 8; --dp 2 --tp 4; ...``."""
    legal = legal_strategies(slice_.devices, model)
    what = " for this model" if model is not None else ""
    if not legal:
        return f"no strategy of {slice_.devices} devices is legal{what}"
    flags = "; ".join(strategy_flags(p) for p in legal[:SHOWN_LEGAL])
    more = f" (and {len(legal) - SHOWN_LEGAL} more)" if len(legal) > SHOWN_LEGAL else ""
    return f"legal on its {slice_.devices} devices{what}: {flags}{more}"


def legal_strategies(devices: int, model=None) -> list[ParallelConfig]:
    """Unpipelined strategies of exactly ``devices`` devices (legal for ``model`` when
    given), tensor parallelism first."""
    from jaxpar.spec import validate

    out = []
    divisors = [k for k in range(1, devices + 1) if not devices % k]
    for dp, sp, ep in itertools.product(divisors, repeat=3):
        if devices % (dp * sp * ep):
            continue
        p = ParallelConfig(dp=dp, sp=sp, ep=ep, tp=devices // (dp * sp * ep))
        if model is not None:
            try:
                validate(model, p, n_devices=devices)
            except (IllegalStrategyError, ConfigError):
                continue
        elif ep > 1:  # whether a model has experts is not known: name dense strategies
            continue
        out.append(p)
    return sorted(out, key=lambda p: (-p.tp, p.ep, p.sp, p.dp))


def strategy_flags(parallel: ParallelConfig) -> str:
    """``--dp 2 --tp 4`` (``--tp 1`` for one device)."""
    flags = [f"--{a} {parallel.degree(a)}" for a in MESH_AXES if parallel.degree(a) > 1]
    return " ".join(flags) or "--tp 1"


def _check_counts(args: argparse.Namespace) -> None:
    counts = {
        "--replicas": args.replicas,
        "--max-replicas": args.max_replicas,
        "--hpa-target": args.hpa_target,
        "--startup-timeout": args.startup_timeout,
    }
    for flag, value in counts.items():
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.max_replicas < args.replicas:
        raise ConfigError(
            f"--max-replicas {args.max_replicas} is below --replicas {args.replicas}; give "
            f"--max-replicas {args.replicas} or more"
        )
    for flag, port in (("--port", args.port), ("--coordinator-port", args.coordinator_port)):
        if not 1 <= port <= 65535:
            raise ConfigError(f"{flag} {port}: a port is 1 to 65535")


def _name(args: argparse.Namespace) -> str:
    if args.name is not None:
        if not _NAME.match(args.name):
            raise ConfigError(
                f"--name {args.name!r}: LWS needs a DNS label of at most 40 characters: lower "
                "case letters, digits and '-', starting with a letter and not ending with '-'"
            )
        return args.name
    source = args.hf_id or Path(args.hf).resolve().name
    base = re.sub(r"[^a-z0-9]+", "-", source.rsplit("/", 1)[-1].lower()).strip("-")
    base = base.lstrip("0123456789-")[:40].rstrip("-")
    return base or "jaxpar"


def _kv_events(text: str | None) -> tuple[str | None, int | None]:
    """``--kv-events-config`` checked as ``jaxpar serve`` checks it, and the port its
    endpoint binds (exposed on the leader; None when it connects out instead)."""
    if text is None:
        return None, None
    from jaxpar.server import parse_kv_events_config

    config = parse_kv_events_config(text)
    bound = re.match(r"^tcp://(\*|0\.0\.0\.0|\[::\]|::):(\d+)$", config.endpoint)
    return text, int(bound.group(2)) if bound else None


def _serve_args(text: str) -> tuple[str, ...]:
    args = tuple(shlex.split(text))
    owned = {"--hf", "--host", "--port", "--kv-events-config", *(f"--{a}" for a in MESH_AXES)}
    clash = sorted({a.split("=")[0] for a in args} & owned)
    if clash:
        raise ConfigError(
            f"--serve-args {text!r}: {', '.join(clash)} are jaxpar deploy's own flags; give "
            "them to jaxpar deploy"
        )
    return args


def render(d: Deployment) -> str:
    """The manifests' YAML after a header saying what they deploy."""
    prefill = _prefill(d.serve_args)
    strategy = f"decode {d.parallel}, prefill {prefill}" if prefill else str(d.parallel)
    header = (
        f"jaxpar deploy: {d.name} serves {d.model_dir} with {strategy} on "
        f"{d.slice.describe()}, {d.replicas} to {d.max_replicas} replicas"
    )
    return to_yaml(manifests(d), header)


def plan_deployment(planning, args: argparse.Namespace) -> int:
    """``jaxpar plan ... --deploy``: the manifests for the plan's best strategy on the
    planned slice (one replica: one TPU slice, or the planned GPU hosts), with the serving
    flags the plan chose (slots, KV cache, longest request, prefill batch and tokens)."""
    from jaxpar.plan import serve_flags

    if args.hf is None:
        raise ConfigError(
            "jaxpar plan --deploy needs the checkpoint the pods serve: --hf DIR (a preset has "
            "no checkpoint)"
        )
    slice_ = _planned_slice(planning)
    best = _deployable(planning, slice_)
    flags = shlex.split(serve_flags(best, "").split("jaxpar serve", 1)[1])
    degrees = {f"--{a}" for a in MESH_AXES}
    rest = []
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        if flag not in degrees:
            rest += [flag, value]
    parallel = dataclasses.replace(best.config, microbatches=1, decode_groups=1)
    d = deployment(args, parallel, slice_, (*rest, *_serve_args(args.serve_args)))
    print(render(d), end="")
    return 0


def _planned_slice(planning) -> Slice:
    """The slice of a plan: one TPU slice of its devices, or its GPU hosts."""
    hardware, devices = planning.hardware, planning.devices
    if not hardware.name.startswith("tpu"):
        domain = hardware.domain(devices)
        return gpu_slice(hardware.name, devices // domain, devices, domain)
    layout = hardware.slice_topology(devices)
    if layout is not None and layout[1] > 1:
        raise ConfigError(
            f"the plan spans {layout[1]} slices of {math.prod(layout[0])} chips; a "
            "LeaderWorkerSet replica is one slice: plan for one slice's devices "
            f"(--devices {math.prod(layout[0])})"
        )
    topology = None if layout is None else "x".join(map(str, layout[0]))
    return tpu_slice(hardware.name, topology, devices)


def _deployable(planning, slice_: Slice):
    """The best plan ``jaxpar serve`` runs on ``slice_``: disaggregated only unpipelined,
    and across hosts only with groups of as many devices (the K/V move device to device)."""

    def serves(pred) -> bool:
        if pred.prefill_config is None:
            return True
        if pred.config.pp > 1 or pred.prefill_config.pp > 1:
            return False
        return slice_.hosts == 1 or pred.prefill_config.size == pred.config.size

    for pred in planning.ranked:
        if serves(pred):
            return pred
    raise ConfigError(
        f"no plan that fits is one jaxpar serve runs on this slice ({slice_.describe()}, "
        f"{slice_.hosts} hosts): disaggregated only unpipelined, into groups of as many "
        "devices"
    )
