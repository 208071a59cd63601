"""`redwood profile` on a tiny model, and the chain acceptance → profile → tree-search → tree JSON."""

from __future__ import annotations

import json

import pytest

from redwood.cli import main
from redwood.speculation.trees import Tree
from redwood.tuning.profile import parse_sizes, profile_tree
from redwood.tuning.tree_search import load_profile
from tests.conftest import CORPUS

FAST = ["--context", "16", "--repeats", "2", "--warmup", "1", "--quiet"]


def test_profile_writes_a_loadable_profile(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--model",
            str(tiny_model_dir),
            "--tokens",
            "8,1,2,4,4",
            "--widths",
            "1,2,4",
            "--batch-size",
            "2",
            "--output",
            str(out),
        ]
        + FAST
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "target ms by tokens" in text and "draft (= target) ms by width" in text and "overhead" in text
    prof = load_profile(out)
    assert prof.target_tokens == (1, 2, 4, 8) and prof.draft_width == (1, 2, 4)
    assert prof.overhead_tokens == (1, 2, 4, 8) and len(prof.overhead_ms) == 4
    assert all(ms > 0 for ms in prof.target_ms + prof.draft_ms + prof.overhead_ms)
    assert prof.batch == 2 and prof.context == 16 and prof.dtype == "float32" and prof.device.startswith("cpu")
    raw = json.loads(out.read_text())
    assert raw["format"] == "redwood.profile/1"
    assert raw["models"] == {"target": str(tiny_model_dir), "draft": str(tiny_model_dir)}
    assert raw["notes"]["draft_is_target"] is True and raw["notes"]["overhead"]["verifier"] == "sequoia"


def test_profile_with_draft_and_no_overhead(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--model",
            str(tiny_model_dir),
            "--draft-model",
            str(tiny_model_dir),
            "--tokens",
            "1,3",
            "--widths",
            "1",
            "--no-overhead",
            "--temperature",
            "0",
            "--no-cuda-graphs",
            "--output",
            str(out),
        ]
        + FAST
    )
    assert rc == 0
    prof = load_profile(out)
    assert prof.overhead_ms is None and prof.draft_width == (1,) and prof.target_tokens == (1, 3)
    assert prof.notes["cuda_graphs"] is False
    assert "draft ms by width" in capsys.readouterr().out


def test_profile_offloaded_target(tiny_model_dir, tmp_path):
    """--offload times the target as an offloaded run streams it (layers in host memory; on the CPU the
    ring of layer slots with no-op streams); the draft stays resident."""
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--model",
            str(tiny_model_dir),
            "--draft-model",
            str(tiny_model_dir),
            "--tokens",
            "1,4",
            "--widths",
            "1",
            "--no-overhead",
            "--temperature",
            "0",
            "--offload",
            "--offload-prefetch",
            "1",
            "--output",
            str(out),
        ]
        + FAST
    )
    assert rc == 0
    prof = load_profile(out)
    assert prof.notes["target_offloaded"] is True and all(ms > 0 for ms in prof.target_ms)


@pytest.mark.parametrize(
    "kv,flags,described",
    [
        ("streaming", ["--draft-budget", "8"], "streaming(sinks=4, window=4)"),
        ("snapkv", ["--draft-budget", "8", "--window", "4"], "snapkv(budget=8, window=4"),
    ],
)
def test_profile_with_a_compressed_draft_cache(kv, flags, described, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """--draft-kv: every draft forward reads the context through that policy (MagicDec's draft cost; the
    target's forwards still read it all); recorded in the profile's notes."""
    from redwood.engine.runner import StepRunner

    seen = []
    forward = StepRunner.forward
    monkeypatch.setattr(
        StepRunner, "forward", lambda self, *a, **k: seen.append(k.get("policy")) or forward(self, *a, **k)
    )
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--model",
            str(tiny_model_dir),
            "--tokens",
            "1,2",
            "--widths",
            "1,2",
            "--no-overhead",
            "--draft-kv",
            kv,
            "--output",
            str(out),
        ]
        + flags
        + FAST
    )
    assert rc == 0
    assert f"draft (= target), {described}" in capsys.readouterr().out
    prof = load_profile(out)
    assert prof.notes["draft_kv"].startswith(described) and all(ms > 0 for ms in prof.draft_ms)
    # FAST: 1 warm-up + 2 timed forwards per size; the target's first (2 sizes), then the draft's
    target_calls, draft_calls = seen[:6], seen[6:]
    assert all(p is None for p in target_calls) and len(draft_calls) == 6
    assert all(p is not None and p.describe().startswith(described) for p in draft_calls)


