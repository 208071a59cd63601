"""`redwood bench throughput` on tiny random models: a request stream through the Engine, AR vs. speculation."""

from __future__ import annotations

import json
import math

import pytest

from redwood.bench.throughput import (
    RequestRecord,
    _tail_line,
    compare,
    latency_samples,
    output_lengths,
    parse_rates,
    poisson_arrivals,
    shared_prefix_prompts,
)
from redwood.cli import main
from tests.conftest import CORPUS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "long.txt"
    path.write_text("\n".join(CORPUS))
    return path


def _base(model_dir, text_file, *more):
    return [
        "bench",
        "throughput",
        "--model",
        str(model_dir),
        "--prompts-file",
        str(text_file),
        "--num-requests",
        "6",
        "--prompt-len",
        "24",
        "--min-new-tokens",
        "3",
        "--max-new-tokens",
        "9",
        "--max-num-seqs",
        "4",
        "--block-size",
        "8",
        *more,
    ]


def test_cli_self_speculation_two_rates(tiny_model_dir, text_file, tmp_path, capsys):
    out_dir = tmp_path / "rep"
    rc = main(
        _base(
            tiny_model_dir,
            text_file,
            "--self-speculate",
            "--draft-budget",
            "12",
            "--sinks",
            "2",
            "--gamma",
            "3",
            "--request-rate",
            "inf",
            "40",
            "--output",
            str(out_dir),
        )
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = captured.out
    assert table.startswith("throughput: ") and "spec tok/s" in table and "ITL p50/p99" in table
    assert "spec: self (streaming(sinks=2, window=10))" in table
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["inf"], ["40"])]
    assert [r[0] for r in rows] == ["40", "inf"] and all(r[-1] == "yes" for r in rows)
    assert "decode steps @ inf req/s, spec: " in table and "ms a step: forward " in table

    rep = json.loads((out_dir / "report.json").read_text())
    assert rep["schema"].startswith("redwood.bench/") and rep["kind"] == "throughput"
    assert [(r["method"], r["request_rate"]) for r in rep["runs"]] == [
        ("ar", 40.0),
        ("spec", 40.0),
        ("ar", "inf"),
        ("spec", "inf"),
    ]
    lengths = output_lengths(6, 3, 9, 0)
    for r in rep["runs"]:
        assert r["tokens_per_s"] > 0 and r["request_throughput"] > 0 and r["steps"] > 0
        for key in ("ttft", "itl", "chunk_itl", "tpot", "e2e"):
            assert 0 <= r[f"{key}_ms_p50"] <= r[f"{key}_ms_p99"], key
        assert r["all_completed"] is True and r["kv_blocks_used_at_end"] == 0
        assert 0 < r["kv_blocks_max"] <= r["kv_blocks_total"] and r["kv_blocks_mean"] <= r["kv_blocks_max"]
        assert [p["output_tokens"] for p in r["per_request"]] == lengths
        assert all(p["finish_reason"] == "length" for p in r["per_request"])
        phases = r["decode_step_phases"]  # (where the steps that only decode spent their time)
        assert phases["steps"] > 0 and phases["ms"]["forward"] > 0 and phases["host_ms"] >= 0
        if r["method"] == "spec":
            assert r["identical_to_ar"] is True and r["requests_identical_to_ar"] == 6
            assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["mean_accepted_length"] <= 4
            # each row's own steps and tokens a step: together they make the run's
            rows = r["per_request"]
            assert all(p["spec_steps"] >= 1 and 1 <= p["tokens_per_step"] <= 4 for p in rows)
            assert sum(p["spec_steps"] for p in rows) == r["spec_steps"]
            assert sum(p["tokens_per_step"] * p["spec_steps"] for p in rows) == pytest.approx(
                r["mean_accepted_length"] * r["spec_steps"], rel=1e-3
            )
        else:
            assert "identical_to_ar" not in r and "acceptance_rate" not in r
            assert all("tokens_per_step" not in p and "spec_steps" not in p for p in r["per_request"])
    assert [c["request_rate"] for c in rep["comparison"]] == [40.0, "inf"]
    for c in rep["comparison"]:
        assert c["tokens_per_s_ratio"] > 0 and c["ttft_ms_p99_ratio"] > 0 and c["identical_to_ar"] is True
    assert rep["aggregate"]["greedy_identical_to_ar"] is True
    assert rep["config"]["num_requests"] == 6 and rep["config"]["draft_kv"] == "streaming"
    assert rep["config"]["cli"]["request_rate"] == ["inf", "40"]
    # arrivals at 40 req/s are spread out; at inf they all come at t = 0
    finite = [p["arrival_s"] for p in rep["runs"][0]["per_request"]]
    assert finite == pytest.approx(poisson_arrivals(6, 40.0, 0)) and finite[-1] > 0
    assert all(p["arrival_s"] == 0 for p in rep["runs"][2]["per_request"])
    assert "throughput.png" in rep["plots"]
    assert (out_dir / "throughput.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_draft_model_json_single_rate(tiny_model_dir, tiny_draft_dir, text_file, tmp_path, capsys):
    rc = main(
        _base(
            tiny_model_dir,
            text_file,
            "--draft-model",
            str(tiny_draft_dir),
            "--gamma",
            "2",
            "--json",
            "--output",
            str(tmp_path / "rep"),
        )
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(captured.out)
    assert res["request_rates"] == ["inf"] and [r["method"] for r in res["runs"]] == ["ar", "spec"]
    assert res["all_identical"] is True and res["gamma"] == 2
    assert (tmp_path / "rep" / "throughput.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_auto_policy(tiny_model_dir, tiny_draft_dir, text_file, tmp_path, capsys, monkeypatch):
    """`bench throughput --speculative auto`: the speculative engine plans each step (its plans in the run),
    greedy output identical to AR's."""
    monkeypatch.setenv("REDWOOD_HOME", str(tmp_path))  # (the calibration's cache)
    rc = main(_base(tiny_model_dir, text_file, "--speculative", "auto", "--draft-model", str(tiny_draft_dir), "--json"))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(captured.out)
    assert res["all_identical"] is True and res["draft"].startswith("auto")
    spec = [r for r in res["runs"] if r["method"] == "spec"][0]
    assert sum(spec["policy"]["plans"].values()) > 0


def test_cli_repeats_interleaved_medians(tiny_model_dir, text_file, capsys, monkeypatch):
    """--repeats 3: AR and speculation alternate (each run's speedup over the AR run just before it), each
    (mode, rate) reports its median run and every repeat's tokens/s."""
    from redwood.bench import throughput as tput

    order = []
    real = tput.run_stream

    def spy(engine, workload, arrivals, prefix="", progress=None):
        order.append(prefix.rstrip("-0123456789"))  # the mode: requests are named "{mode}{rate index}-{i}"
        return real(engine, workload, arrivals, prefix=prefix, progress=progress)

    monkeypatch.setattr(tput, "run_stream", spy)
    rc = main(_base(tiny_model_dir, text_file, "--self-speculate", "--gamma", "2", "--repeats", "3", "--json"))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(captured.out)
    assert order == ["ar", "spec"] * 3
    ar, spec = res["runs"]
    for run in (ar, spec):
        each = run["tokens_per_s_repeats"]
        assert len(each) == 3 and run["tokens_per_s"] == sorted(each)[1]
    assert len(spec["speedup_repeats"]) == 3 and spec["identical_to_ar"] is True
    assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / ar["tokens_per_s"])
    assert res["all_identical"] is True


def test_cli_auto_beside_a_fixed_plan_in_one_process(
    tiny_model_dir, tiny_draft_dir, text_file, tmp_path, capsys, monkeypatch
):
    """--compare-fixed 2: AR, the draft model's fixed chain of 2 and the automatic policy, interleaved per repeat
    in one process (one AR run for both ratios); each reports its median, the fixed plan its own ratios to AR
    (`comparison_fixed`) and its plan, the table a line for it; greedy output identical to AR's in both."""
    from redwood.bench import throughput as tput

    monkeypatch.setenv("REDWOOD_HOME", str(tmp_path))
    order = []
    real = tput.run_stream

    def spy(engine, workload, arrivals, prefix="", progress=None):
        order.append((prefix.rstrip("-0123456789"), engine.policy.auto, getattr(engine.tree, "size", None)))
        return real(engine, workload, arrivals, prefix=prefix, progress=progress)

    monkeypatch.setattr(tput, "run_stream", spy)
    args = ["--speculative", "auto", "--draft-model", str(tiny_draft_dir), "--compare-fixed", "2", "--repeats", "2"]
    rc = main(_base(tiny_model_dir, text_file, *args, "--output", str(tmp_path / "cmp")))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert [(m, auto) for m, auto, _ in order] == [("ar", False), ("fixed", False), ("spec", True)] * 2
    assert order[1][2] == 3  # (the fixed engine's tree: a chain of 2 drafts)
    assert "fixed plan @ inf req/s" in captured.out and "spec / fixed" in captured.out
    res = json.loads((tmp_path / "cmp" / "report.json").read_text())
    ar, fixed, spec = res["runs"]
    assert [ar["method"], fixed["method"], spec["method"]] == ["ar", "fixed", "spec"]
    assert fixed["plan"].endswith("chain:2") and "policy" not in fixed and sum(spec["policy"]["plans"].values()) > 0
    assert len(fixed["speedup_repeats"]) == 2 and fixed["speedup"] == pytest.approx(
        fixed["tokens_per_s"] / ar["tokens_per_s"]
    )
    assert res["comparison_fixed"][0]["tokens_per_s_ratio"] == pytest.approx(fixed["tokens_per_s"] / ar["tokens_per_s"])
    assert fixed["identical_to_ar"] is True and spec["identical_to_ar"] is True
    assert res["aggregate"]["greedy_identical_to_ar"] is True and res["config"]["compare_fixed"] == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--draft-model", "D", "--gamma", "2"], "beside the automatic policy"),
        (["--speculative", "auto", "--draft", "ngram"], "beside the automatic policy"),
        (["--speculative", "auto", "--self-speculate", "--compare-fixed", "0"], "at least 1"),
    ],
)
def test_cli_compare_fixed_needs_the_automatic_policy_and_a_model_drafter(
    tiny_model_dir, text_file, capsys, extra, message
):
    extra = [a if a != "D" else str(tiny_model_dir) for a in extra]
    if "--compare-fixed" not in extra:
        extra += ["--compare-fixed", "2"]
    rc = main(_base(tiny_model_dir, text_file, *extra))
    captured = capsys.readouterr()
    assert rc != 0 and message in captured.err and "Traceback" not in captured.err


