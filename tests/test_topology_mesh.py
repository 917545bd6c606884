"""Meshes from the TPU slice's torus: every degree assignment lays out, tp on ICI neighbours.

The first tests use stand-in chips (``jaxpar.spec.slice_devices``) and need no libtpu; those
marked ``jax_compat`` lay out and compile over libtpu's compile-only topologies (DESIGN
§17), as ``tests/test_accelerator_compile.py`` does: the real chips' coordinates, the real
``make_mesh`` path, real TPU HLO.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import MeshError
from jaxpar.plan import Workload, load_hardware, placement, plan
from jaxpar.plan._enumerate import factorizations
from jaxpar.spec import (
    MESH_AXES,
    ParallelConfig,
    dcn_shape,
    make_mesh,
    mesh_layout,
    slice_devices,
    slice_layout,
    slice_order,
    tpu_device_array,
)

#: Compile-only topologies libtpu accepts (DESIGN §17): (name, chip kind, torus shape).
TOPOLOGIES = [
    ("v5e:2x2", "TPU v5 lite", (2, 2)),
    ("v5e:2x4", "TPU v5 lite", (2, 4)),
    ("v5e:4x4", "TPU v5 lite", (4, 4)),
    ("v5e:8x8", "TPU v5 lite", (8, 8)),
    ("v5p:2x2x1", "TPU v5", (2, 2, 1)),
    ("v5p:2x2x2", "TPU v5", (2, 2, 2)),
    ("v5p:2x2x4", "TPU v5", (2, 2, 4)),
    ("v5p:4x4x4", "TPU v5", (4, 4, 4)),
    ("v6e:2x2", "TPU v6 lite", (2, 2)),
    ("v6e:2x4", "TPU v6 lite", (2, 4)),
    ("v6e:4x4", "TPU v6 lite", (4, 4)),
]


def _is_box(chips) -> bool:
    """The chips fill a box of the torus: each coordinate's values consecutive, no holes
    (checked from the coordinates alone, not from ``mesh_layout``)."""
    coords = np.array([c.coords for c in chips])
    lo, hi = coords.min(axis=0), coords.max(axis=0)
    return int(np.prod(hi - lo + 1)) == len({tuple(c) for c in coords})


def _groups(array: np.ndarray, axis: str) -> np.ndarray:
    """The device groups of one mesh axis of an array in ``MESH_AXES`` order."""
    k = MESH_AXES.index(axis)
    return np.moveaxis(array, k, -1).reshape(-1, array.shape[k])


def _all_degrees(n: int):
    return list(factorizations(n))


@pytest.mark.parametrize(("name", "kind", "shape"), TOPOLOGIES, ids=[t[0] for t in TOPOLOGIES])
def test_every_degree_assignment_lays_out_with_tp_on_a_box_of_neighbours(name, kind, shape):
    chips = slice_devices(kind, shape)
    for degrees in _all_degrees(len(chips)):
        array = tpu_device_array(degrees, chips)
        assert sorted(c.id for c in array.flat) == list(range(len(chips)))
        for group in _groups(array, "tp"):
            assert _is_box(group), (name, degrees, [c.coords for c in group])


def test_layout_says_what_each_axis_spans_and_when_it_is_split():
    """The figures the issue names: dp2.tp8 on a 4x4 slice splits y; tp16 takes it all."""
    v6e = ("TPU v6 lite", (4, 4))
    dp, tp = slice_layout(ParallelConfig.parse("dp=2,tp=8").shape, *v6e)
    assert (tp.axis, tp.degree, tp.spans) == ("tp", 8, (("x", 4, 4), ("y", 2, 4)))
    assert tp.split and tp.contiguous and str(tp).startswith("tp=8 over x(4)·y(2 of 4), split")
    assert (dp.spans, dp.split, dp.contiguous) == ((("y", 2, 4),), True, False)  # y, y+2
    (whole,) = slice_layout(ParallelConfig.parse("tp=16").shape, *v6e)
    assert not whole.split and whole.contiguous and whole.spans == (("x", 4, 4), ("y", 4, 4))
    ep, tp = slice_layout(ParallelConfig.parse("ep=8,tp=8").shape, "TPU v5", (4, 4, 4))
    assert tp.contiguous and {n for n, _, _ in tp.spans} | {n for n, _, _ in ep.spans} == {
        "x",
        "y",
        "z",
    }


def test_only_dp_and_pp_cross_slices():
    """Two slices: dp (else pp) spans them; an assignment that would put sp, ep or tp over
    the DCN is refused before anything is built, naming what would be legal."""
    assert dcn_shape(ParallelConfig.parse("dp=2,tp=8").shape, 2) == (2, 1, 1, 1, 1)
    assert dcn_shape(ParallelConfig.parse("pp=2,tp=8").shape, 2) == (1, 2, 1, 1, 1)
    assert dcn_shape(ParallelConfig.parse("dp=2,pp=2,tp=4").shape, 4) == (2, 2, 1, 1, 1)
    chips = slice_devices("TPU v5 lite", (2, 4), n_slices=2)
    for text in ("dp=2,tp=8", "pp=2,tp=8", "dp=4,tp=4", "dp=2,pp=2,tp=4"):
        degrees = ParallelConfig.parse(text).shape
        array = tpu_device_array(degrees, chips)
        for axis in ("sp", "ep", "tp"):
            for group in _groups(array, axis):
                assert len({c.slice_index for c in group}) == 1, (text, axis)
        layout = {a.axis: a for a in slice_layout(degrees, "TPU v5 lite", (2, 4), 2)}
        assert any(a.over_dcn for a in layout.values())
        assert all(a.axis in ("dp", "pp") for a in layout.values() if a.over_dcn)
    with pytest.raises(MeshError, match=r"\[slices\].*dp\*pp.*multiple of 2"):
        tpu_device_array(ParallelConfig.parse("sp=2,tp=8").shape, chips)


def test_the_planner_prints_only_plans_that_lay_out_and_says_how():
    """On two v5e 2x2 slices (--hosts 2) every plan ranked lays out with only dp/pp over the
    DCN, the rest are refused under the rule "topology"; each plan carries its layout."""
    from jaxpar.models import preset

    hardware = load_hardware("tpu-v5e").with_hosts(8, 2)
    w = Workload(batch=8, prompt_len=64, gen_len=16)
    planning = plan(preset("tiny-dense"), hardware, 8, w)
    where = placement(hardware, 8)
    assert where is not None and where.slice_name == "2 x 2x2"
    topology = [r for r in planning.refused if r.rule == "topology"]
    assert topology and all("[slices]" in r.reason for r in topology)
    for pred in planning.ranked:
        assert pred.layout == where.describe(pred.config)
        if pred.prefill_config is None:
            array = tpu_device_array(pred.config.shape, slice_devices(where.device_kind, (2, 2), 2))
            assert {a for a in MESH_AXES if _crosses(array, a)} <= {"dp", "pp"}, pred.label


def _crosses(array: np.ndarray, axis: str) -> bool:
    return any(len({c.slice_index for c in g}) > 1 for g in _groups(array, axis))


def test_usable_hbm_per_chip_is_libtpus_figure():
    """The hardware files state what libtpu lets a program use (its OOM message's
    "available HBM"), read by ``test_hardware_hbm_matches_libtpus_oom_message``."""
    assert [load_hardware(k).hbm_gib for k in ("tpu-v5e", "tpu-v6e", "tpu-v5p")] == [
        15.75,
        31.24,
        95.73,
    ]


def test_explain_divides_per_layer_parameters_over_pp():
    """A device holds only its stage's layers: per-layer rows halve under pp=2, the rest
    (embedding, final norm, head) do not."""
    from jaxpar.cli._explain import parameter_rows
    from jaxpar.models import preset

    config = preset("tiny-dense")
    flat = {r["tensor"]: r for r in parameter_rows(config, ParallelConfig(tp=2))}
    staged = {r["tensor"]: r for r in parameter_rows(config, ParallelConfig(pp=2, tp=2))}
    for name, row in flat.items():
        per_layer = name.startswith("layers.*.")
        assert staged[name]["count"] == row["count"]
        want = row["bytes_per_device"] // 2 if per_layer else row["bytes_per_device"]
        assert staged[name]["bytes_per_device"] == want, name
        if per_layer:
            assert staged[name]["layers_per_device"] == config.n_layers // 2


def test_cpu_meshes_are_built_as_before():
    """Simulated CPU devices keep ``jax.make_mesh``'s order and no layout is claimed."""
    config = ParallelConfig.parse("dp=2,tp=4")
    devices = jax.devices()  # conftest: 8 simulated CPU devices
    mesh = make_mesh(config, devices)
    want = jax.make_mesh(config.shape, MESH_AXES, devices=devices)
    order = [mesh.axis_names.index(a) for a in MESH_AXES]
    assert [d.id for d in mesh.devices.transpose(order).flat] == [d.id for d in want.devices.flat]
    assert mesh_layout(mesh) is None and slice_order(devices) == devices


