"""What a Kubernetes cluster calls a slice: the node labels, resource and pods of one.

A TPU slice on GKE is a node pool of TPU VMs, each a Kubernetes node with some chips; a
pod of the slice runs on each node and requests all its chips (``google.com/tpu``). The
chip count and torus shape of each slice come from jaxpar's hardware files
(:mod:`jaxpar.plan`, the slices Cloud TPU names); GKE's node labels and chips per VM are
here, from GKE's TPU documentation ("Plan TPUs in GKE"): v5e and v6e slices of up to 8
chips are one VM with all of them (machine types ``ct5lp-hightpu-{1,4,8}t``,
``ct6e-standard-{1,4,8}t``), larger slices are VMs of 4 chips; v5p VMs have 4 chips
(``ct5p-hightpu-4t``). A GPU "slice" is ``hosts`` nodes of as many GPUs each
(``nvidia.com/gpu``), labelled as GKE labels its GPU nodes.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.errors import ConfigError

#: GKE's ``cloud.google.com/gke-tpu-accelerator`` label of each TPU kind.
TPU_ACCELERATORS = {
    "tpu-v5e": "tpu-v5-lite-podslice",
    "tpu-v6e": "tpu-v6e-slice",
    "tpu-v5p": "tpu-v5p-slice",
}
#: Chips per VM of a multi-host slice; a v5e or v6e slice of at most
#: :data:`SINGLE_HOST_CHIPS` chips is one VM.
TPU_CHIPS_PER_HOST = {"tpu-v5e": 4, "tpu-v6e": 4, "tpu-v5p": 4}
SINGLE_HOST_CHIPS = {"tpu-v5e": 8, "tpu-v6e": 8, "tpu-v5p": 4}
#: GKE's ``cloud.google.com/gke-accelerator`` label of each GPU kind (the 80 GB A100).
GPU_ACCELERATORS = {
    "h100": "nvidia-h100-80gb",
    "h200": "nvidia-h200-141gb",
    "a100": "nvidia-a100-80gb",
}

TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclasses.dataclass(frozen=True)
class Slice:
    """One replica's hardware: ``hosts`` pods of ``devices_per_host`` devices each, on nodes
    carrying ``node_selector``, each pod requesting ``resource``."""

    kind: str
    hosts: int
    devices_per_host: int
    resource: str
    node_selector: tuple[tuple[str, str], ...]
    topology: str | None = None  # TPU: the torus shape, e.g. "4x4"

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    def describe(self) -> str:
        """``tpu-v5e 4x4: 4 hosts x 4 chips`` / ``h100: 2 hosts x 8 GPUs``."""
        unit = "chips" if self.resource == TPU_RESOURCE else "GPUs"
        shape = f" {self.topology}" if self.topology else ""
        hosts = f"{self.hosts} host{'s' if self.hosts != 1 else ''}"
        return f"{self.kind}{shape}: {hosts} x {self.devices_per_host} {unit}"


def deployable_kinds() -> tuple[str, ...]:
    return (*TPU_ACCELERATORS, *GPU_ACCELERATORS)


def tpu_topologies(kind: str) -> list[str]:
    """The slice shapes of TPU ``kind`` that jaxpar's hardware file names, smallest first."""
    from jaxpar.plan import load_hardware

    slices = load_hardware(kind).slices
    return ["x".join(map(str, slices[chips])) for chips in sorted(slices)]


def tpu_slice(kind: str, topology: str | None, devices: int) -> Slice:
    """The TPU slice ``topology`` of ``kind`` (default: Cloud TPU's slice of ``devices``
    chips).

    Raises:
        ConfigError: ``kind`` is not a TPU kind GKE serves, or the topology is not one of
            its slices (the message lists them).
    """
    if kind not in TPU_ACCELERATORS:
        raise ConfigError(
            f"--hardware {kind}: not a TPU kind jaxpar deploys; TPU kinds: "
            f"{', '.join(TPU_ACCELERATORS)}"
        )
    legal = tpu_topologies(kind)
    if topology is None:
        from jaxpar.plan import load_hardware

        shape = load_hardware(kind).slices.get(devices)
        if shape is None:
            raise ConfigError(
                f"{kind} has no slice of {devices} chips (the strategy's device count); give "
                f"--topology, one of {', '.join(legal)}, and degrees whose product is its chips"
            )
        topology = "x".join(map(str, shape))
    topology = topology.lower()
    if topology not in legal:
        raise ConfigError(f"--topology {topology}: not a {kind} slice; legal: {', '.join(legal)}")
    chips = math.prod(int(x) for x in topology.split("x"))
    per_host = chips if chips <= SINGLE_HOST_CHIPS[kind] else TPU_CHIPS_PER_HOST[kind]
    labels = (
        ("cloud.google.com/gke-tpu-accelerator", TPU_ACCELERATORS[kind]),
        ("cloud.google.com/gke-tpu-topology", topology),
    )
    return Slice(kind, chips // per_host, per_host, TPU_RESOURCE, labels, topology)


def gpu_slice(kind: str, hosts: int | None, devices: int, domain_size: int) -> Slice:
    """``devices`` GPUs of ``kind`` over ``hosts`` nodes (default: as few as hold them,
    ``domain_size`` GPUs per node at most).

    Raises:
        ConfigError: the GPUs do not split evenly over the hosts, or a host would need
            more than ``domain_size``.
    """
    if kind not in GPU_ACCELERATORS:
        raise ConfigError(
            f"--hardware {kind}: not a kind jaxpar deploys; legal: {', '.join(deployable_kinds())}"
        )
    hosts = hosts or -(-devices // domain_size)
    if hosts < 1 or devices % hosts or devices // hosts > domain_size:
        fits = [h for h in range(1, devices + 1) if not devices % h and devices // h <= domain_size]
        raise ConfigError(
            f"--hosts {hosts}: the strategy's {devices} GPUs do not split evenly over {hosts} "
            f"hosts of at most {domain_size} {kind} GPUs; legal --hosts: "
            f"{', '.join(map(str, fits))}"
        )
    labels = (("cloud.google.com/gke-accelerator", GPU_ACCELERATORS[kind]),)
    return Slice(kind, hosts, devices // hosts, GPU_RESOURCE, labels)
