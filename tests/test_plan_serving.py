"""``jaxpar plan`` for a server: the prefill batch, latency bounds, the ``jaxpar serve``
command line it prints (parsed by serve's own parser), the largest batch that fits, one
unit per table column, the picture's title. Analytic: nothing compiles (Llama-3-8B's
published config on 2 H100s: a chat workload of 512-token prompts and 256 new tokens)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from jaxpar.cli import _parser, main
from jaxpar.errors import InfeasiblePlanError
from jaxpar.models import config_from_hf
from jaxpar.plan import (
    Bounds,
    Workload,
    largest_batch,
    load_hardware,
    max_prefill_tokens,
    memory,
    plan,
    predict,
    prefill_batches,
    serve_flags,
)
from jaxpar.spec import ParallelConfig, batch_multiple, validate

LLAMA = Path(__file__).parent / "fixtures" / "configs" / "llama-3-8b"
CHAT = Workload(batch=32, prompt_len=512, gen_len=256)
ARGS = ["--hf", str(LLAMA), "--devices", "2", "--hardware", "h100"]
CHAT_ARGS = ["--batch", "32", "--prompt-len", "512", "--gen-len", "256"]


@pytest.fixture(scope="module")
def model():
    return config_from_hf(json.loads((LLAMA / "config.json").read_text()), source=str(LLAMA))


@pytest.fixture(scope="module")
def hw():
    return load_hardware("h100").with_hosts(2, None)


@pytest.fixture(scope="module")
def throughput(model, hw):
    return plan(model, hw, 2, CHAT, objective="throughput")


def test_throughput_prefills_a_few_prompts_not_the_whole_batch(model, hw, throughput):
    """The batch grows to what the server's slots hold, but prompts are prefilled a few at
    a time: TTFT is one such prefill step plus the decode step it waits for, not the
    prefill of every slot's prompt at once."""
    best = throughput.best
    w = best.workload
    assert w.serving and w.batch > CHAT.batch  # grown, as a server fills its slots
    assert w.prefill_rows <= 4 * batch_multiple(model, best.config) < w.batch
    alone = predict(
        model, best.config, Workload(batch=w.prefill_rows, prompt_len=512, gen_len=256), hw
    )
    assert best.prefill.seconds == pytest.approx(alone.prefill.seconds)
    if not best.disaggregated:
        assert best.ttft_s == pytest.approx(best.decode.seconds + alone.prefill.seconds)
        interleaved = w.batch / w.gen_len * alone.prefill.seconds / w.prefill_rows
        assert best.tpot_s == pytest.approx(best.decode.seconds + interleaved)
        assert best.tokens_per_s == pytest.approx(w.batch / best.tpot_s)
    whole = predict(model, best.config, Workload(batch=w.batch, prompt_len=512, gen_len=256), hw)
    assert best.ttft_s < whole.prefill.seconds / 4  # the old plan's wait for a whole-batch prefill
    # A served pipeline keeps every stage busy: pp decode groups, pp prefill microbatches.
    assert all(
        p.config.decode_groups == p.config.microbatches == p.config.pp
        for p in throughput.ranked
        if p.config.pp > 1
    )
    assert any(r.rule == "serve-pipeline-groups" for r in throughput.refused)


def test_latency_bounds_exclude_plans_and_bind(model, hw, throughput):
    """A TPOT bound below the unbounded best's excludes it: every plan then meets the bound,
    at a smaller batch; a TTFT bound below the default prefill batch's picks a smaller one."""
    best = throughput.best
    tpot = best.tpot_s * 0.6
    bounded = plan(model, hw, 2, CHAT, objective="throughput", bounds=Bounds(max_tpot_s=tpot))
    assert bounded.ranked and all(p.tpot_s <= tpot for p in bounded.ranked)
    assert bounded.best.workload.batch < best.workload.batch
    assert bounded.best.tokens_per_s < best.tokens_per_s
    # TTFT: between what the smallest and the default prefill batch give for the best plan.
    config = best.config
    sizes = list(prefill_batches(model, config, CHAT.batch))
    assert len(sizes) > 1
    ttfts = [
        predict(
            model, config, Workload(batch=32, prompt_len=512, gen_len=256, prefill_batch=b), hw
        ).ttft_s
        for b in sizes
    ]
    limit = (ttfts[0] + ttfts[-1]) / 2
    latency = plan(model, hw, 2, CHAT, bounds=Bounds(max_ttft_s=limit))
    assert latency.best.workload.serving and latency.best.workload.batch == CHAT.batch
    assert all(p.ttft_s <= limit for p in latency.ranked)
    same = [p for p in latency.ranked if p.label == str(config)]
    assert same and same[0].workload.prefill_rows < sizes[0]


