"""Acceptance-vector measurement: exact static expectations against the real verifiers, dynamic histograms
through the engine, and the `redwood acceptance` command."""

from __future__ import annotations

import json

import pytest
import torch

from redwood import LLM
from redwood.cli import main
from redwood.sample.tree_verify import CHILD_RULE, draw_children, verify_tree
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.trees import Tree
from redwood.tuning.acceptance import load_acceptance
from redwood.tuning.measure import (
    dataset_texts,
    expected_acceptance,
    held_out_order,
    measure_dynamic,
    star_tree_spec,
    static_acceptance,
)
from tests.conftest import CORPUS, save_target_and_draft


# ------------------------------------------------------------------------------------ synthetic p / q
def _dist(weights):
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


CASES = {
    # both full support, different shapes
    "generic": (_dist([5, 3, 1, 1, 2, 0.5, 4, 0.5]), _dist([1, 4, 2, 1, 0.5, 3, 1, 2])),
    # the draft has support 2 < W = 4: exhausted support (uniform over untried) kicks in
    "small-draft-support": (_dist([3, 1, 2, 2, 1, 1, 0.5, 0.5]), _dist([0, 5, 0, 0, 1, 0, 0, 0])),
    # the target has zeros, draft far from it
    "far": (_dist([0, 0, 6, 1, 0, 2, 0, 1]), _dist([4, 3, 0.2, 0.1, 2, 0.3, 1, 0.4])),
}


def _static_mean(p, q, width, verifier, n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    acc = static_acceptance(p.expand(n, -1).contiguous(), q.expand(n, -1).contiguous(), width, verifier, g)
    assert acc.shape == (n, width)
    assert bool((acc.sum(1) <= 1 + 1e-9).all()) and bool((acc >= 0).all())
    return acc.mean(0)


def _monte_carlo(p, q, width, verifier, trials=20000, seed=1):
    """First-accepted-rank frequencies of the real draw_children + verify_tree on a width-W star."""
    V = p.shape[0]
    n = width + 1
    gens = [torch.Generator().manual_seed(seed * 100003 + i) for i in range(trials)]
    qs = q.expand(trials, -1).contiguous()
    kids = draw_children(qs, width, CHILD_RULE[verifier], gens)
    tokens = torch.cat([torch.zeros(trials, 1, dtype=torch.long), kids], dim=1)
    P = p.expand(trials, n, V).contiguous()
    Q = q.expand(trials, n, V).contiguous()
    accepted, _ = verify_tree(verifier, list(Tree.k_chains(width, 1).parents), tokens, P, Q, gens)
    hist = torch.zeros(width + 1, dtype=torch.float64)
    for path in accepted:
        hist[path[0] if path else 0] += 1
    return hist[1:] / trials, hist[0] / trials


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer", "topk"])
@pytest.mark.parametrize("case", list(CASES))
def test_static_expectation_matches_verifier_monte_carlo(case, verifier):
    p, q = CASES[case]
    width = 4
    static = _static_mean(p, q, width, verifier)
    mc, mc_none = _monte_carlo(p, q, width, verifier)
    assert torch.allclose(static, mc, atol=0.02), (static, mc)
    assert abs((1 - static.sum()) - mc_none) < 0.02


def test_one_candidate_is_one_minus_tv():
    p, q = CASES["generic"]
    tv = 0.5 * (p - q).abs().sum()
    for verifier in ("sequoia", "specinfer"):
        assert float(_static_mean(p, q, 1, verifier)[0]) == pytest.approx(float(1 - tv), abs=0.01)


def test_exact_given_children():
    """The recursion by hand: rank 1 = min(1, p/q); rank 2 = (1 − a1) · min(1, p_res/q')."""
    p, q = CASES["generic"]
    x1, x2 = 1, 5  # both have q > p
    got = expected_acceptance(p[None], q[None], torch.tensor([[x1, x2]]), "sequoia")[0]
    a1 = min(1.0, float(p[x1] / q[x1]))
    res = (p - q).clamp(min=0)
    res = res / res.sum()
    q2 = q.clone()
    q2[x1] = 0
    q2 = q2 / q2.sum()
    a2 = min(1.0, float(res[x2] / q2[x2]))
    assert float(got[0]) == pytest.approx(a1, rel=1e-6)
    assert float(got[1]) == pytest.approx((1 - a1) * a2, rel=1e-5)
    # specinfer keeps q: rank 2 uses the original q
    got_si = expected_acceptance(p[None], q[None], torch.tensor([[x1, x2]]), "specinfer")[0]
    assert float(got_si[1]) == pytest.approx((1 - a1) * min(1.0, float(res[x2] / q[x2])), rel=1e-5)


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer"])
def test_q_equals_p_accepts_rank_one(verifier):
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, 50, generator=g) * 2, -1)
    acc = static_acceptance(p, p.clone(), 6, verifier, g)
    assert torch.allclose(acc[:, 0], torch.ones(64, dtype=torch.float64))
    assert float(acc[:, 1:].abs().max()) == 0.0


