"""`redwood bench baseline|standalone|selfspec` on tiny random models, prompts cut from a small text file."""

from __future__ import annotations

import json

import pytest

from redwood.cli import main
from tests.conftest import CORPUS


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "long.txt"
    path.write_text("\n".join(CORPUS))  # ~5,000 tokens with the tiny tokenizer
    return path


def _bench(argv, capsys):
    rc = main(["bench"] + argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out


def test_selfspec_sweep_json_and_report(tiny_model_dir, text_file, tmp_path, capsys):
    out = _bench(
        [
            "selfspec",
            "--model",
            str(tiny_model_dir),
            "--prompts-file",
            str(text_file),
            "--batch-size",
            "1",
            "2",
            "--prefix-len",
            "24",
            "--gen-len",
            "6",
            "--gamma",
            "2",
            "3",
            "--draft-kv",
            "streaming",
            "--draft-budget",
            "12",
            "--sinks",
            "2",
            "--json",
            "--output",
            str(tmp_path / "rep"),
        ],
        capsys,
    )
    res = json.loads(out)
    assert res["kind"] == "selfspec" and res["draft"].startswith("self (streaming(sinks=2, window=10))")
    assert [(r["batch_size"], r["prefix_len"], r["gamma"]) for r in res["runs"]] == [
        (1, 24, 2),
        (1, 24, 3),
        (2, 24, 2),
        (2, 24, 3),
    ]
    for r in res["runs"]:
        assert r["identical_to_ar"] is True
        assert r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["ar_tokens_per_s"] > 0
        assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["mean_accepted_length"] <= r["gamma"] + 1
        assert len(r["acceptance_by_position"]) == r["gamma"] and r["draft_s"] > 0 and r["verify_s"] > 0
        assert r["prefill_s"] > 0 and r["ar_prefill_s"] > 0 and r["end_to_end_tokens_per_s"] > 0
    assert res["all_identical"] is True
    assert [(b["batch_size"], b["prefix_len"]) for b in res["best"]] == [(1, 24), (2, 24)]
    assert all(b["gamma"] in (2, 3) for b in res["best"])

    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["schema"].startswith("redwood.bench/") and rep["kind"] == "selfspec"
    assert len(rep["runs"]) == 4 and all("speedup" in r and "gamma" in r for r in rep["runs"])
    assert rep["aggregate"]["greedy_identical_to_ar"] is True
    assert rep["config"]["draft_kv"] == "streaming" and rep["config"]["draft_budget"] == 12
    assert "speedup_vs_batch_size.png" in rep["plots"]
    assert (tmp_path / "rep" / "speedup_vs_batch_size.png").is_file()


def test_standalone_table_and_report(tiny_model_dir, tiny_draft_dir, text_file, tmp_path, capsys):
    out = _bench(
        [
            "standalone",
            "--model",
            str(tiny_model_dir),
            "--draft-model",
            str(tiny_draft_dir),
            "--prompts-file",
            str(text_file),
            "--prefix-len",
            "20",
            "40",
            "--gen-len",
            "6",
            "--gamma",
            "2",
            "--draft-kv",
            "snapkv",
            "--draft-budget",
            "16",
            "--window",
            "8",
            "--draft-weights",
            "int8",
            "--output",
            str(tmp_path / "rep"),
        ],
        capsys,
    )
    assert out.startswith("standalone: ") and "snapkv(budget=16, window=8" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["1"]]
    assert [(r[1], r[2]) for r in rows] == [("20", "chain:2"), ("40", "chain:2")]
    assert all(r[12] == "yes" for r in rows)  # same as autoregressive (the column after ms/step)
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["kind"] == "standalone" and rep["models"]["draft"].startswith(str(tiny_draft_dir))
    assert rep["config"]["draft_weights"] == "int8" and "int8 weights" in rep["models"]["draft"]
    assert [r["prefix_len"] for r in rep["runs"]] == [20, 40]
    assert all(r["identical_to_ar"] is True and r["speedup"] > 0 for r in rep["runs"])
    assert "speedup_vs_context_length.png" in rep["plots"]


def test_baseline_sweep(tiny_model_dir, text_file, tmp_path, capsys):
    out = _bench(
        [
            "baseline",
            "--model",
            str(tiny_model_dir),
            "--prompts-file",
            str(text_file),
            "--batch-size",
            "1",
            "3",
            "--prefix-len",
            "16",
            "--gen-len",
            "5",
            "--output",
            str(tmp_path / "rep"),
        ],
        capsys,
    )
    assert out.startswith("baseline: ") and "tok/s" in out
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["kind"] == "baseline"
    assert [(r["method"], r["batch_size"], r["prefix_len"]) for r in rep["runs"]] == [("ar", 1, 16), ("ar", 3, 16)]
    assert all(r["tokens_per_s"] > 0 and "speedup" not in r for r in rep["runs"])
    assert all(r["prefill_s"] > 0 for r in rep["runs"])