# --- compile-only TPU topologies (libtpu) -------------------------------------------------


def _libtpu() -> str:
    from tests._accelerator_cases import bench

    path, _ = bench.libtpu()
    if path is None:
        pytest.fail("no libtpu under <venv>/accel/tpu: run scripts/test.sh, which installs it")
    return path


def _tpu(topology: str, num_slices: int = 1) -> list:
    from jaxpar.inspect import tpu_devices

    return tpu_devices(topology, library_path=_libtpu(), num_slices=num_slices)


@pytest.mark.jax_compat
@pytest.mark.accel
def test_real_chips_lay_out_every_assignment_as_the_planner_does():
    """Over each compile-only topology's chips, every factorisation of the chip count into
    (dp, pp, sp, ep, tp) gets a mesh (no compile), its tp groups are boxes of neighbouring
    chips, and its layout is the one the planner computes from stand-in chips."""
    for name, kind, shape in TOPOLOGIES:
        chips = _tpu(name)
        assert chips[0].device_kind == kind
        for degrees in _all_degrees(len(chips)):
            mesh = make_mesh(ParallelConfig(**dict(zip(MESH_AXES, degrees, strict=True))), chips)
            tp = mesh.devices.transpose([mesh.axis_names.index(a) for a in MESH_AXES])
            assert all(_is_box(g) for g in _groups(tp, "tp")), (name, degrees)
            assert mesh_layout(mesh) == slice_layout(degrees, kind, shape), (name, degrees)


