"""``jaxpar serve --pp 2 --tp 4`` across 2 processes x 4 simulated CPU devices: one
pipeline stage per process, tensor parallelism inside it.

Process 0 schedules and serves HTTP; process 1 replays its commands (the lockstep
executor) and holds the second stage's layers and pages. 16 concurrent requests (greedy
and seeded, streamed and not, over a pool small enough to preempt) must each equal
offline ``generate`` on one device; then SIGTERM to process 0 drains an in-flight request
and stops both processes (exit 0). The 503 paths of a lost process are the lockstep
executor's, whatever the strategy (``tests/test_serve_multihost.py``).
"""

from __future__ import annotations

import httpx
import pytest

from tests._serve_util import MODEL, Offline, process_pair, sigterm_in_flight
from tests.test_serve_pipeline import COMMON, _metric, check_answers

pytestmark = [pytest.mark.server, pytest.mark.slow]

#: One prompt per prefill: the fewest programs for both processes to warm up.
FLAGS = [*COMMON, "--pp", "2", "--tp", "4", "--kv-cache-tokens", "40", "--prefill-batch", "1"]
EXIT_LIMIT_S = 60


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    procs = process_pair(FLAGS, tmp_path_factory.mktemp("pp-multihost"), log_level="info")
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)


@pytest.fixture(scope="module")
def offline():
    return Offline().warm()


def test_one_stage_per_process_answers_equal_one_device(pair, offline):
    leader = pair[0].wait_ready()
    check_answers(leader.url, offline)
    metrics = httpx.get(f"{leader.url}/metrics", timeout=10).text
    assert 0 < _metric(metrics, "pipeline_bubble_fraction") < 1
    assert leader.health()["lockstep"]["processes"] == 2


def test_sigterm_to_process_0_drains_and_stops_both(pair):
    leader = pair[0].wait_ready()
    body = {"model": MODEL, "prompt": [1, 20, 30], "max_tokens": 20, "ignore_eos": True}

    response = sigterm_in_flight(leader.url, leader.proc, body)
    assert response.status_code == 200, response.text  # drained: it finished
    for proc in pair:
        assert proc.proc.wait(EXIT_LIMIT_S) == 0, proc.log()
    assert "process 0 stopped serving" in pair[1].log()