@pytest.mark.sweep  # a variant of the bounds: the fast tier keeps them binding
def test_unreachable_bounds_name_the_best_figures(model, hw, capsys):
    """No plan meets 1 ms per token: the error names the lowest TTFT and TPOT predicted,
    which are those of the strategies at the asked batch with their smallest prefill batch."""
    with pytest.raises(InfeasiblePlanError) as err:
        plan(model, hw, 2, CHAT, bounds=Bounds(max_tpot_s=1e-3, max_ttft_s=5e-3))
    message = str(err.value)
    assert "meets TTFT <= 5 ms and TPOT <= 1 ms" in message
    lowest = re.search(r"lowest TTFT .*?TTFT ([\d.]+) ms", message)
    assert lowest, message
    candidates = []
    for config in (ParallelConfig(dp=2), ParallelConfig(sp=2), ParallelConfig(tp=2)):
        w = Workload(
            batch=32, prompt_len=512, gen_len=256, prefill_batch=batch_multiple(model, config)
        )
        candidates.append(predict(model, config, w, hw).ttft_s * 1e3)
    assert float(lowest.group(1)) <= min(candidates) * 1.0001
    code = main(["plan", *ARGS, *CHAT_ARGS, "--max-tpot-ms", "1"])
    out = capsys.readouterr().out.replace("\n", " ")
    assert (
        code == 2
        and "meets TPOT <= 1 ms" in out
        and re.search(r"lowest TTFT.* TPOT [\d.]+ ms", out)
    )


def _serve_args(command: str):
    argv = shlex.split(command)
    assert argv[:2] == ["jaxpar", "serve"]
    return _parser().parse_args(argv[1:])


def test_printed_serve_command_parses_and_matches_the_plan(model, capsys):
    data = json.loads(
        (
            main(["plan", *ARGS, *CHAT_ARGS, "--objective", "throughput", "--json"]),
            capsys.readouterr().out,
        )[1]
    )
    best = data["plans"][0]
    args = _serve_args(data["command"])
    assert args.command == "serve" and Path(args.hf) == LLAMA
    assert args.max_num_seqs == best["batch"] and args.max_seq_len == 512 + 256
    assert args.kv_cache_tokens == best["batch"] * (512 + 256)
    assert args.prefill_batch == best["prefill_batch"]
    degrees = {a: getattr(args, a) or 1 for a in ("dp", "pp", "sp", "ep", "tp")}
    assert degrees == best["degrees"]
    decode = ParallelConfig(**degrees)
    validate(
        model, decode, n_devices=decode.size, batch=args.max_num_seqs, max_seq_len=args.max_seq_len
    )
    assert args.max_prefill_tokens == best["prefill_batch"] * 512  # 512: a whole bucket
    prefill = ParallelConfig.parse(best["prefill_strategy"])
    assert args.prefill_batch % prefill.dp == 0
    if best["disaggregated"]:
        assert args.prefill == best["prefill_strategy"]
    else:
        assert args.prefill is None


def test_disaggregated_serve_command_names_the_prefill_strategy(throughput):
    split = [p for p in throughput.ranked if p.disaggregated]
    assert split
    pred = split[0]
    args = _serve_args(serve_flags(pred, f"--hf {LLAMA} --quantize fp8"))
    assert args.prefill == str(pred.prefill_config) and args.quantize == "fp8"
    assert args.max_prefill_tokens == max_prefill_tokens(pred)  # no chunks there either
    assert args.prefill_batch == pred.workload.prefill_rows
    assert pred.ttft_s == pytest.approx(pred.prefill.seconds + pred.transfer_s)
    assert pred.tpot_s == pred.decode.seconds


