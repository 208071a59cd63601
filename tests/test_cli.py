"""The `redwood` command line: generate (human and JSON output), bench ar, and clear errors."""

from __future__ import annotations

import json

import pytest

from redwood.cli import main


def test_generate_human_output(tiny_model_dir, capsys):
    rc = main(
        ["generate", "--model", str(tiny_model_dir), "--prompt", "Paris is", "--max-new-tokens", "6", "--ignore-eos"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.rstrip("\n").split("\n")
    assert lines[-1].startswith("[") and "6 generated (length)" in lines[-1] and "tokens/s" in lines[-1]


def test_generate_json_matches_api(tiny_model_dir, tiny_llm, capsys):
    from redwood import SamplingParams

    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "def add(a, b):",
            "--chat",
            "--max-new-tokens",
            "7",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--top-k",
            "20",
            "--seed",
            "4",
            "--ignore-eos",
            "--json",
        ]
    )
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) >= {"text", "token_ids", "stats"}
    ref = tiny_llm.generate(
        ["def add(a, b):"],
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=4, max_new_tokens=7, ignore_eos=True),
        chat=True,
    )[0]
    assert obj["token_ids"] == ref.token_ids and obj["text"] == ref.text
    assert obj["stats"]["generated_tokens"] == 7


def test_bench_ar_compare_hf(tiny_model_dir, capsys, tmp_path):
    rc = main(
        [
            "bench",
            "ar",
            "--model",
            str(tiny_model_dir),
            "--prompt-len",
            "16",
            "--gen-len",
            "8",
            "--batch-size",
            "2",
            "--compare-hf",
            "--json",
            "--output",
            str(tmp_path / "rep"),
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["hf_same_tokens"] is True
    assert res["redwood"]["decode_tokens_per_s"] > 0 and res["speedup_vs_hf"] > 0
    assert (tmp_path / "rep" / "report.json").exists()


def test_errors_are_one_line_with_status_2(tmp_path, capsys):
    cases = [
        (["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"], "no such model or path"),
        (["generate", "--model", "x", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--model", "x", "--prompt", "x", "--top-p", "2"], "top_p"),
        (["generate", "--model", str(tmp_path), "--prompt", "x"], "neither a Hugging Face model folder"),
        (["bench", "ar", "--model", "x", "--gen-len", "0"], "--gen-len"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("redwood: error:") and msg in err and "Traceback" not in err


def test_dtype_device_errors(tiny_model_dir, capsys):
    import torch

    if not torch.cuda.is_available():
        assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--device", "cuda"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--device", "tpu"]) == 2
    assert "device" in capsys.readouterr().err


def test_bfloat16_runs(tiny_model_dir, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "Paris",
                "--dtype",
                "bfloat16",
                "--max-new-tokens",
                "4",
                "--ignore-eos",
                "--json",
            ]
        )
        == 0
    )
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4


# ------------------------------------------------------------------------------------ speculation flags


SPEC_KEYS = {
    "gamma",
    "steps",
    "drafted",
    "accepted",
    "acceptance_rate",
    "mean_accepted_length",
    "acceptance_by_position",
    "draft_s",
    "verify_s",
}


def _greedy_reference(tiny_llm, prompt, n):
    from redwood import SamplingParams

    return tiny_llm.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize(
    "flags, draft",
    [
        (
            [
                "--self-speculate",
                "--draft-kv",
                "streaming",
                "--draft-budget",
                "8",
                "--sinks",
                "2",
                "--speculative",
                "fixed",
            ],
            "self (streaming",
        ),
        (
            [
                "--self-speculate",
                "--draft-kv",
                "snapkv",
                "--draft-budget",
                "6",
                "--window",
                "4",
                "--pool-kernel",
                "3",
                "--gamma",
                "2",
            ],
            "self (snapkv(budget=6, window=4, kernel=3",
        ),
    ],
)
def test_generate_self_speculate_json(tiny_model_dir, tiny_llm, capsys, flags, draft):
    prompt = "Paris is the capital of France. Rome is"
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "10",
            "--ignore-eos",
            "--json",
        ]
        + flags
    )
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["token_ids"] == _greedy_reference(tiny_llm, prompt, 10)
    assert obj["draft"].startswith(draft)
    spec = obj["stats"]["speculative"]
    assert set(spec) >= SPEC_KEYS and spec["gamma"] == (2 if "--gamma" in flags else 4)
    assert spec["steps"] >= 1 and len(spec["acceptance_by_position"]) == spec["gamma"]


