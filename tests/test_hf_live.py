"""Live Hugging Face oracle: re-run transformers and compare with the committed fixtures.

The fixtures under ``tests/fixtures/hf/`` (checkpoints plus ``reference.npz``) are made by
``scripts/make_hf_fixtures.py``. These tests need torch and transformers and are skipped,
with the reason, where either is missing (the project's own environment has neither). To run
them, use the HF venv; ``--noconftest`` because ``tests/conftest.py`` imports JAX, which that
venv does not have::

    .venv-hf/bin/python -m pytest --noconftest -m hf_live tests/test_hf_live.py

What is checked, per fixture:

* ``test_committed_reference_is_live``: transformers, loading the committed checkpoint files,
  reproduces the committed logits (within 1e-5) and greedy tokens (exactly);
* ``test_regenerated_fixture_matches``: rebuilding every fixture from its seed in a temporary
  directory with the script's own functions gives the committed tensors, configs and reference.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"hf_live needs torch and transformers, not importable here ({exc}); "
        "run with .venv-hf/bin/python -m pytest --noconftest -m hf_live tests/test_hf_live.py",
        allow_module_level=True,
    )

pytestmark = pytest.mark.hf_live

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "make_hf_fixtures.py"
FIXTURE_ROOT = REPO_ROOT / "tests" / "fixtures" / "hf"
LOGIT_TOL = 1e-5


def _load_script():
    spec = importlib.util.spec_from_file_location("make_hf_fixtures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


mk = _load_script()
NAMES = [spec.name for spec in mk.FIXTURES]


def _compare_reference(ours: dict, committed: dict, name: str) -> None:
    assert ours.keys() == committed.keys(), f"{name}: reference keys differ"
    for key, want in committed.items():
        got = ours[key]
        assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {key} dtype/shape"
        if key.startswith(("logits_", "greedy_logits_")):
            np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL, err_msg=f"{name}: {key}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"{name}: {key}")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_fixtures")
    mk.build_all(out)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_committed_reference_is_live(name: str) -> None:
    mk.set_determinism()
    fixture_dir = FIXTURE_ROOT / name
    committed = mk.check_reference_shapes(fixture_dir)
    model = mk.load_model(fixture_dir)
    n = int(committed["n_prompts"])
    prompts = [committed[f"tokens_{i}"] for i in range(n)]
    ours = mk.compute_reference(model, prompts)
    _compare_reference(ours.arrays, committed, name)


@pytest.mark.parametrize("name", NAMES)
def test_regenerated_fixture_matches(name: str, regenerated: Path) -> None:
    committed_dir = FIXTURE_ROOT / name
    new_dir = regenerated / name

    committed_files = sorted(p.name for p in committed_dir.iterdir())
    new_files = sorted(p.name for p in new_dir.iterdir())
    assert new_files == committed_files, f"{name}: file lists differ"

    # config.json: identical apart from the writing library's version stamp.
    def config(d: Path) -> dict:
        c = json.loads((d / "config.json").read_text())
        c.pop("transformers_version", None)
        return c

    assert config(new_dir) == config(committed_dir), f"{name}: config.json differs"

    # Weights: bit-identical (same seeds, same initialisation).
    ours, theirs = mk.read_safetensors(new_dir), mk.read_safetensors(committed_dir)
    assert ours.keys() == theirs.keys(), f"{name}: tensor names differ"
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{name}: {key}")

    if (committed_dir / "model.safetensors.index.json").exists():
        index = json.loads((committed_dir / "model.safetensors.index.json").read_text())
        new_index = json.loads((new_dir / "model.safetensors.index.json").read_text())
        assert new_index["weight_map"] == index["weight_map"], f"{name}: shard index differs"

    if (committed_dir / mk.TOKENIZER_JSON).exists():
        assert (new_dir / mk.TOKENIZER_JSON).read_bytes() == (
            committed_dir / mk.TOKENIZER_JSON
        ).read_bytes(), f"{name}: tokenizer.json differs"

    new_meta = json.loads((new_dir / mk.REFERENCE_JSON).read_text())
    meta = json.loads((committed_dir / mk.REFERENCE_JSON).read_text())
    assert new_meta["seed"] == meta["seed"], f"{name}: a different seed was chosen"

    _compare_reference(
        mk.load_npz(new_dir / mk.REFERENCE_NPZ), mk.load_npz(committed_dir / mk.REFERENCE_NPZ), name
    )