def _compile_tp_psum(mesh) -> str:
    """A matmul whose contraction is split over tp (an all-reduce over tp), batch over
    the rest: the compiled TPU HLO text."""
    batch = tuple(a for a in mesh.axis_names if a != "tp" and mesh.shape[a] > 1)
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(batch, "tp")))
    w = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    out = NamedSharding(mesh, P(batch, None))
    return jax.jit(jnp.matmul, out_shardings=out).trace(x, w).lower().compile().as_text()


def _replica_groups(hlo: str) -> list[list[int]]:
    """The first all-reduce's replica groups (``{{0,1},{2,3}}`` or iota form)."""
    line = next(ln for ln in hlo.splitlines() if re.search(r"all-reduce(-start)?\(", ln))
    m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if m:
        return [list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](T\(([\d,]+)\))?", line)
    assert m, line
    n, k = int(m.group(1)), int(m.group(2))
    ids = np.arange(n * k).reshape([int(d) for d in m.group(3).split(",")])
    if m.group(5):
        ids = ids.transpose([int(d) for d in m.group(5).split(",")])
    return ids.reshape(n, k).tolist()


@pytest.mark.jax_compat
@pytest.mark.usefixtures("accelerator_compiles")
@pytest.mark.parametrize(
    ("topology", "strategy"),
    [("v6e:4x4", "dp=2,tp=8"), ("v6e:4x4", "sp=2,tp=8"), ("v5p:4x4x4", "ep=8,tp=8")],
)
@pytest.mark.accel
def test_issue_strategies_build_and_compile_with_tp_reduced_over_neighbours(topology, strategy):
    """The layouts ``jax.make_mesh`` refused: the mesh builds, a tp-reduced matmul compiles
    for TPU, and its all-reduce runs over exactly the mesh's tp groups, each a box of
    neighbouring chips (HLO device ids are positions in the mesh's device list)."""
    chips = _tpu(topology)
    mesh = make_mesh(ParallelConfig.parse(strategy), chips)
    flat = list(mesh.devices.flat)
    groups = sorted(sorted(g) for g in _replica_groups(_compile_tp_psum(mesh)))
    k = mesh.axis_names.index("tp")
    tp = np.moveaxis(mesh.devices, k, -1).reshape(-1, mesh.shape["tp"])
    want = sorted(sorted(flat.index(d) for d in g) for g in tp)
    assert groups == want
    assert all(_is_box([flat[i] for i in g]) for g in groups)