def test_acceptance_profile_tree_search_end_to_end(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "\n".join(" ".join(CORPUS[(i + j) % 5].replace("\n", " ") for j in range(3)) for i in range(4)) + "\n"
    )
    acc = tmp_path / "acc.json"
    assert (
        main(
            [
                "acceptance",
                "--model",
                str(tiny_model_dir),
                "--draft-model",
                str(tiny_model_dir),
                "--width",
                "4",
                "--mode",
                "static",
                "--temperature",
                "1.5",
                "--verifier",
                "topk",
                "--prompts",
                str(prompts),
                "--num-prompts",
                "2",
                "--prompt-len",
                "24",
                "--gen-len",
                "16",
                "--output",
                str(acc),
                "--quiet",
            ]
        )
        == 0
    )
    prof = tmp_path / "prof.json"
    assert (
        main(
            [
                "profile",
                "--model",
                str(tiny_model_dir),
                "--tokens",
                "1,2,4,8,16",
                "--widths",
                "1,2,4,8",
                "--output",
                str(prof),
            ]
            + FAST
        )
        == 0
    )
    capsys.readouterr()
    tree_path = tmp_path / "tree.json"
    rc = main(
        [
            "tree-search",
            "--acceptance",
            str(acc),
            "--profile",
            str(prof),
            "--budget",
            "16",
            "--max-depth",
            "5",
            "--json",
            "--output",
            str(tree_path),
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    tree = Tree.load(tree_path)
    assert tree.size == summary["size"] <= 16 and tree.max_depth <= 5
    assert summary["predicted_speedup"] > 0
    assert tree.meta["acceptance"]["method"] == "static"
    assert tree.meta["profile"]["target"]["tokens"] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--tokens", "2,4"], "--tokens must include 1"),
        (["--widths", "1,x"], "--widths"),
        (["--tokens", "0,1"], "positive"),
        (["--repeats", "0"], "--repeats"),
        (["--verifier", "greedy"], "greedy"),
        (["--verifier", "nope"], "--verifier"),
        (["--context", "300"], "context"),
        (["--offload-prefetch", "2"], "--offload-prefetch only applies with --offload"),
        (["--offload", "--offload-prefetch", "0"], "prefetch"),
        (["--draft-weights", "int8"], "--draft-weights only applies with --draft-model"),
        (
            ["--draft-model", "d", "--draft-weights", "int4", "--device", "cuda"],
            "--draft-weights int4 is a CPU format; on CUDA the draft takes auto or float32 (--dtype) or int8",
        ),
        (["--draft-kv", "lru"], "--draft-kv must be one of"),
        (["--draft-kv", "snapkv"], "snapkv draft KV needs --draft-budget"),
        (["--draft-kv", "streaming", "--draft-budget", "4"], "larger than --sinks"),
        (["--draft-kv", "snapkv", "--draft-budget", "8", "--pool-kernel", "2"], "--pool-kernel must be odd"),
    ],
)
def test_profile_errors_are_one_line(tiny_model_dir, tmp_path, capsys, argv, needle):
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--model",
            str(tiny_model_dir),
            "--tokens",
            "1,2",
            "--widths",
            "1,2",
            "--quiet",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--output",
            str(out),
        ]
        + argv
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("redwood: error:") and needle in err
    assert not out.exists()


def test_helpers():
    assert parse_sizes("4, 1,2,2", "--tokens") == (1, 2, 4)
    t = profile_tree(7)
    assert t.parents == (-1, 0, 0, 1, 1, 2, 2) and t.max_depth == 3
    assert profile_tree(1).size == 1


def test_magicdec_tree_pipeline_end_to_end(tiny_model_dir, tmp_path, capsys):
    """Sequoia planning for a MagicDec draft (h200_bench.sh p3tree, small): the acceptance vector of the
    target drafting over a streaming cache, its profile through that cache at batch 2, tree-search, and
    `bench selfspec --tree` with the searched tree — greedy output identical to autoregressive."""
    text = tmp_path / "long.txt"
    text.write_text("\n".join(CORPUS))
    lines = tmp_path / "prompts.txt"
    lines.write_text(
        "\n".join(" ".join(CORPUS[(i + j) % 5].replace("\n", " ") for j in range(3)) for i in range(4)) + "\n"
    )
    kv = ["--draft-kv", "streaming", "--draft-budget", "12", "--sinks", "2"]
    acc, prof, tree = tmp_path / "acc.json", tmp_path / "prof.json", tmp_path / "tree.json"
    assert (
        main(
            [
                "acceptance",
                "--model",
                str(tiny_model_dir),
                "--self-speculate",
                *kv,
                "--width",
                "3",
                "--mode",
                "dynamic",
                "--temperature",
                "0",
                "--prompts",
                str(lines),
                "--num-prompts",
                "2",
                "--prompt-len",
                "40",
                "--gen-len",
                "12",
                "--output",
                str(acc),
                "--quiet",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "profile",
                "--model",
                str(tiny_model_dir),
                "--batch-size",
                "2",
                "--context",
                "40",
                "--tokens",
                "1,2,4,8",
                "--widths",
                "1,2,4",
                "--no-overhead",
                *kv,
                "--repeats",
                "2",
                "--warmup",
                "1",
                "--quiet",
                "--output",
                str(prof),
            ]
        )
        == 0
    )
    assert load_profile(prof).notes["draft_kv"] == "streaming(sinks=2, window=10)"
    capsys.readouterr()
    assert (
        main(
            [
                "tree-search",
                "--acceptance",
                str(acc),
                "--profile",
                str(prof),
                "--budget",
                "8",
                "--max-depth",
                "4",
                "--json",
                "--output",
                str(tree),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["size"] <= 8
    rc = main(
        [
            "bench",
            "selfspec",
            "--model",
            str(tiny_model_dir),
            "--prompts-file",
            str(text),
            "--batch-size",
            "2",
            "--prefix-len",
            "40",
            "--gen-len",
            "8",
            "--gamma",
            "2",
            "--tree",
            str(tree),
            *kv,
            "--json",
            "--output",
            str(tmp_path / "rep"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    runs = json.loads(out)["runs"]
    assert [r["tree"] for r in runs] == ["chain:2", str(tree)]
    assert all(r["identical_to_ar"] for r in runs)