def test_generate_ngram_draft_json(tiny_model_dir, tiny_llm, capsys):
    """`generate --draft ngram`: greedy tokens equal AR's; the report names the drafter."""
    prompt = "the cat sat on the mat; the cat sat on the mat; the cat"
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--max-new-tokens", "12"]
    rc = main(args + ["--ignore-eos", "--json", "--draft", "ngram", "--ngram-min", "1", "--gamma", "3"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["token_ids"] == _greedy_reference(tiny_llm, prompt, 12)
    assert obj["draft"] == "ngram 1-4" and obj["stats"]["speculative"]["gamma"] == 3


def test_generate_suffix_draft_json(tiny_model_dir, tiny_llm, capsys):
    """`generate --draft suffix` (its default tree) and `--draft suffix --gamma 3` (a chain): greedy tokens
    equal AR's; the report names the drafter."""
    prompt = "the cat sat on the mat; the cat sat on the mat; the cat"
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--max-new-tokens", "12"]
    for extra, depth in (([], 6), (["--gamma", "3"], 3)):
        rc = main(args + ["--ignore-eos", "--json", "--draft", "suffix", "--ngram-min", "1", "--suffix-shared"] + extra)
        assert rc == 0
        obj = json.loads(capsys.readouterr().out)
        assert obj["token_ids"] == _greedy_reference(tiny_llm, prompt, 12)
        assert obj["draft"] == "suffix 1-4 shared" and obj["stats"]["speculative"]["gamma"] == depth


def test_generate_draft_model_json_and_human(tiny_model_dir, tiny_draft_dir, tiny_llm, capsys):
    prompt = "def add(a, b):"
    base = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--draft-model",
        str(tiny_draft_dir),
        "--gamma",
        "3",
        "--verifier",
        "greedy",
    ]
    assert main(base + ["--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["token_ids"] == _greedy_reference(tiny_llm, prompt, 8)
    assert obj["draft"] == f"{tiny_draft_dir} (full)"
    spec = obj["stats"]["speculative"]
    assert spec["gamma"] == 3 and spec["steps"] <= spec["drafted"] <= 3 * spec["steps"]  # (cut at the tail)
    # emitted tokens only (the first one is the prefill's; a last step with one token left drafts nothing)
    assert 8 - 2 <= spec["steps"] + spec["accepted"] <= 8 - 1

    assert main(base) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert lines[-2] == f"[draft: {tiny_draft_dir} (full)]"
    stats = lines[-1]
    assert stats.startswith("[") and "8 generated (length)" in stats
    assert "speculative gamma 3" in stats and "acceptance" in stats and "mean accepted length" in stats
    assert "draft " in stats and "verify " in stats


def test_generate_sampling_speculation(tiny_model_dir, capsys):
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "for i in",
            "--max-new-tokens",
            "6",
            "--temperature",
            "0.8",
            "--seed",
            "1",
            "--ignore-eos",
            "--self-speculate",
            "--speculative",
            "fixed",
            "--json",
        ]
    )
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert len(obj["token_ids"]) == 6 and obj["stats"]["speculative"]["gamma"] == 4


@pytest.mark.parametrize(
    "flags, policy",
    [
        (["--self-speculate"], "auto"),
        (["--draft", "ngram"], "auto"),
        (["--self-speculate", "--verifier", "match"], "auto"),  # (a verifier does not pin the plan)
        (["--self-speculate", "--gamma", "3"], "fixed"),
        (["--self-speculate", "--tree", "chain:2"], "fixed"),
        (["--draft", "suffix"], "fixed"),  # (the suffix drafter's token tree)
        (["--self-speculate", "--speculative", "fixed"], "fixed"),
    ],
)
def test_a_drafter_without_gamma_or_tree_speculates_automatically(flags, policy):
    """The automatic policy is the default whenever a drafter is given and nothing pins a fixed plan."""
    from redwood.cli import build_parser
    from redwood.commands.options import speculative_config_from_args

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", *flags])
    assert speculative_config_from_args(args).policy == policy


def test_generate_speculates_automatically_by_default(tiny_model_dir, tiny_llm, capsys):
    prompt = "Paris is the capital of France. Rome is"
    rc = main(
        ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--max-new-tokens", "10", "--ignore-eos"]
        + ["--self-speculate", "--json"]
    )
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["token_ids"] == _greedy_reference(tiny_llm, prompt, 10)
    assert obj["draft"].startswith("auto: self")


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--draft-model", "d", "--self-speculate"], "mutually exclusive"),
        (["--gamma", "3"], "--gamma only applies when speculating"),
        (["--draft-kv", "streaming", "--sinks", "2"], "--draft-kv, --sinks only apply when speculating"),
        (["--self-speculate", "--gamma", "0"], "--gamma must be >= 1"),
        (["--self-speculate", "--draft-kv", "h2o"], "--draft-kv must be one of full, streaming, snapkv"),
        (["--self-speculate", "--verifier", "typical"], "--verifier must be one of"),
        (["--self-speculate", "--draft-kv", "snapkv"], "needs --draft-budget"),
        (["--self-speculate", "--draft-kv", "snapkv", "--draft-budget", "16"], "observation --window (32"),
        (["--self-speculate", "--draft-kv", "streaming"], "needs --draft-budget or --window"),
        (["--self-speculate", "--draft-kv", "streaming", "--draft-budget", "4"], "larger than --sinks (4)"),
        (
            ["--self-speculate", "--draft-kv", "streaming", "--draft-budget", "10", "--sinks", "2", "--window", "4"],
            "!= sinks",
        ),
        (["--self-speculate", "--draft-budget", "0"], "--draft-budget must be >= 1"),
        (["--self-speculate", "--sinks", "-1"], "--sinks must be >= 0"),
        (["--self-speculate", "--draft-kv", "snapkv", "--draft-budget", "40", "--pool-kernel", "4"], "odd"),
        (["--self-speculate", "--verifier", "greedy", "--temperature", "0.7"], "--verifier greedy"),
        (["--draft-weights", "int8"], "--draft-weights only applies when speculating"),
        (
            ["--draft-model", "d", "--draft-weights", "int4", "--device", "cuda"],
            "--draft-weights int4 is a CPU format; on CUDA the draft takes auto or float32 (--dtype) or int8",
        ),
        (["--self-speculate", "--draft-weights", "int8"], "self-speculation drafts with the target's weights"),
        (["--self-speculate", "--gamma", "1000"], "--gamma must be at most 64"),
        (["--self-speculate", "--gamma", "0"], "--gamma must be >= 1"),
        (["--threads", "0"], "--threads must be a positive integer, got 0"),
        (["--draft", "ngram", "--self-speculate"], "--self-speculate and --draft are mutually exclusive"),
        (["--ngram-min", "2"], "--ngram-min only applies when speculating"),
        (["--draft-model", "d", "--ngram-max", "3"], "--ngram-min / --ngram-max apply to --draft ngram"),
        (["--draft", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "ngram_min (3) must be at most ngram_max (2)"),
        (["--draft", "ngram", "--draft-kv", "streaming", "--draft-budget", "8"], "reads no KV cache"),
        (["--draft", "ngram", "--draft-weights", "int8"], "--draft-weights only applies with --draft-model M"),
        (["--suffix-shared"], "--suffix-shared only applies when speculating"),
        (["--draft", "ngram", "--suffix-shared"], "--suffix-shared applies to --draft suffix"),
        (["--draft", "suffix", "--verifier", "sequoia"], "the suffix drafter's are deterministic"),
        (["--draft", "suffix", "--tree", "generic-16", "--verifier", "sampling"], "needs the draft distribution"),
    ],
)
def test_speculation_flag_errors(flags, msg, tmp_path, capsys):
    # the model path doesn't exist: each error must come before any model is loaded
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"] + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and msg in err and err.count("\n") == 1, err