def test_sums_at_most_one_random():
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(200, 30, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(200, 30, generator=g) * 3, -1)
    q[:50, 5:] = 0  # some drafts with a small support
    q = q / q.sum(-1, keepdim=True)
    for verifier in ("sequoia", "specinfer", "topk"):
        acc = static_acceptance(p, q, 8, verifier, g)
        assert float(acc.sum(1).max()) <= 1 + 1e-6 and float(acc.min()) >= 0
    greedy = static_acceptance(torch.nn.functional.one_hot(p.argmax(-1), 30).float(), q, 8, "greedy", g, rank_by=q)
    assert set(greedy.sum(1).tolist()) <= {0.0, 1.0}


def test_held_out_order_is_the_back_of_evaluation_order():
    import random

    order = list(range(50))
    random.Random(0).shuffle(order)
    assert held_out_order(50) == order[::-1]


def test_dataset_texts_are_held_out_from_build_prompts(tokenizer, monkeypatch):
    from redwood.data import prompts as prompts_mod
    from redwood.data import recipes

    docs = [{"id": f"d{i}", "text": f"doc {i}: " + " ".join(CORPUS[(i + j) % 5] for j in range(3))} for i in range(20)]
    monkeypatch.setattr(recipes, "load_dataset", lambda name, **kw: docs)
    monkeypatch.setattr(prompts_mod, "load_dataset", lambda name, **kw: docs)
    monkeypatch.setattr(recipes, "dataset_kind", lambda name: "prefix")
    monkeypatch.setattr(prompts_mod, "dataset_kind", lambda name: "prefix")
    texts, note = dataset_texts(tokenizer, "c4", 8, 16, 8, static=True)
    assert "back" in note and len(texts) == 8
    assert all(len(t.ids) == 24 and t.context == 16 for t in texts)
    evaluation = {tuple(ids) for ids in prompts_mod.build_prompts(tokenizer, "c4", 12, 16, seed=0)}
    assert len(evaluation) == 12
    assert not evaluation & {tuple(t.ids[:16]) for t in texts}
    dyn, _ = dataset_texts(tokenizer, "c4", 8, 16, 8, static=False)
    assert [t.ids for t in dyn] == [t.ids[:16] for t in texts]


# ------------------------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    """target/ (clear greedy margins, as in the engine tests) and draft/ (target + noise)."""
    root = tmp_path_factory.mktemp("measure-models")
    save_target_and_draft(root, tokenizer, noise=0.05)
    return root


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    lines = [" ".join(CORPUS[(i + j) % 5].replace("\n", " ") for j in range(3)) for i in range(5)]
    path.write_text("\n".join(lines) + "\n\n")
    return path