def test_cli_no_spec(tiny_model_dir, text_file, capsys):
    rc = main(_base(tiny_model_dir, text_file, "--no-spec", "--request-rate", "100", "--json"))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(captured.out)
    assert [r["method"] for r in res["runs"]] == ["ar"] and res["comparison"] == [] and res["all_identical"] is None


def test_shared_prefix_prompts():
    def windows(n, length, seed):  # distinct, recognisable windows per (seed, i)
        return [[seed * 1000 + i * 100 + j for j in range(length)] for i in range(n)]

    assert shared_prefix_prompts(windows, 3, 5, 0, seed=4) == windows(3, 5, 4)
    prompts = shared_prefix_prompts(windows, 3, 5, 2, seed=4)
    assert all(len(p) == 5 for p in prompts)
    assert all(p[:2] == windows(1, 2, 5)[0] for p in prompts)  # one common window, not one of the tails
    assert [p[2:] for p in prompts] == windows(3, 3, 4)


def test_cli_shared_prefix_with_prefix_caching(tiny_model_dir, text_file, capsys):
    rc = main(
        _base(
            tiny_model_dir,
            text_file,
            "--self-speculate",
            "--gamma",
            "2",
            "--shared-prefix-len",
            "16",
            "--enable-prefix-caching",
            "--request-rate",
            "50",
            "--json",
        )
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    res = json.loads(captured.out)
    assert res["settings"]["shared_prefix_len"] == 16 and res["all_identical"] is True


def test_poisson_arrivals_seeded_with_the_right_mean_gap():
    a = poisson_arrivals(20_000, 4.0, seed=7)
    assert a == poisson_arrivals(20_000, 4.0, seed=7) and a != poisson_arrivals(20_000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd == pytest.approx(mean, rel=0.05)
    assert poisson_arrivals(5, math.inf) == [0.0] * 5


def test_output_lengths_and_rates():
    n = output_lengths(1000, 3, 9, seed=1)
    assert n == output_lengths(1000, 3, 9, seed=1) and set(n) == set(range(3, 10))
    assert output_lengths(4, 5, 5) == [5, 5, 5, 5]
    assert parse_rates(["inf", "2", "2.0", "0.5"]) == [0.5, 2.0, math.inf]


def test_latency_samples_per_token_and_per_chunk():
    r = RequestRecord(
        arrival=1.0,
        requested=6,
        first=1.5,
        finish=2.1,
        times=[1.5, 1.7, 2.1],
        counts=[1, 2, 3],
        token_ids=[0] * 6,
        finish_reason="length",
    )
    s = latency_samples([r])
    assert s["ttft"] == pytest.approx([0.5]) and s["e2e"] == pytest.approx([1.1])
    assert s["chunk_itl"] == pytest.approx([0.2, 0.4])
    assert s["itl"] == pytest.approx([0.1, 0.1, 0.4 / 3, 0.4 / 3, 0.4 / 3])
    assert s["tpot"] == pytest.approx([0.6 / 5])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-requests", "0"], "--num-requests must be >= 1"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--request-rate", "-2"], "--request-rate must be > 0"),
        (["--request-rate", "fast"], "--request-rate must be a positive number"),
        (["--min-new-tokens", "10", "--max-new-tokens", "5"], "--min-new-tokens (10) is more than --max-new-tokens"),
        (["--min-new-tokens", "0"], "--min-new-tokens must be >= 1"),
        (["--prompt-len", "0"], "--prompt-len must be >= 1"),
        (["--self-speculate", "--shared-prefix-len", "24"], "--shared-prefix-len must be in [0, --prompt-len 24)"),
        (["--max-model-len", "20"], "is more than --max-model-len 20"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory must be > 0"),
        (["--self-speculate", "--repeats", "0"], "--repeats must be at least 1"),
        ([], "give --draft-model D, --self-speculate, --draft ngram or --speculative auto"),
        (["--no-spec", "--self-speculate"], "--no-spec measures autoregressive decoding only"),
        (["--no-spec", "--gamma", "3"], "only applies when speculating"),
        (["--self-speculate", "--gamma", "0"], "--gamma must be >= 1"),
        (["--self-speculate", "--max-new-tokens", "5000"], "more than the model's context"),
    ],
)
def test_bad_input_one_line_status_2(tiny_model_dir, text_file, extra, message, capsys):
    argv = [
        "bench",
        "throughput",
        "--model",
        str(tiny_model_dir),
        "--prompts-file",
        str(text_file),
        "--prompt-len",
        "24",
        "--min-new-tokens",
        "2",
        "--max-new-tokens",
        "4",
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_tail_line_names_the_rows_the_run_waited_for():
    """The last tenth of the requests to finish, their tokens a step against the others', and how long the
    run went on after the others — None under 10 rows (no tenth to speak of) or without per-row stats."""
    rows = [
        {"arrival_s": 0.0, "e2e_ms": 1e3 * (30 + i / 10), "tokens_per_step": 3.5, "spec_steps": 100} for i in range(18)
    ]
    rows += [{"arrival_s": 1.0, "e2e_ms": 1e3 * t, "tokens_per_step": 1.5, "spec_steps": 300} for t in (45.0, 49.0)]
    line = _tail_line({"request_rate": "inf", "per_request": rows})
    assert line.startswith("tail @ inf req/s: the last 2 of 20 requests to finish made 1.50 tokens a step")
    assert "(the others 3.50)" in line and "went on 18.3 s after the others had finished" in line
    assert _tail_line({"request_rate": "inf", "per_request": rows[:9]}) is None
    plain = [{k: v for k, v in p.items() if k not in ("tokens_per_step", "spec_steps")} for p in rows]
    assert _tail_line({"request_rate": "inf", "per_request": plain}) is None


def test_the_ratio_with_captures_counted_is_reported_beside_the_clocks():
    """The bench's clocks leave one-time graph captures out; the comparison also gives the ratio had they been
    counted (session 35's H100 burst: 1.95× on the clocks, 1.62× counting 7.5 s of captures)."""
    ar = {"request_rate": "inf", "duration_s": 70.0, "output_tokens": 1000, "capture_s": 0.0, "tokens_per_s": 1000 / 70}
    spec = {
        "request_rate": "inf",
        "duration_s": 35.0,
        "output_tokens": 1000,
        "capture_s": 7.0,
        "tokens_per_s": 1000 / 35,
    }
    c = compare(ar, spec)
    assert c["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert c["tokens_per_s_ratio_with_captures"] == pytest.approx(70.0 / 42.0)