def test_int8_draft_on_the_cpu_is_the_cpu_int8_format(tiny_model_dir, capsys):
    """--draft-weights int8 on the CPU: the draft loads in the CPU int8 format (the one-token int8 copies
    are the CUDA matrix-vector kernels' — on the CPU, quantize_skinny is one clear error)."""
    import pytest

    from redwood.errors import ConfigError
    from redwood.loading import load_draft_model, load_model

    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "x",
            "--draft-model",
            str(tiny_model_dir),
            "--draft-weights",
            "int8",
            "--max-new-tokens",
            "2",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    draft = load_draft_model(tiny_model_dir, draft_weights="int8")
    assert draft.model.weights == "int8" and draft.model.skinny_int8 is None
    with pytest.raises(ConfigError, match="matrix-vector kernels"):
        load_model(tiny_model_dir).model.quantize_skinny("int8")


def test_incompatible_draft_tokenizer(tiny_model_dir, tmp_path, capsys):
    from tests.conftest import make_tokenizer, random_hf_model, tiny_hf_config

    other = make_tokenizer(vocab_size=300)
    folder = tmp_path / "other-draft"
    random_hf_model(tiny_hf_config("qwen2", num_hidden_layers=1)).save_pretrained(folder)
    other.save_pretrained(folder)
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--draft-model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and "tokenizer" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------ token trees (--tree)