def test_run_bench_api_self_draft_accepts_everything(tiny_model_dir, text_file):
    """A standalone draft identical to the target: every draft token is accepted, γ + 1 tokens per step."""
    from redwood import LLM
    from redwood.bench.speculative import PromptSource, format_result, run_bench
    from redwood.speculation.config import SpeculativeConfig

    llm = LLM(str(tiny_model_dir), speculative=SpeculativeConfig(draft_model=str(tiny_model_dir), num_draft_tokens=3))
    res = run_bench(llm, "standalone", [2], [16], 9, PromptSource(prompts_file=str(text_file)), [3])
    (run,) = res["runs"]
    assert run["identical_to_ar"] is True and run["acceptance_rate"] == 1.0
    assert run["mean_accepted_length"] == 4.0 and run["acceptance_by_position"] == [1.0, 1.0, 1.0]
    assert run["steps"] == 2 * 2  # 8 decoded tokens per row in steps of 4
    assert "best draft shape" not in format_result(res)  # one γ: nothing to choose

    # sampling: outputs legitimately differ from the autoregressive run, so no identity verdict
    res = run_bench(
        llm, "standalone", [1], [16], 5, PromptSource(prompts_file=str(text_file)), [2], temperature=0.8, seed=3
    )
    assert res["runs"][0]["identical_to_ar"] is None and res["all_identical"] is None
    assert "n/a" in format_result(res)


