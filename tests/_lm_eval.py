"""lm-eval-harness's OpenAI completions client (``local-completions``) against a server.

Its task datasets are downloaded from the hub, which tests cannot reach, so the task here
is local: a ``loglikelihood`` task (lambada's form: a context and the continuation to
score) over a JSON-lines file of sentences the ``llama_chat`` fixture's tokenizer knows.
lm-eval runs as its own process, as a user runs it (``python -m lm_eval run``), offline
(``HF_*_OFFLINE``), tokenizing with the checkpoint's tokenizer through transformers (the
``lmeval`` extra). ``--log_samples`` writes each request's (log-likelihood, is-greedy).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TASK = "jaxpar_tiny_lambada"
#: (context, continuation): the continuation starts with a space, lambada's convention.
DOCS = [
    ("hello world ! how are you ?", " i am fine , thanks ."),
    ("what is your name ?", " the name is what the name is ."),
    ("how are you ? i am", " fine , thanks !"),
    ("you are fine , thanks", " ! hello world"),
    ("the name is", " what"),
    ("hello", " world"),
]
LIMIT = 5  # documents lm-eval evaluates (the first five)


def require_lm_eval() -> None:
    """Skips without lm-eval, unless under CI, where scripts/test.sh installs it."""
    if importlib.util.find_spec("lm_eval") is None:
        message = 'lm-eval is not installed: pip install -e ".[lmeval]" (scripts/test.sh does)'
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def write_task(directory: Path) -> Path:
    """The task's YAML and its data file in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "docs.jsonl"
    lines = [json.dumps({"context": c, "continuation": x}) for c, x in DOCS]
    data.write_text("\n".join(lines) + "\n")
    (directory / f"{TASK}.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )
    return directory


def run(base_url: str, model: str, tokenizer: Path, work: Path) -> list[dict]:
    """Runs the task against ``base_url`` (a server's ``/v1/completions``); the logged
    samples, in document order."""
    tasks = write_task(work / "tasks")
    out = work / "out"
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={base_url}",
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            "max_retries=1",
            "max_length=64",
        ]
    )
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions"]
    command += ["--model_args", model_args, "--tasks", TASK, "--include_path", str(tasks)]
    command += ["--limit", str(LIMIT), "--log_samples", "--output_path", str(out)]
    home = work / "hf"
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OPENAI_API_KEY": "unused",
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    files = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    assert files, f"no samples written under {out}:\n{done.stderr[-3000:]}"
    samples = [json.loads(line) for line in files[-1].read_text().splitlines() if line]
    return sorted(samples, key=lambda s: s["doc_id"])