def test_generate_self_speculate_tree_json_equals_plain(tiny_model_dir, tiny_llm, capsys):
    prompt = "Paris is the capital of France. Rome is"
    base = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--self-speculate",
        "--draft-kv",
        "streaming",
        "--draft-budget",
        "16",
        "--tree",
        "generic-16",
    ]
    assert main(base + ["--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["token_ids"] == _greedy_reference(tiny_llm, prompt, 12)
    spec = obj["stats"]["speculative"]
    assert set(spec) >= SPEC_KEYS
    assert spec["drafted_per_step"] == 15 and spec["gamma"] == 5  # 16 nodes, 6 levels
    assert spec["steps"] <= spec["drafted"] <= 15 * spec["steps"]  # (tail steps draft a cut tree)
    assert spec["mean_accepted_length"] >= 1.0
    # The human stats line names the tree and reports tokens per step (mean accepted length).
    assert main(base) == 0
    stats = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    assert "speculative tree 16 nodes, depth 5" in stats
    assert f"mean accepted length {spec['mean_accepted_length']:.2f} tokens/step" in stats


@pytest.mark.parametrize(
    "flags",
    [
        ["--draft-kv", "streaming", "--draft-budget", "16", "--tree", "chains:2x2", "--verifier", "greedy"],
        ["--tree", "chain:3", "--gamma", "3", "--verifier", "sequoia"],  # a chain of γ may come with --gamma γ
    ],
)
def test_generate_tree_flags_greedy(tiny_model_dir, tiny_llm, capsys, flags, tmp_path):
    prompt = "def add(a, b):"
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                prompt,
                "--max-new-tokens",
                "8",
                "--ignore-eos",
                "--self-speculate",
                "--json",
            ]
            + flags
        )
        == 0
    )
    obj = json.loads(capsys.readouterr().out)
    assert obj["token_ids"] == _greedy_reference(tiny_llm, prompt, 8)


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer", "topk", "sampling"])
def test_generate_tree_sampling_verifiers(tiny_model_dir, tiny_draft_dir, capsys, verifier, tmp_path):
    from redwood.speculation.trees import Tree

    tree = Tree((-1, 0, 0, 0, 1, 1)).save(tmp_path / "tree.json")
    argv = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "for i in",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "3",
        "--ignore-eos",
        "--draft-model",
        str(tiny_draft_dir),
        "--tree",
        str(tree),
        "--verifier",
        verifier,
        "--json",
    ]
    assert main(argv) == 0
    obj = json.loads(capsys.readouterr().out)
    assert len(obj["token_ids"]) == 6
    spec = obj["stats"]["speculative"]
    assert spec["drafted_per_step"] == 5 and spec["gamma"] == 2
    assert main(argv) == 0  # seeded: reproducible
    assert json.loads(capsys.readouterr().out)["token_ids"] == obj["token_ids"]