# The fast tier checks the planned budget through the printed serve commands above.
@pytest.mark.sweep
@pytest.mark.parametrize("prompt_len", [20, 512])
def test_max_prefill_tokens_holds_one_padded_prefill_step_unchunked(model, hw, prompt_len):
    """The batcher prefills ``prefill_batch`` prompts padded to the engine's bucket while
    their padded tokens fit ``--max-prefill-tokens``, and chunks a prompt longer than
    ``max_prefill_tokens // dp`` in whole pages: the planned budget does neither."""
    from jaxpar.engine import prompt_bucket

    w = Workload(batch=32, prompt_len=prompt_len, gen_len=64)
    for pred in plan(model, hw, 2, w, objective="throughput").ranked:
        tokens = max_prefill_tokens(pred)
        prefill = pred.prefill_config or pred.config
        padded = prompt_bucket(prompt_len, prefill.sp, w.max_seq_len)
        assert tokens % 16 == 0 and tokens >= pred.workload.prefill_rows * padded
        chunk = max(tokens // prefill.dp // 16, 1) * 16  # ContinuousBatcher.chunk_tokens
        assert chunk >= prompt_len


@pytest.mark.sweep  # the fast tier's infeasible plans: tests/test_plan.py, test_plan_cli.py
def test_infeasible_batch_names_the_largest_batch_that_fits(model, hw, capsys):
    """4096 chat sequences do not fit on one H100; the message names the largest batch that
    does, and that batch fits while the next legal one does not."""
    big = Workload(batch=4096, prompt_len=512, gen_len=256)
    with pytest.raises(InfeasiblePlanError) as err:
        plan(model, hw, 1, big)
    found = re.search(r"the largest batch that fits is (\d+) \((.+?)\)", str(err.value))
    assert found, str(err.value)
    batch = int(found.group(1))
    found = largest_batch(model, 1, big, hw.hbm_bytes, platform=hw.platform)
    assert (batch, ParallelConfig()) == found

    def total(b):  # prefill attention on an H100: cuDNN's fused kernel, no score matrix
        return memory(
            model, ParallelConfig(), batch=b, prompt_len=512, max_seq_len=768, platform="cuda"
        ).total

    assert total(batch) <= hw.hbm_bytes < total(batch + 1)
    code = main(
        ["plan", "--hf", str(LLAMA), "--devices", "1", "--hardware", "h100"]
        + ["--batch", "4096", "--prompt-len", "512", "--gen-len", "256"]
    )
    assert code == 2 and f"largest batch that fits is {batch}" in capsys.readouterr().out.replace(
        "\n", " "
    )


def _columns(out: str, title: str) -> dict[str, list[str]]:
    """The cells of the rich table after ``title``, by header (header lines joined)."""
    lines = out[out.index(title) :].splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    head = [line.strip("┃").split("┃") for line in lines[:end] if line.startswith("┃")]
    rows = [line.strip("│").split("│") for line in lines[:end] if line.startswith("│")]
    names = [" ".join(" ".join(parts).split()) for parts in zip(*head, strict=True)]
    return {n: [r[i].strip() for r in rows if r[i].strip()] for i, n in enumerate(names)}


@pytest.mark.sweep  # the fast tier's tables and picture: tests/test_plan_cli.py
def test_tables_keep_one_unit_per_column_and_no_scientific_notation(capsys):
    assert main(["plan", *ARGS, *CHAT_ARGS, "--objective", "throughput", "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"\d[eE][+-]\d", out)
    plans = _columns(out, "plans (throughput, serving)")
    for name in ("TTFT (ms)", "TPOT (ms)", "tok/s", "comm/req (GB)", "batch", "prefill batch"):
        assert name in plans, list(plans)
        assert all(re.fullmatch(r"[\d.]+", v) for v in plans[name]), (name, plans[name])
    assert any(n.startswith("prefill (") and n.endswith("cmp/hbm/comm") for n in plans)
    comm = _columns(out, "collectives per step")
    unit = [n for n in comm if n.startswith("time (")]
    assert unit and all(re.fullmatch(r"[\d.]+", v) for v in comm[unit[0]])


@pytest.mark.sweep  # the fast tier's tables and picture: tests/test_plan_cli.py
def test_picture_title_shows_the_chosen_batch(tmp_path, capsys):
    picture = tmp_path / "plan.svg"
    assert (
        main(
            [
                "plan",
                *ARGS,
                *CHAT_ARGS,
                "--objective",
                "throughput",
                "--picture",
                str(picture),
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    best = data["plans"][0]
    assert best["batch"] != 32
    text = picture.read_text()
    assert f"batch {best['batch']} (asked 32), prefill batch {best['prefill_batch']}" in text


LLAMA_70B = Path(__file__).parent / "fixtures" / "configs" / "llama-3-70b"
#: Decode-heavy chat: short prompts, long answers.
LONG_ANSWERS = Workload(batch=32, prompt_len=128, gen_len=1024)


@pytest.mark.parametrize(
    "inter_host_gbps, pipelined",
    [(25.0, True), (450.0, False)],
    ids=["slow-inter-host-link", "fast-inter-host-link"],
)
def test_throughput_pipelines_across_hosts_only_over_a_slow_inter_host_link(
    tmp_path, inter_host_gbps, pipelined
):
    """Llama-3-70B on 2 hosts of 2 H100s (it does not fit twice: no dp across hosts).
    The hardware file states the inter-host bandwidth (its slow link): at 25 GB/s per GPU
    (a 200 Gb/s NIC) the best plan is pp across the hosts with tp inside each (the stages
    pass each other activations once per step where tp=4 would all-reduce across hosts twice
    a layer); at NVLink's 450 GB/s (hosts of one NVLink domain) the best is not
    pipelined."""
    text = (Path(__file__).parents[1] / "jaxpar/plan/hardware/h100.toml").read_text()
    link = f'slow_link = {{ name = "inter-host", gbps = {inter_host_gbps}, latency_us = 5.0 }}'
    hardware = tmp_path / "two-hosts.toml"
    hardware.write_text(re.sub(r"^slow_link = .*$", link, text, count=1, flags=re.MULTILINE))
    model = config_from_hf(json.loads((LLAMA_70B / "config.json").read_text()), source="70b")
    hw = load_hardware(str(hardware)).with_hosts(4, 2)
    assert hw.slow_link.gbps == inter_host_gbps
    best = plan(model, hw, 4, LONG_ANSWERS, objective="throughput").best
    config = best.config
    if pipelined:
        assert (config.pp, config.tp) == (2, 2), best.label
        assert hw.link(("pp",), config).name == "inter-host"  # the stages span the hosts
        assert hw.link(("tp",), config).name == "NVLink"  # tp stays inside each
        assert config.decode_groups == config.pp  # every stage busy each step
        assert "--pp 2 --tp 2" in serve_flags(best, "--hf DIR")
    else:
        assert config.pp == 1, best.label