def test_aggregate_spec_sums_rows():
    from redwood.bench.speculative import aggregate_spec
    from redwood.engine.request import SpecStats

    a, b = SpecStats(gamma=2), SpecStats(gamma=2)
    for n in (2, 1, 0):
        a.record(n)
    b.record(2)
    a.draft_s, b.draft_s, a.verify_s, b.verify_s = 0.5, 0.2, 1.0, 0.4
    agg = aggregate_spec([{"speculative": s.to_dict()} for s in (a, b)])
    assert agg["steps"] == 4 and agg["drafted"] == 8 and agg["accepted"] == 5
    assert agg["acceptance_rate"] == 5 / 8 and agg["mean_accepted_length"] == 9 / 4
    assert agg["acceptance_by_position"] == [3 / 4, 2 / 4]
    assert agg["draft_s"] == 0.5 and agg["verify_s"] == 1.0
    a.step_s, b.step_s = 1.7, 0.6
    agg = aggregate_spec([{"speculative": s.to_dict()} for s in (a, b)])
    assert agg["step_s"] == pytest.approx(1.7) and agg["ms_per_step"] == pytest.approx(1e3 * max(1.7 / 3, 0.6 / 1))


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["standalone", "--model", "x"], "needs --draft-model"),
        (["selfspec", "--model", "x", "--batch-size", "2", "0"], "--batch-size must be >= 1"),
        (["selfspec", "--model", "x", "--prefix-len", "-5"], "--prefix-len must be >= 1"),
        (["baseline", "--model", "x", "--gen-len", "1"], "--gen-len"),
        (["selfspec", "--model", "x", "--gamma", "3", "0"], "--gamma must be >= 1"),
        (["selfspec", "--model", "x", "--draft-kv", "lru"], "--draft-kv must be one of"),
        (["selfspec", "--model", "x", "--draft-kv", "snapkv"], "--draft-budget"),
        (["selfspec", "--model", "x", "--draft-kv", "streaming", "--draft-budget", "3", "--sinks", "4"], "--sinks"),
        (["selfspec", "--model", "x", "--verifier", "greedy", "--temperature", "0.5"], "--verifier greedy"),
        (["baseline", "--model", "x", "--top-p", "0"], "top_p"),
        (["baseline", "--model", "x", "--dataset", "essays", "--prompts-file", "f.txt"], "alternatives"),
        (["baseline", "--model", "x", "--prompts-file", "/nonexistent/f.txt"], "no such file"),
        (["baseline", "--model", "x", "--dataset", "no-such-set"], "unknown dataset"),
        (["baseline", "--model", "x", "--prompts-file", "empty.txt"], "is empty"),
    ],
)
def test_bad_values_are_one_line_errors(argv, msg, capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    argv = [str(tmp_path / a) if a == "empty.txt" else a for a in argv]
    assert main(["bench"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and msg in err and err.count("\n") == 1


def test_errors_after_loading(tiny_model_dir, text_file, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("The quick brown fox jumps over the lazy dog.")
    cases = [
        (["--prompts-file", str(text_file), "--prefix-len", "250", "--gen-len", "10"], "context of 256 tokens"),
        (["--prompts-file", str(short), "--prefix-len", "16", "200", "--gen-len", "8"], f"file {short} has"),
    ]
    for extra, msg in cases:
        assert main(["bench", "baseline", "--model", str(tiny_model_dir)] + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("redwood: error:") and msg in err and err.count("\n") == 1


def test_standalone_sweeps_trees_and_chains(tiny_model_dir, tiny_draft_dir, text_file, capsys):
    """--tree adds token trees to the sweep (alongside --gamma chains); greedy output stays identical."""
    res = _bench(
        [
            "standalone",
            "--model",
            str(tiny_model_dir),
            "--draft-model",
            str(tiny_draft_dir),
            "--prompts-file",
            str(text_file),
            "--batch-size",
            "1",
            "--prefix-len",
            "24",
            "--gen-len",
            "6",
            "--gamma",
            "2",
            "--tree",
            "chains:2x2",
            "generic-16",
            "--json",
        ],
        capsys,
    )
    res = json.loads(res)
    assert [(r["tree"], r["tree_size"]) for r in res["runs"]] == [("chain:2", 3), ("chains:2x2", 5), ("generic-16", 16)]
    assert res["all_identical"] is True


def test_spec_run_steady_state_rate_and_first_divergence():
    from redwood.bench.speculative import _spec_run
    from redwood.speculation.trees import Tree

    ar = {"tokens_per_s": 1000.0, "prefill_s": 0.1, "decode_s": 1.0, "token_ids": [[1, 2, 3], [4, 5, 6]]}
    sp = {"tokens_per_s": 900.0, "mean_accepted_length": 2.5, "ms_per_step": 4.0, "token_ids": [[1, 2, 3], [4, 7, 6]]}
    run = _spec_run({"batch_size": 2}, "chain:2", Tree.chain(2), sp, ar, greedy=True)
    # 2 rows × 2.5 tokens every 4 ms = 1250 tok/s while both rows generate, 1.25× the baseline
    assert abs(run["steady_tokens_per_s"] - 1250.0) < 1e-9 and abs(run["steady_speedup"] - 1.25) < 1e-12
    assert abs(run["speedup"] - 0.9) < 1e-12
    assert run["identical_to_ar"] is False and run["first_divergence"] == {"row": 1, "position": 1}
    same = _spec_run({"batch_size": 2}, "chain:2", Tree.chain(2), dict(sp, token_ids=ar["token_ids"]), ar, True)
    assert same["identical_to_ar"] is True and "first_divergence" not in same


def test_divergence_logits_is_the_targets_view_at_the_parting_token(tiny_llm):
    from functools import partial

    import torch

    from redwood.bench.divergence import divergence_logits
    from redwood.engine.prefill import fresh_logits

    model = tiny_llm.model
    prompt, ar_ids = [5, 9, 33, 2, 17], [40, 41, 42, 43]
    spec_ids = [40, 41, 99, 43]
    d = divergence_logits(partial(fresh_logits, model), prompt, ar_ids, spec_ids, 2)
    assert divergence_logits(tiny_llm.engine.prompt_logits, prompt, ar_ids, spec_ids, 2) == d
    ids = torch.tensor([prompt + ar_ids[:2]])
    with torch.inference_mode():
        logits = model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, 16))[0, -1].float()
    top = logits.topk(2).values
    assert abs(d["top2_gap"] - float(top[0] - top[1])) < 1e-4
    assert d["ar_token"] == 42 and d["spec_token"] == 99
    assert abs(d["logit_gap"] - float(logits[42] - logits[99])) < 1e-4


def test_table_reports_where_greedy_outputs_part():
    from redwood.bench.speculative import format_result

    run = {
        "batch_size": 2,
        "prefix_len": 32,
        "tree": "chain:2",
        "ar_tokens_per_s": 10.0,
        "tokens_per_s": 12.0,
        "speedup": 1.2,
        "steady_speedup": 1.5,
        "acceptance_rate": 0.5,
        "mean_accepted_length": 2.0,
        "draft_s": 0.0,
        "verify_s": 0.0,
        "ms_per_step": 3.0,
        "identical_to_ar": False,
        "acceptance_by_position": [0.5, 0.4],
        "gamma": 2,
        "first_divergence": {
            "row": 1,
            "position": 7,
            "top2_gap": 0.0625,
            "ar_token": 3,
            "spec_token": 4,
            "logit_gap": 0.0,
        },
    }
    text = format_result(
        {
            "kind": "selfspec",
            "model": "m",
            "draft": "self",
            "gen_len": 8,
            "temperature": 0.0,
            "top_p": 1.0,
            "prompts": "p",
            "dtype": "bfloat16",
            "device": "cuda",
            "runs": [run],
            "best": [],
            "all_identical": False,
        }
    )
    assert "row 1 parts at output token 7; target's top-2 logit gap there 0.0625" in text