def test_tree_flag_errors(tmp_path, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    not_bfs = tmp_path / "not-bfs.json"
    not_bfs.write_text(json.dumps({"format": "redwood.tree/1", "parents": [-1, 0, 1, 0]}))
    cases = [
        (["--self-speculate", "--tree", "nope"], "unknown tree 'nope'"),
        (["--self-speculate", "--tree", "chain:x"], "bad tree spec 'chain:x'"),
        (["--self-speculate", "--tree", "chains:0x2"], "expected chains:KxL"),
        (["--self-speculate", "--tree", "chain:0"], "chain:0 has no draft tokens"),  # as --gamma 0
        (["--self-speculate", "--tree", "chains:3x0"], "has no draft tokens"),
        (["--self-speculate", "--tree", "chain:65"], "drafts 65 tokens deep; at most 64"),
        (["--self-speculate", "--tree", str(tmp_path / "missing.json")], "tree file not found"),
        (["--self-speculate", "--tree", str(bad_json)], "not valid JSON"),
        (["--self-speculate", "--tree", str(not_bfs)], "breadth-first"),
        (["--self-speculate", "--tree", "generic-16", "--gamma", "4"], "contradicts --gamma 4"),
        (["--self-speculate", "--tree", "chain:3", "--gamma", "2"], "contradicts --gamma 2"),
        (["--tree", "chain:3"], "--tree only applies when speculating"),
        (
            ["--self-speculate", "--tree", "generic-16", "--verifier", "greedy", "--temperature", "0.5"],
            "--verifier greedy",
        ),
        (["--self-speculate", "--tree", "generic-16", "--verifier", "beam"], "--verifier must be one of"),
    ]
    for flags, msg in cases:
        # the model path doesn't exist: each error must come before any model is loaded
        assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"] + flags) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("redwood: error:") and msg in err and err.count("\n") == 1, (flags, err)


@pytest.mark.parametrize("argv", [["models", "list"], ["data", "list"]])
def test_a_closed_pipe_ends_quietly(argv):
    """`redwood … | head -1`: when the reader has gone, the command ends without a traceback."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "redwood.cli", *argv], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(w)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_temperature_must_be_finite(value):
    from redwood.cli import main

    assert main(["generate", "--prompt", "x", "--temperature", value]) == 2


def test_version_names_the_cpu_kernels_build(capsys, monkeypatch):
    from redwood import __version__
    from redwood.cpu_kernels import kquant

    monkeypatch.setattr(kquant, "describe", lambda: "CPU kernels: avx2 (auto; this CPU runs avx2, portable)")
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert (
        e.value.code == 0 and out == f"redwood {__version__}\nCPU kernels: avx2 (auto; this CPU runs avx2, portable)\n"
    )


@pytest.fixture
def no_weights(monkeypatch):
    """Weight loading that fails the test: the checks under test must come before it."""
    import redwood.engine.loaded as engine_mod

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(engine_mod, "load_model", refuse)


def test_an_empty_prompt_is_refused_before_the_weights_load(tiny_model_dir, no_weights, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", ""]) == 2
    err = capsys.readouterr().err
    assert err == "redwood: error: the prompt is empty; give at least one token\n"
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x " * 5000]) == 2
    assert "leave room to generate" in capsys.readouterr().err


def test_a_draft_tokenizer_that_differs_is_refused_before_the_weights_load(
    tiny_model_dir, tmp_path, no_weights, capsys
):
    from tests.conftest import make_tokenizer, random_hf_model, tiny_hf_config

    folder = tmp_path / "other-draft"
    random_hf_model(tiny_hf_config("qwen2", num_hidden_layers=1)).save_pretrained(folder)
    make_tokenizer(vocab_size=300).save_pretrained(folder)
    capsys.readouterr()  # (transformers' own progress while saving)
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--draft-model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error: the draft model's tokenizer differs") and err.count("\n") == 1


def test_threads_flag_sets_torch_threads(tiny_model_dir, capsys):
    import torch

    assert (
        main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--max-new-tokens", "2", "--threads", "2"])
        == 0
    )
    assert torch.get_num_threads() == 2  # (the autouse one_thread fixture restores it)


def test_loading_and_a_long_prefill_show_progress_unless_quiet(tiny_model_dir, monkeypatch, capsys):
    """Off a terminal (capsys): plain lines on stderr — the weights read, then the prefill's chunks."""
    import redwood.llm
    import redwood.loading.hf
    import redwood.progress as progress

    real = progress.Progress
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    for module in (redwood.llm, redwood.loading.hf):  # (no delay: tiny models are quick)
        monkeypatch.setattr(module, "Progress", lambda **kw: real(**kw, delay=0.0))
    argv = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "a b " * 30,
        "--max-new-tokens",
        "2",
        "--max-num-batched-tokens",
        "16",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"loading {tiny_model_dir.name}: ") and err[0].endswith("MB (100%), 0s")
    prefill = [line for line in err if line.startswith("prefill: ")]
    total = int(prefill[0].split("/")[1].split()[0])
    assert total > 16 and prefill[0].startswith("prefill: 16/") and prefill[-1].startswith(f"prefill: {total}/")
    assert main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_generate_compare_ar_reports_ar_and_speculation_speed(tiny_model_dir, capsys):
    """--compare-ar N: after the speculative answer, AR decodes N tokens of the same prompt; the line after
    the stats line reports both decode speeds and the speedup (greedy: the tokens are AR's)."""
    base = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "Paris is the capital of",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--draft-model",
        str(tiny_model_dir),
        "--gamma",
        "3",
    ]
    assert main(base + ["--compare-ar", "8"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    stats, compare = lines[-2], lines[-1]
    assert "prefill" in stats and "; decode " in stats and " s, " in stats  # wall times of both
    assert compare.startswith("[compare-ar: AR ") and "over 8 tokens" in compare and "speedup" in compare
    assert "greedy tokens equal AR's" in compare
    assert main(base + ["--compare-ar", "--json"]) == 0  # N defaults to 64, cut to the answer's 12 tokens
    c = json.loads(capsys.readouterr().out)["compare_ar"]
    assert c["tokens"] == 12 and c["greedy_equal"] and c["speedup"] > 0
    assert c["speedup"] == pytest.approx(c["spec_decode_tokens_per_s"] / c["ar_decode_tokens_per_s"], rel=1e-2)


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--compare-ar"], "--compare-ar compares speculation with autoregressive decoding: add --draft-model"),
        (["--compare-ar", "1", "--self-speculate"], "--compare-ar N must be >= 2"),
    ],
)
def test_generate_compare_ar_errors(flags, msg, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"] + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("redwood: error:") and msg in err and err.count("\n") == 1, err


def test_compare_line_names_where_greedy_tokens_left_ar_and_the_gap_there():
    from redwood.commands.generate import compare_line

    c = {
        "tokens": 64,
        "prefill_s": 0.5,
        "decode_s": 20.0,
        "ar_decode_tokens_per_s": 3.15,
        "spec_decode_tokens_per_s": 6.3,
        "speedup": 2.0,
    }
    assert compare_line(c).startswith(
        "[compare-ar: AR 3.15 tokens/s over 64 tokens (prefill 0.500 s, decode "
        "20.000 s), speculation 6.30 tokens/s (decode), speedup 2.00×"
    )
    line = compare_line({**c, "greedy_equal": False, "first_difference": 6, "ar_top2_gap": 0.0})
    assert "leave AR's at token 6, where AR's two most likely tokens' logits differ by 0 " in line
    assert compare_line({**c, "greedy_equal": True, "first_difference": None}).endswith("greedy tokens equal AR's]")


def test_prefill_first_flag_reaches_the_engine(tiny_model_dir, capsys):
    """--prefill-first (every command with the engine flags) becomes EngineConfig.prefill_first; unset, it is not
    passed (the config's default)."""
    import argparse

    from redwood.commands.options import engine_kwargs

    assert engine_kwargs(argparse.Namespace(prefill_first=True, max_num_seqs=4)) == {
        "prefill_first": True,
        "max_num_seqs": 4,
    }
    assert "prefill_first" not in engine_kwargs(argparse.Namespace(prefill_first=False))
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "a b c", "--max-new-tokens", "3", "--quiet"]
    assert main(argv + ["--prefill-first", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == first["text"]
