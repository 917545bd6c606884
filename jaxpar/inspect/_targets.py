"""Programs for accelerators this process does not have, and the kernels inside them.

* :func:`tpu_devices`: the devices of a compile-only TPU topology (libtpu, no TPU). A mesh
  over them compiles real TPU programs on a CPU host: ``AbstractEngine.build(...,
  mesh=mesh).lower(phase, prompt_len=...).compile()`` gives TPU HLO, its
  ``memory_analysis()`` and its collectives.
* :func:`kernel_calls`: how many fused-attention kernels and ragged exchanges a lowered or
  compiled program calls, so that a silent fallback to XLA is visible (a kernel per layer
  is expected where one is chosen).
"""

from __future__ import annotations

import os
import re
from typing import Any, Protocol

import jax

from jaxpar.errors import ConfigError

#: Kernel -> pattern of one call of it, in the text where it can be told apart:
#: splash in compiled TPU HLO (Mosaic calls are all ``tpu_custom_call``; the instruction is
#: named after the kernel), cuDNN and Pallas GPU (Triton) in lowered StableHLO or compiled
#: HLO, ragged all-to-all in either.
KERNELS: dict[str, re.Pattern[str]] = {
    "splash": re.compile(r"%splash_mha_fwd\S* = .*custom_call_target=\"tpu_custom_call\""),
    "cudnn": re.compile(r"__cudnn\$fmha"),
    "triton": re.compile(r"__gpu\$xla\.gpu\.triton"),
    # Synchronous, or the start of an asynchronous pair (newer libtpu), or StableHLO's call.
    "ragged_all_to_all": re.compile(r" ragged-all-to-all(?:-start)?\(| @ragged_all_to_all\("),
}


class _HasText(Protocol):
    def as_text(self) -> str: ...


def kernel_calls(program: str | _HasText) -> dict[str, int]:
    """Calls of each of :data:`KERNELS` in ``program`` (text, ``Lowered`` or ``Compiled``).

    Counted per line: one call per layer in an unrolled model, one per loop body in a
    scanned one.
    """
    text = program if isinstance(program, str) else program.as_text()
    lines = text.splitlines()
    return {name: sum(bool(p.search(line)) for line in lines) for name, p in KERNELS.items()}


def tpu_devices(
    topology: str = "v5e:2x4",
    *,
    chips_per_host: tuple[int, int, int] = (2, 2, 1),
    library_path: str | None = None,
    num_slices: int = 1,
) -> list[Any]:
    """The devices of a compile-only TPU topology, to build a mesh on with no TPU attached.

    Loads libtpu (``library_path``, else ``$TPU_LIBRARY_PATH``, else the ``libtpu``
    package) as a PJRT plugin without starting a TPU backend, so the process keeps its CPU
    devices. Programs compiled over these devices cannot run here.

    Args:
        topology: ``"<chip>:<AxB>"`` as Cloud TPU names slices, e.g. ``"v5e:2x4"``.
        chips_per_host: chips per host of that slice (v5e: a host holds 2x2 chips).
        library_path: a ``libtpu.so`` of the same release as jax.
        num_slices: slices of that topology (multislice, joined by DCN): each device's
            ``slice_index`` says which.

    Raises:
        ConfigError: libtpu is not installed (``pip install "jax[tpu]"``) or does not know
            the topology.
    """
    if library_path is not None:
        os.environ["TPU_LIBRARY_PATH"] = library_path
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata server to ask
    # No chips to guard: let several processes (test workers) load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology,
            chip_config_name="default",
            chips_per_host_bounds=chips_per_host,
            num_slices=num_slices,
            wrap=(False, False, False),
        )
    except RuntimeError as e:
        raise ConfigError(
            f"cannot build the compile-only TPU topology {topology!r}: {e}; it needs libtpu "
            f'of jax {jax.__version__}\'s release (pip install "jax[tpu]=={jax.__version__}", '
            "or TPU_LIBRARY_PATH=<path to libtpu.so>)"
        ) from e
    return list(desc.devices)
