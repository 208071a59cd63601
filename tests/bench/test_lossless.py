"""The end-to-end lossless check (`redwood.bench.lossless`) at CPU scale, and proof that it can fail.

The full matrix at 10^6 rows per configuration runs on the GPU (`benchmarks/lossless_bench.py`); here a
few configurations that cover every drafter, KV policy, tree shape and verifier run at 8k rows each,
and a deliberately lossy verifier (a 5% mixture of the draft into the target) must be caught at the same
scale (p < 1e-6 after Holm). (12k rows took 480 s of CI, the slowest test; 8k keeps the power the lossy
case demonstrates.)
"""

from __future__ import annotations

import pytest
import torch

from redwood.bench import lossless as L

GENERATED = 4  # K: 16^3 prefixes to score exactly; three tokens through the verifiers
SAMPLES = 8_000
BATCH = 1000  # rows per generate call (smaller batches run faster per row on the CPU)

CASES = [
    L.Case(L.METHODS["plain"], L.Sampling(0.6, 0.8, 5)),
    L.Case(L.METHODS["control"], L.Sampling(0.6, 0.8, 5)),  # exact draws: no engine
    L.Case(L.METHODS["far-chain3"], L.Sampling(1.0)),
    L.Case(L.METHODS["self-stream-chain3"], L.Sampling(0.6, 0.8)),
    L.Case(L.METHODS["ngram-chain3"], L.Sampling(1.0)),
    L.Case(L.METHODS["suffix-3x2-topk"], L.Sampling(0.6, 0.8)),
    L.Case(L.METHODS["close-g16-sequoia"], L.Sampling(1.5, 1.0, 5)),
    L.Case(L.METHODS["far-wide-topk"], L.Sampling(1.0, 0.8)),
    L.Case(L.METHODS["self-snapkv-g16-specinfer"], L.Sampling(0.6, 0.8, 5)),
    L.Case(L.METHODS["close-chain3-match"], L.Sampling(0.6, 0.8, 5)),
    L.Case(L.METHODS["suffix-3x2-match"], L.Sampling(1.0)),
]


def settings(samples: int = SAMPLES) -> L.Settings:
    return L.Settings(samples=samples, generated=GENERATED, batch=BATCH, device="cpu")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return L.prepare(tmp_path_factory.mktemp("lossless"), settings())


def test_projections_and_batches():
    joint = torch.rand(L.VOCAB**3, dtype=torch.float64)
    cube = joint.view(L.VOCAB, L.VOCAB, L.VOCAB)
    assert torch.allclose(L.marginals(joint, 3)[1], cube.sum(dim=(0, 2)))
    assert torch.allclose(L.adjacent_pairs(joint, 3)[1], cube.sum(dim=0).reshape(-1))
    assert torch.equal(L.adjacent_pairs(joint[: L.VOCAB**2], 2)[0], joint[: L.VOCAB**2])  # nothing summed
    assert L.encode(torch.tensor([[1, 2, 3]])).item() == (1 * L.VOCAB + 2) * L.VOCAB + 3
    assert L.batch_sizes(1_000_000, 4096) == [4000] * 250  # a divisor: one batch shape
    assert L.batch_sizes(10_007, 4096) == [3336, 3336, 3335]  # a prime: near-equal


def test_exact_joint_is_a_distribution_matching_its_marginals(prepared):
    s = L.Sampling(0.6, 0.8, 5)
    joint = L.exact_joint(prepared.levels, s)
    assert joint.shape == (L.VOCAB**GENERATED,)
    assert float(joint.sum()) == pytest.approx(1.0, abs=1e-9)
    first = L.marginals(joint, GENERATED)[0]
    assert torch.allclose(first, L.level_probs(prepared.levels[0], s)[0].double(), atol=1e-7)
    assert int((first > 0).sum()) <= 5  # top-k 5 (and top-p) cut the first token's support
    assert L.near_cut(prepared.levels, s)["mass"] == 0.0  # no cut close enough for rounding to flip


# ------------------------------------------------------------------------------------------ end to end
def test_every_method_follows_the_target_distribution(prepared):
    """Marginals and adjacent pairs of 4 generated tokens, against the exact distribution and against
    plain sampling, no deviation after Holm's correction over all tests."""
    report = L.run_cases(CASES, settings(), prepared, log=lambda line: None)
    table = L.format_table(report)
    assert report["verdict"] == "PASS", table
    for row in report["cases"]:
        assert row["samples"] == SAMPLES
        assert all(t["forbidden"] == 0 for t in row["tests"] if "forbidden" in t), row["case"]
        if row["method"]["draft"] is not None:  # drafts are accepted sometimes, rejected sometimes
            assert 0.02 < row["acceptance_rate"] < 0.95, table
    # the one plain case gives the two-sample reference for its own setting only
    compared = [r["case"] for r in report["cases"] if any(t["test"].startswith("vs plain") for t in r["tests"])]
    assert compared == [c.name for c in CASES[1:] if c.sampling == CASES[0].sampling]
    assert compared[0].startswith("control")


def lossy(real_verify, eps: float):
    """A chain verifier that accepts against (1 − eps)·p + eps·q instead of the target's p (at the drafted
    positions): it emits tokens from that mixture — a small, plausible bug."""

    def verify(target_probs, draft_probs, *args, **kwargs):
        gamma = draft_probs.shape[1]
        biased = target_probs.clone()
        biased[:, :gamma] = (1 - eps) * target_probs[:, :gamma] + eps * draft_probs
        return real_verify(biased, draft_probs, *args, **kwargs)

    return verify


def test_a_lossy_verifier_is_caught(prepared, monkeypatch):
    import redwood.engine.decode as engine_speculative

    monkeypatch.setattr(engine_speculative, "verify_sampling", lossy(engine_speculative.verify_sampling, 0.05))
    case = L.Case(L.METHODS["far-chain3"], L.Sampling(1.0))
    report = L.run_cases([case], settings(SAMPLES), prepared, log=lambda line: None)
    assert report["verdict"] == "FAIL", L.format_table(report)
    assert report["min_p_holm"] < 1e-6
    tests = {t["test"]: t for t in report["cases"][0]["tests"]}
    assert tests["fit marginal t1"]["p_holm"] > 0.01  # the first token comes from the prefill: untouched


def test_plan_switches_every_step_stay_exact(prepared, monkeypatch, tmp_path):
    """The automatic policy's plans (plain steps, draft chains of every γ, ngram chains), switched at every
    step — the most switching it could do — still sample the target distribution exactly."""
    import redwood.speculation.costs_cache as cache
    from tests.engine.test_auto_policy import cycle_plans

    monkeypatch.setattr(cache, "costs_dir", lambda: tmp_path / "costs")
    cycle_plans(monkeypatch, order=[0, 1, 3, 9, 10, 12])  # ar, draft γ1, γ3, ngram γ1, γ2, γ4
    case = L.Case(L.METHODS["close-auto"], L.Sampling(0.6, 0.8))
    report = L.run_cases([case], settings(), prepared, log=lambda line: None)
    assert report["verdict"] == "PASS", L.format_table(report)
    assert 0.02 < report["cases"][0]["acceptance_rate"] < 0.95