@pytest.mark.jax_compat
@pytest.mark.usefixtures("accelerator_compiles")
@pytest.mark.accel
def test_two_slices_put_dp_over_the_dcn_and_compile():
    """libtpu's compile-only topology takes ``num_slices=2``: the hybrid mesh puts dp
    across the slices, tp inside one, and the program compiles; sp across slices is
    refused with the rule named."""
    chips = _tpu("v5e:2x4", num_slices=2)
    assert sorted({c.slice_index for c in chips}) == [0, 1]
    mesh = make_mesh(ParallelConfig.parse("dp=2,tp=8"), chips)
    layout = {a.axis: a for a in mesh_layout(mesh)}
    assert layout["dp"].over_dcn and not layout["tp"].over_dcn and layout["tp"].contiguous
    assert layout == {a.axis: a for a in slice_layout((2, 1, 1, 1, 8), "TPU v5 lite", (2, 4), 2)}
    flat = list(mesh.devices.flat)
    for g in _replica_groups(_compile_tp_psum(mesh)):
        assert len({flat[i].slice_index for i in g}) == 1
    with pytest.raises(MeshError, match=r"\[slices\]"):
        make_mesh(ParallelConfig.parse("sp=2,tp=8"), chips)


@pytest.mark.jax_compat
@pytest.mark.parametrize(
    ("name", "hardware", "devices", "topology"),
    [("tiny-gqa", "tpu-v6e", 16, "v6e:4x4"), ("tiny-moe", "tpu-v5p", 16, "v5p:2x2x4")],
)
@pytest.mark.accel
def test_every_plan_printed_builds_on_the_slice(name, hardware, devices, topology):
    """Every plan ``jaxpar plan`` ranks gets a mesh on the real chips (a disaggregated plan:
    both groups, in slice order as ``jaxpar serve`` takes them), with the layout it prints.
    (Every colocated strategy of the larger slices is checked above, without the planner's
    minutes.)"""
    from jaxpar.models import preset

    planning = plan(
        preset(name),
        load_hardware(hardware),
        devices,
        Workload(batch=8, prompt_len=128, gen_len=16),
    )
    chips = slice_order(_tpu(topology))
    for pred in planning.ranked:
        mesh = make_mesh(pred.config, chips[: pred.config.size])
        assert "; ".join(map(str, mesh_layout(mesh))) == pred.layout, pred.label
        if pred.prefill_config is not None:
            rest = chips[pred.config.size : pred.config.size + pred.prefill_config.size]
            prefill = make_mesh(pred.prefill_config, rest)
            assert "; ".join(map(str, mesh_layout(prefill))) == pred.prefill_layout


@pytest.mark.jax_compat
@pytest.mark.usefixtures("accelerator_compiles")
@pytest.mark.accel
def test_hardware_hbm_matches_libtpus_oom_message():
    """Compiling a program far too large for one chip: libtpu's "available HBM (XG)" is
    the hardware file's ``hbm_gib`` to its last hundredth, never below it (G = GiB: 600.00G
    reported for 3 x 200 GiB)."""
    for topology, kind in (
        ("v5e:2x2", "tpu-v5e"),
        ("v6e:2x2", "tpu-v6e"),
        ("v5p:2x2x1", "tpu-v5p"),
    ):
        chip = _tpu(topology)[0]
        mesh = jax.sharding.Mesh(np.array([chip]), ("x",))
        s = NamedSharding(mesh, P())
        big = jax.ShapeDtypeStruct((200 * 2**30 // 4,), jnp.float32, sharding=s)
        fn = jax.jit(lambda a: jnp.sin(a) * 2 + jnp.cos(a)[::-1], out_shardings=s)
        with pytest.raises(Exception, match="available HBM") as e:
            fn.trace(big).lower().compile()
        available = float(re.search(r"available HBM \(([\d.]+)G\)", str(e.value)).group(1))
        # libtpu 0.0.50.1 (jax 0.12): 15.75, 31.24, 95.73; 0.0.42.1 (jax 0.10): 31.25, 95.74.
        assert available - 0.02 <= load_hardware(kind).hbm_gib <= available, topology


def test_plan_cli_takes_a_topology_and_prints_the_layout(capsys):
    """``--topology 2x2`` on 8 v6e chips: two slices; the line names them and what each axis
    of the best plan spans, the JSON carries it per plan, and the header counts the
    strategies the topology refused."""
    import json

    from jaxpar.cli import main

    args = ["plan", "--model", "tiny-dense", "--devices", "8", "--hardware", "tpu-v6e"]
    args += ["--topology", "2x2", "--batch", "8", "--prompt-len", "64", "--gen-len", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "refused by the validator or the slice's topology" in out
    layout = re.search(r"layout: slice 2 x 2x2: (.*?) (run|serve):", out)
    assert layout and "DCN(2 slices)" in layout.group(1), out[-600:]
    assert main([*args, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["layout"] for p in plans)
    assert main([*args[:-6], "--topology", "3x3", *args[-6:]]) == 2  # 8 chips: not 9's slices
    assert "not whole slices of 9 chips" in capsys.readouterr().out.replace("\n", " ")
