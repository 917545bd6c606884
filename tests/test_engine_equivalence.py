"""Every legal way to split the 8 devices over dp, sp, ep, tp equals the single-device run.

Prefill logits within 1e-4 (f32) and 16 greedy tokens identical, for a batch of prompts of
different lengths; illegal assignments are rejected before anything compiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpar.errors import IllegalStrategyError
from jaxpar.spec import ParallelConfig
from tests._engine_util import PROMPTS, engine, factorizations, reference
from tests._tiers import sweep

# Every set of axes the 8 devices can be split over. Sub-meshes (2 or 4 devices) add no
# layout these lack (each axis appears here at 2, 4 and 8, alone and mixed), and tp2,
# dp2·tp2, sp2·tp2 run in most other engine tests.
STRATEGIES = [ParallelConfig(dp=dp, sp=sp, ep=ep, tp=tp) for dp, sp, ep, tp in factorizations(8, 4)]
# Two axes split 4 x 2 or 2 x 4 take the same code path at either size (every size here
# divides the heads, experts, batch and prompt bucket evenly): one order of each pair runs,
# chosen so that every axis still runs at 2, 4 and 8, and the multi-process strategies
# (sp2·tp4, ep4·tp2: tests/_mp_worker.py) run here too. Left out, with the case that takes
# their path: dp4·sp2 (dp2·sp4), dp2·tp4 (dp4·tp2), sp4·tp2 (sp2·tp4), dp2·ep4
# (dp4·ep2), sp4·ep2 (sp2·ep4), ep2·tp4 (ep4·tp2).
SAME_PATH = {"dp4-sp2-ep1-tp1", "dp2-sp1-ep1-tp4", "dp1-sp4-ep1-tp2"}
SAME_PATH |= {"dp2-sp1-ep4-tp1", "dp1-sp4-ep2-tp1", "dp1-sp1-ep2-tp4"}


def _moe_without_ep(c: ParallelConfig) -> bool:
    return (c.dp, c.sp, c.tp) in ((1, 1, 8), (1, 2, 4))


def _id(c: ParallelConfig) -> str:
    return f"dp{c.dp}-sp{c.sp}-ep{c.ep}-tp{c.tp}"


CASES = [
    (name, parallel)
    for name in ("tiny-dense", "tiny-moe")
    for parallel in STRATEGIES
    if _id(parallel) not in SAME_PATH
    # A dense model refuses ep > 1 (tested once below). The MoE model runs every strategy
    # that splits its experts, and without ep only those that differ from the dense model's
    # paths (tp inside the experts, sp groups): dp/sp/tp mixes alone repeat tiny-dense.
    if (parallel.ep == 1 if name == "tiny-dense" else parallel.ep > 1 or _moe_without_ep(parallel))
]
# The fast tier's points: dp, sp and tp together on the dense model; the experts split
# beside dp and tp, and over all 8 devices.
FAST = {
    ("tiny-dense", "dp2-sp2-ep1-tp2"),
    ("tiny-moe", "dp2-sp1-ep2-tp2"),
    ("tiny-moe", "dp1-sp1-ep8-tp1"),
}


def test_dense_model_refuses_ep():
    with pytest.raises(IllegalStrategyError, match="ep-needs-moe"):
        engine("tiny-dense", ParallelConfig(dp=2, ep=2, tp=2))


@pytest.mark.parametrize(
    ("name", "parallel"),
    sweep(CASES, lambda case: (case[0], _id(case[1])) in FAST),
    ids=lambda x: x if isinstance(x, str) else _id(x),
)
def test_matches_single_device(name, parallel):
    ref_logits, ref_tokens = reference(name)
    eng = engine(name, parallel)
    tokens, lengths = eng.pad_prompts(PROMPTS)
    logits = np.asarray(eng.prefill(tokens, lengths)[0])
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)
    assert eng.generate(PROMPTS, 16).tokens == ref_tokens


# tiny-gqa (2 kv heads) at tp=4 and tp=8, one head per device: tests/test_kv_head_groups.py.
