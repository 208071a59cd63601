"""`redwood tree-search` through `redwood.cli.main`."""

from __future__ import annotations

import json

import pytest

from redwood.cli import main
from redwood.speculation.trees import Tree
from redwood.tuning.acceptance import AcceptanceVector, save_acceptance
from redwood.tuning.tree_search import LatencyProfile, optimal_tree, save_profile


def test_inline_values_prints_expected_and_writes_tree(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(
        [
            "tree-search",
            "--acceptance-values",
            "0.6,0.2,0.1",
            "--budget",
            "32",
            "--max-depth",
            "6",
            "--output",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    want_tree, want = optimal_tree([0.6, 0.2, 0.1], 32, 6)
    assert f"expected tokens per step: {want:.4f}" in text
    assert "32 nodes" in text
    tree = Tree.load(out)
    assert tree == want_tree
    assert tree.meta["acceptance"]["values"] == [0.6, 0.2, 0.1]
    assert tree.meta["expected_tokens"] == pytest.approx(want, abs=1e-5)


def test_acceptance_file_and_json_summary(tmp_path, capsys):
    vec = AcceptanceVector(
        values=(0.5, 0.2),
        method="dynamic",
        p_none=0.3,
        models={"target": "T", "draft": "D"},
        temperature=0.6,
        per_depth=((0.6, 0.2), (0.4, 0.2)),
    )
    path = save_acceptance(vec, tmp_path / "a.json")
    assert main(["tree-search", "--acceptance", str(path), "--budget", "20", "--max-depth", "5", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    _, want = optimal_tree(vec, 20, 5)
    assert s["size"] == 20 and s["per_depth"] is True
    assert s["expected_tokens"] == pytest.approx(want)
    assert (
        main(
            ["tree-search", "--acceptance", str(path), "--budget", "20", "--max-depth", "5", "--json", "--no-per-depth"]
        )
        == 0
    )
    s2 = json.loads(capsys.readouterr().out)
    assert s2["per_depth"] is False
    assert s2["expected_tokens"] == pytest.approx(optimal_tree([0.5, 0.2], 20, 5)[1])


def test_budget_that_does_not_fit_is_noted(capsys):
    assert main(["tree-search", "--acceptance-values", "0.7", "--budget", "10", "--max-depth", "3"]) == 0
    text = capsys.readouterr().out
    assert "3 nodes" in text and "do not fit" in text


def test_profile_selection(tmp_path, capsys):
    prof = LatencyProfile(
        target_tokens=(1, 2, 4, 8, 16, 32),
        target_ms=(10, 10, 10, 12, 14, 18),
        draft_width=(1,),
        draft_ms=(0.3,),
        device="test",
    )
    ppath = save_profile(prof, tmp_path / "p.json")
    out = tmp_path / "sel.json"
    rc = main(
        [
            "tree-search",
            "--acceptance-values",
            "0.6355,0.06,0.03,0.02",
            "--budget",
            "32",
            "--max-depth",
            "8",
            "--profile",
            str(ppath),
            "--sizes",
            "measured",
            "--top",
            "3",
            "--output",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "selected: size 4, depth 4" in text
    assert "predicted speedup 2.05" in text
    assert "speedup" in text.splitlines()[4]  # the candidates table header
    tree = Tree.load(out)
    assert tree == Tree.chain(3) and tree.meta["selected"]["predicted_speedup"] == pytest.approx(2.05, abs=0.005)
    assert tree.meta["profile"]["device"] == "test"
    rc = main(
        [
            "tree-search",
            "--acceptance-values",
            "0.6355,0.06,0.03,0.02",
            "--budget",
            "32",
            "--max-depth",
            "8",
            "--profile",
            str(ppath),
            "--json",
            "--top",
            "3",
        ]
    )
    s = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(s["candidates"]) == 3
    assert s["candidates"][0]["tau_ms"] == pytest.approx(s["tau_ms"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--acceptance-values", "0.6,0.5", "--budget", "8", "--max-depth", "3"], "sums to"),
        (["--acceptance-values", "0.6,x", "--budget", "8", "--max-depth", "3"], "comma-separated"),
        (["--acceptance-values", "0.6", "--budget", "0", "--max-depth", "3"], "--budget"),
        (["--acceptance-values", "0.6", "--budget", "8", "--max-depth", "0"], "--max-depth"),
        (["--acceptance", "/nonexistent/a.json", "--budget", "8", "--max-depth", "3"], "not found"),
        (
            ["--acceptance-values", "0.6", "--budget", "8", "--max-depth", "3", "--profile", "/nonexistent/p.json"],
            "profile file not found",
        ),
    ],
)
def test_errors_are_one_line(argv, message, capsys):
    assert main(["tree-search", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("redwood: error:") and message in err
    assert len(err.splitlines()) == 1


def test_acceptance_source_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["tree-search", "--budget", "8", "--max-depth", "3"])


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--budget", "100000", "--max-depth", "8"], "--budget must be at most 4096 nodes"),
        (["--budget", "64", "--max-depth", "100"], "--max-depth must be at most 65 levels"),
    ],
)
def test_work_is_bounded(flags, msg, capsys):
    assert main(["tree-search", "--acceptance-values", "0.6,0.2"] + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and msg in err and err.count("\n") == 1


def test_a_long_search_logs_progress_with_an_estimate(monkeypatch, capsys):
    """Not a terminal (capsys): plain lines on stderr, one per LOG_EVERY_S at most, and the last."""
    import redwood.commands.tree_search as cmd
    import redwood.progress as progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    real = progress.Progress
    monkeypatch.setattr(cmd, "Progress", lambda **kw: real(**kw, delay=0.0))
    assert main(["tree-search", "--acceptance-values", "0.6,0.2", "--budget", "64", "--max-depth", "6"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("tree-search (budget 64): 1/6 levels (17%)") and "left" in lines[0]
    assert lines[-1].startswith("tree-search (budget 64): 6/6 levels (100%)") and len(lines) == 6