def _prompts(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("verifier,temperature", [("sequoia", 0.9), ("topk", 0.7), ("greedy", 0.0)])
def test_dynamic_histogram_counts_every_engine_step(pair, verifier, temperature):
    width = 3
    spec = SpeculativeConfig(draft_model=str(pair / "draft"), tree=star_tree_spec(width), verifier=verifier)
    llm = LLM(str(pair / "target"), speculative=spec)
    drafter = llm.drafter
    res = measure_dynamic(llm, _prompts(3, 20), width, temperature, 1.0, gen_len=14, seed=0, batch_size=2)
    assert llm.drafter is drafter  # restored
    assert res.steps == res.engine_steps == sum(s["speculative"]["steps"] for s in res.request_stats)
    assert len(res.request_stats) == 3 and res.generated_tokens == 3 * 14
    assert sum(res.values) + res.p_none == pytest.approx(1.0)
    # accepted children are the SpecStats' accepted tokens
    assert sum(res.counts) == sum(s["speculative"]["accepted"] for s in res.request_stats)
    assert 0 < sum(res.counts) < res.steps  # both accept and reject happen with this pair


def test_dynamic_chain_width_one(pair):
    spec = SpeculativeConfig(draft_model=str(pair / "draft"), tree=star_tree_spec(1), verifier="sequoia")
    llm = LLM(str(pair / "target"), speculative=spec)
    res = measure_dynamic(llm, _prompts(2, 16, seed=2), 1, 1.0, 1.0, gen_len=12, seed=1)
    assert res.steps == res.engine_steps and res.counts[0] + res.none == res.steps


def test_dynamic_cli_writes_valid_vector(pair, prompt_file, tmp_path, capsys):
    out = tmp_path / "dyn.json"
    rc = main(
        [
            "acceptance",
            "--model",
            str(pair / "target"),
            "--draft-model",
            str(pair / "draft"),
            "--width",
            "4",
            "--mode",
            "dynamic",
            "--temperature",
            "0.8",
            "--top-p",
            "0.95",
            "--prompts",
            str(prompt_file),
            "--num-prompts",
            "3",
            "--prompt-len",
            "24",
            "--gen-len",
            "12",
            "--seed",
            "7",
            "--output",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    assert "dynamic acceptance (sequoia, W=4" in capsys.readouterr().out
    vec = load_acceptance(out)
    raw = json.loads(out.read_text())
    assert raw["format"] == "redwood.acceptance/1" and raw["method"] == "dynamic" and raw["width"] == 4
    assert vec.models == {"target": str(pair / "target"), "draft": str(pair / "draft")}
    assert vec.temperature == 0.8 and vec.top_p == 0.95 and vec.dataset == f"file:{prompt_file}"
    assert sum(vec.values) + vec.p_none == pytest.approx(1.0)
    assert vec.samples == sum(vec.notes["counts"]) + vec.notes["none"] > 0
    assert vec.notes["prompts"]["ids"] == ["line 1", "line 2", "line 3"]
    assert vec.notes["generated_tokens"] == 3 * 12


def test_dynamic_draft_equals_target_greedy_accepts_rank_one(pair, prompt_file, tmp_path):
    out = tmp_path / "same.json"
    rc = main(
        [
            "acceptance",
            "--model",
            str(pair / "target"),
            "--draft-model",
            str(pair / "target"),
            "--width",
            "3",
            "--mode",
            "dynamic",
            "--temperature",
            "0",
            "--prompts",
            str(prompt_file),
            "--num-prompts",
            "2",
            "--prompt-len",
            "20",
            "--gen-len",
            "10",
            "--output",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    vec = load_acceptance(out)
    assert vec.notes["verifier"] == "greedy"
    assert vec.values == (1.0, 0.0, 0.0) and vec.p_none == 0.0 and vec.samples > 0


def test_static_cli(pair, prompt_file, tmp_path, capsys):
    out = tmp_path / "static.json"
    rc = main(
        [
            "acceptance",
            "--model",
            str(pair / "target"),
            "--draft-model",
            str(pair / "draft"),
            "--width",
            "4",
            "--mode",
            "static",
            "--temperature",
            "0.6",
            "--prompts",
            str(prompt_file),
            "--num-prompts",
            "4",
            "--prompt-len",
            "30",
            "--gen-len",
            "20",
            "--output",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    vec = load_acceptance(out)
    assert vec.method == "static" and vec.p_none is None and vec.samples == 4 * 20
    assert 0 < vec.values[0] < 1 and sum(vec.values) <= 1
    assert vec.notes["expected_none"] == pytest.approx(1 - sum(vec.values), abs=1e-9)
    # draft == target: p == q at every position, so rank 1 is always accepted
    same = tmp_path / "same.json"
    assert (
        main(
            [
                "acceptance",
                "--model",
                str(pair / "target"),
                "--draft-model",
                str(pair / "target"),
                "--width",
                "2",
                "--mode",
                "static",
                "--temperature",
                "1.0",
                "--prompts",
                str(prompt_file),
                "--num-prompts",
                "2",
                "--prompt-len",
                "30",
                "--gen-len",
                "10",
                "--output",
                str(same),
                "--quiet",
            ]
        )
        == 0
    )
    assert load_acceptance(same).values == (1.0, 0.0)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--width", "0"], "--width"),
        (["--mode", "sideways"], "--mode"),
        (["--verifier", "greedy", "--temperature", "0.5"], "greedy"),
        (["--verifier", "bogus"], "verifier"),
        (["--top-p", "0"], "--top-p"),
        (["--gen-len", "1"], "--gen-len"),
        (["--prompt-len", "500", "--mode", "static"], "context"),
    ],
)
def test_cli_errors_are_one_line(pair, prompt_file, tmp_path, capsys, argv, needle):
    base = {
        "--model": str(pair / "target"),
        "--draft-model": str(pair / "draft"),
        "--width": "2",
        "--mode": "dynamic",
        "--temperature": "0.5",
        "--prompts": str(prompt_file),
        "--output": str(tmp_path / "x.json"),
    }
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    if "--prompt-len" in base:
        long = tmp_path / "long.txt"
        long.write_text(" ".join(CORPUS).replace("\n", " ") + "\n")
        base["--prompts"] = str(long)
    args = ["acceptance", "--quiet"] + [x for kv in base.items() for x in kv]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("redwood: error:") and needle in err
    assert not (tmp_path / "x.json").exists()


def test_cli_missing_prompt_file(pair, tmp_path, capsys):
    rc = main(
        [
            "acceptance",
            "--model",
            str(pair / "target"),
            "--width",
            "2",
            "--mode",
            "static",
            "--temperature",
            "0",
            "--prompts",
            str(tmp_path / "nope.txt"),
            "--output",
            str(tmp_path / "x.json"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no such file" in err


@pytest.mark.parametrize(
    "kv,flags", [("streaming", ["--draft-budget", "8"]), ("snapkv", ["--draft-budget", "8", "--window", "4"])]
)
def test_dynamic_self_speculation_through_a_compressed_cache(kv, flags, pair, prompt_file, tmp_path):
    """--self-speculate --draft-kv: MagicDec's draft (the target over a compressed cache) measured on
    policy; the vector names the cache, so tree-search plans trees for that draft."""
    out = tmp_path / "self.json"
    rc = main(
        [
            "acceptance",
            "--model",
            str(pair / "target"),
            "--self-speculate",
            "--draft-kv",
            kv,
            *flags,
            "--width",
            "2",
            "--mode",
            "dynamic",
            "--temperature",
            "0.7",
            "--prompts",
            str(prompt_file),
            "--num-prompts",
            "2",
            "--prompt-len",
            "24",
            "--gen-len",
            "10",
            "--output",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    vec = load_acceptance(out)
    assert vec.models["draft"].startswith(f"{pair / 'target'} [{kv}(") and vec.notes["draft_kv"] == kv
    assert sum(vec.values) + vec.p_none == pytest.approx(1.0) and vec.samples > 0


def test_self_speculating_llm_measures_with_its_policy(pair):
    spec = SpeculativeConfig(
        self_speculate=True, draft_kv="streaming", draft_budget=8, tree=star_tree_spec(2), verifier="sequoia"
    )
    llm = LLM(str(pair / "target"), speculative=spec)
    assert llm.drafter.policy.name == "streaming"
    res = measure_dynamic(llm, _prompts(2, 20, seed=3), 2, 0.8, 1.0, gen_len=10, seed=2)
    assert res.steps == res.engine_steps > 0 and llm.drafter.policy.name == "streaming"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--self-speculate", "--width", "2", "--mode", "dynamic"], "needs --draft-kv streaming or snapkv"),
        (
            [
                "--self-speculate",
                "--draft-model",
                "x",
                "--draft-kv",
                "streaming",
                "--draft-budget",
                "8",
                "--width",
                "2",
                "--mode",
                "dynamic",
            ],
            "mutually exclusive",
        ),
        (["--draft-kv", "streaming", "--draft-budget", "8", "--width", "2", "--mode", "static"], "--mode dynamic"),
        (["--draft-kv", "lru", "--width", "2", "--mode", "dynamic"], "--draft-kv must be one of"),
    ],
)
def test_draft_cache_errors_are_one_line(argv, needle, pair, prompt_file, tmp_path, capsys):
    rc = main(
        [
            "acceptance",
            "--quiet",
            "--model",
            str(pair / "target"),
            "--temperature",
            "0.5",
            "--prompts",
            str(prompt_file),
            "--output",
            str(tmp_path / "x.json"),
            *argv,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err
    assert not (tmp_path / "x.json").exists()
