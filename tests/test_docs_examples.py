"""Every ```python block of README.md and of the documentation pages runs verbatim.

Each block runs on its own, in a fresh interpreter with 8 simulated CPU devices, as a reader
who copies it would run it. The README repeats a few of the pages' examples (its quickstart):
a block that appears in several places runs once, under the page it is first found on. Blocks
tagged after their language (```python serve, ```python structured) need a server:
tests/test_serve.py and tests/test_structured.py run the serving page's against one, and the
README's copies are checked to be the serving page's here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = ROOT / "scripts" / "docs" / "pages"
SOURCES = [*sorted(PAGES.rglob("*.md")), README]


def fenced(path: Path, info: str) -> list[str]:
    """The bodies of the blocks of ``path`` whose fence says exactly ``info``."""
    pattern = rf"^```{re.escape(info)}\n(.*?)^```"
    return re.findall(pattern, path.read_text(), flags=re.M | re.S)


def _examples() -> dict[str, str]:
    """Each distinct python block -> where it is first found (``page.md:index``)."""
    examples: dict[str, str] = {}
    for path in SOURCES:
        for index, block in enumerate(fenced(path, "python")):
            examples.setdefault(block, f"{path.relative_to(ROOT)}:{index}")
    return examples


EXAMPLES = _examples()
BLOCKS = list(EXAMPLES)


def test_readme_and_pages_have_python_blocks():
    assert len(fenced(README, "python")) >= 2, "README.md lost its python examples"
    on_pages = {where.split(":")[0] for where in EXAMPLES.values()}
    for page in ("getting-started.md", "spec-layer.md", "quantization.md", "serving.md"):
        assert any(where.endswith(page) for where in on_pages), f"{page} lost its python examples"


# Each block in a process of its own: the full tier (`server`: scripts/test.sh --fast leaves it out).
@pytest.mark.server
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=list(EXAMPLES.values()))
def test_python_block_runs(index, tmp_path):
    block = BLOCKS[index]
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # blocks run as a user's would, cache-less
    env["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    script = tmp_path / f"docs_block_{index}.py"
    script.write_text(block)
    # Blocks name checkpoint directories as seen from the repository root.
    for fixture in set(re.findall(r'"(tests/fixtures/[\w/]+)"', block)):
        shutil.copytree(ROOT / fixture, tmp_path / fixture)
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{EXAMPLES[block]}:\n{block}\n{proc.stderr[-3000:]}"
    # A PartitionSpec the block prints is one its comments show (`# P(None, 'tp'): ...`).
    comments = re.findall(r"#\s+(.*)$", block, flags=re.M)
    for line in proc.stdout.splitlines():
        if re.match(r"^(\w+ )?P\(", line):
            assert any(c.startswith(line) for c in comments), (EXAMPLES[block], line, comments)


def test_serving_examples_elsewhere_are_the_serving_page_s():
    # The README's and Getting started's server commands and requests are copies of the
    # blocks tests/test_serve.py runs against a server: a copy that drifts fails here.
    serving = PAGES / "serving.md"
    tested = {lang: fenced(serving, f"{lang} serve") for lang in ("bash", "python")}
    assert tested["bash"] and tested["python"], "serving.md lost its served examples"
    checked = 0
    for path in SOURCES:
        if path == serving:
            continue
        for lang in ("bash", "python"):
            copies = fenced(path, f"{lang} serve")
            copies += [
                b for b in fenced(path, lang) if b.startswith(("jaxpar serve --hf", "curl -s"))
            ]
            for block in copies:
                assert block in tested[lang], f"{path.name}: not a block of serving.md:\n{block}"
                checked += 1
    assert checked >= 4, "the README and Getting started lost their serving examples"


def test_streaming_callback_gets_minus_one_for_padding_and_finished_rows():
    # Getting started's description of the callback (issue 11, item 14), checked: 2 prompts in a batch of
    # 4, prompt 0 stops at its first token, prompt 1 never stops.
    config = jaxpar.preset("tiny-dense")
    parallel = ParallelConfig(dp=2)
    engine = jaxpar.InferenceEngine(
        config,
        jaxpar.init_params(config, seed=0),
        parallel,
        max_batch=4,
        max_seq_len=32,
        mesh=jaxpar.make_mesh(parallel, jax.devices()[:2]),
    )
    prompts = [[5, 6, 7], [8, 9]]
    free = engine.generate(prompts, 4).tokens
    stop = free[0][0]
    assert stop not in free[1], "pick prompts whose second row does not emit the stop token"
    calls = []
    out = engine.generate(
        prompts,
        4,
        stop_tokens=[stop],
        callback=lambda step, tokens_B: calls.append((step, tokens_B.copy())),
    )
    assert [step for step, _ in calls] == [0, 1, 2, 3]
    streamed = np.stack([tokens_B for _, tokens_B in calls], axis=1)  # [rows, steps]
    assert streamed.shape == (4, 4) and streamed.dtype == np.int32
    assert (streamed[2:] == -1).all()  # padding rows
    assert streamed[0].tolist() == [stop, -1, -1, -1]  # finished after its stop token
    assert streamed[1].tolist() == free[1]
    assert out.tokens == [[stop], free[1]]


def test_spec_layer_comments_state_the_results():
    # `expr  # P(...)` / `# Status.X` lines of the spec-layer block say what expr returns.
    block = next(b for b in BLOCKS if "jaxpar.partition_spec(" in b)
    namespace: dict = {}
    exec(block, namespace)  # the block needs the spec layer only
    claims = re.findall(r"^(jaxpar\.\S.*?)\s+# (P\(.*?\)|Status\.\w+)$", block, flags=re.M)
    assert len(claims) >= 3, claims
    for expr, claim in claims:
        value = eval(expr, namespace)
        shown = str(value) if claim.startswith("P(") else f"Status.{value.name}"
        assert shown == claim, (expr, shown, claim)


def test_readme_links_point_at_files_that_exist():
    # The README links the pages by relative path (GitHub renders them); the site's own
    # links are checked by its strict build (tests/test_docs_build.py).
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
