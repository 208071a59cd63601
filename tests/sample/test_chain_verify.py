"""Chain verifiers: greedy accepts the argmax-matching prefix; rejection sampling preserves the target.

The sampling tests are χ² goodness-of-fit tests over many seeded draws on a tiny vocabulary, with fixed
seeds (so they are deterministic), at a 0.01 % false-positive level per test: ~100 such tests share these
helpers, so the family fails by chance ≤ 1 % of the time when the random streams change. The proof that
the verifiers are exact is `test_verifiers_exact.py` (no sampling noise); these check the same property
through real random streams, batching and the end-to-end engine. Target and draft
distributions go through `redwood.sample.sampler.probabilities`, the same temperature / top-p
processing the engine uses.
"""

from __future__ import annotations

import pytest
import torch

from redwood import SamplingParams
from redwood.bench.stats import chi2_fit_samples, chi2_quantile
from redwood.errors import ConfigError
from redwood.sample.chain_verify import match_tokens, verify_greedy, verify_match, verify_sampling
from redwood.sample.sampler import probabilities
from tests.conftest import random_hf_model, tiny_hf_config

# ------------------------------------------------------------------------------------------- χ² helpers

LEVEL = 0.9999  # the χ² quantile a statistic must stay below (false alarms 1e-4 per test)


def chi2_fit(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float, int]:
    """χ² statistic of integer `samples` (cell indices) against cell probabilities `probs`.

    Cells of probability exactly 0 must never be observed (asserted). Cells expecting fewer than
    `min_expected` draws are pooled into one bin (`redwood.bench.stats.pooled_cells`). Returns
    (statistic, the LEVEL quantile, df).
    """
    fit = chi2_fit_samples(samples, probs, min_expected)
    assert fit["forbidden"] == 0, f"drew cells of probability 0: {fit['forbidden_cells']}"
    assert fit["df"] >= 1
    return fit["stat"], chi2_quantile(fit["df"], LEVEL), fit["df"]


def assert_fits(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    stat, limit, df = chi2_fit(samples, probs)
    assert stat < limit, f"{what}: χ² = {stat:.1f} > {limit:.1f} (df {df}) — the distribution is not preserved"


# ------------------------------------------------------------------------------------------- greedy


def one_hot_rows(best: list[list[int]], V: int = 10) -> torch.Tensor:
    """[B, γ+1, V] probabilities whose argmax at each position is `best`."""
    t = torch.tensor(best)
    return torch.nn.functional.one_hot(t, V).float()


@pytest.mark.parametrize(
    "best,drafts,accepted,nxt",
    [
        ([[3, 4, 5, 6]], [[3, 4, 5]], 3, 6),  # all accepted: the bonus token is the target's last argmax
        ([[3, 4, 5, 6]], [[3, 4, 9]], 2, 5),  # first mismatch at position 2: correction = target's argmax there
        ([[3, 4, 5, 6]], [[7, 4, 5]], 0, 3),  # later matches after a mismatch do not count
        ([[3, 4, 5, 6]], [[3, 8, 5]], 1, 4),
        ([[1, 2]], [[1]], 1, 2),  # γ = 1
        ([[1, 2]], [[0]], 0, 1),
    ],
)
def test_verify_greedy_cases(best, drafts, accepted, nxt):
    a, n = verify_greedy(one_hot_rows(best), torch.tensor(drafts))
    assert a.tolist() == [accepted] and n.tolist() == [nxt]


def test_verify_greedy_batch_rows_independent_and_uses_argmax():
    # Soft (not one-hot) probabilities: only the argmax matters.
    p = torch.tensor(
        [
            [[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]],
            [[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]],
            [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]],
        ]
    )
    drafts = torch.tensor([[1, 0], [1, 2], [2, 2]])
    a, n = verify_greedy(p, drafts)
    assert a.tolist() == [2, 1, 0]
    assert n.tolist() == [2, 0, 0]


# ------------------------------------------------------------------------------------------- match


def test_verify_match_accepts_the_prefix_equal_to_the_targets_own_draws():
    """y_i = inverse_cdf(p_i, u_i): p [2, 4, 3] with known cumulative sums, so the uniforms pick known tokens."""
    p = torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.5, 0.5], [0.2, 0.2, 0.6], [1.0, 0.0, 0.0]]).expand(2, -1, -1)
    u = torch.tensor([[0.1, 0.6, 0.45, 0.99], [0.8, 0.2, 0.1, 0.0]], dtype=torch.float64)
    y = match_tokens(p, u)
    assert y.tolist() == [[0, 2, 2, 0], [2, 1, 0, 0]]
    drafts = torch.tensor([[0, 2, 1], [2, 1, 0]])
    a, nxt = verify_match(p, drafts, u)
    assert a.tolist() == [2, 3] and nxt.tolist() == [2, 0]  # row 0: y_2 corrects d_3; row 1: the bonus y_3
    a, nxt = verify_match(p, torch.tensor([[1, 2, 2], [2, 1, 1]]), u)
    assert a.tolist() == [0, 2] and nxt.tolist() == [0, 0]


def test_verify_match_at_temperature_zero_is_verify_greedy():
    """One-hot rows (greedy requests): every uniform draws the argmax, so match == greedy for any drafts."""
    g = torch.Generator().manual_seed(1)
    B, gamma, V = 64, 3, 7
    logits = torch.randn(B * (gamma + 1), V, generator=g)
    zeros = torch.zeros(B * (gamma + 1))
    p = probabilities(logits, zeros, zeros.long(), zeros + 1).view(B, gamma + 1, V)
    best = p.argmax(-1)
    drafts = torch.where(
        torch.rand(B, gamma, generator=g) < 0.7, best[:, :-1], torch.randint(0, V, (B, gamma), generator=g)
    )
    u = torch.rand(B, gamma + 1, generator=g, dtype=torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(verify_match(p, drafts, u), verify_greedy(p, drafts)))


def test_verify_match_emits_the_autoregressive_draws_whatever_the_drafts():
    """Position-dependent p (a row per prefix): with the same uniforms per position, every draft chain
    emits a prefix of the one sequence that drawing token by token (autoregressive sampling) gives."""
    import itertools

    V, gamma = 3, 3
    g = torch.Generator().manual_seed(4)
    table = {
        pre: torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
        for d in range(gamma + 1)
        for pre in itertools.product(range(V), repeat=d)
    }
    u = torch.rand(1, gamma + 1, generator=g, dtype=torch.float64)
    ar = ()
    for i in range(gamma + 1):  # autoregressive: one inverse-CDF draw per position
        ar += (int(match_tokens(table[ar][None, None], u[:, i : i + 1])),)
    lengths = set()
    for d in itertools.product(range(V), repeat=gamma):
        p = torch.stack([table[d[:i]] for i in range(gamma + 1)])[None]
        a, nxt = verify_match(p, torch.tensor([d]), u)
        emitted = d[: int(a)] + (int(nxt),)
        assert emitted == ar[: len(emitted)], (d, emitted, ar)
        lengths.add(len(emitted))
    assert lengths == {1, 2, 3, 4}


# ------------------------------------------------------------------------------------------- sampling

V = 6


def make_dists(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    n = logits.shape[0]
    return probabilities(
        logits, torch.full((n,), temperature), torch.zeros(n, dtype=torch.long), torch.full((n,), top_p)
    )


def draft_logits(kind: str, target_logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Draft logits per position: unrelated, adversarial (mass where the target has least), or the
    target's own (always accepted → exercises the bonus token)."""
    noise = torch.randn(target_logits.shape, generator=gen)
    if kind == "random":
        return noise * 1.5
    if kind == "adversarial":  # concentrated on the tokens the target gives little mass
        return -3.0 * target_logits + 0.3 * noise
    if kind == "disjoint":  # nearly all mass on the target's least likely token
        out = torch.full_like(target_logits, -8.0) + 0.1 * noise
        out.scatter_(1, target_logits.argmin(1, keepdim=True), 4.0)
        return out
    if kind == "same":
        return target_logits.clone()
    raise ValueError(kind)


def simulate(
    P: torch.Tensor, Q: torch.Tensor, gamma: int, rows: int, n_tokens: int, seed: int, verifier=verify_sampling
) -> torch.Tensor:
    """Run the draft → verify loop for `rows` independent sequences until each emitted `n_tokens`.

    The synthetic target is context-free: the distribution of the k-th emitted token is P[k]
    whatever came before (and the draft proposes from Q[k]), so a lossless verifier emits tokens
    distributed as independent P[0], P[1], … Every row has its own verifier generator (reused
    across steps, as in the engine). Returns tokens [rows, n_tokens].
    """
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(rows)]
    draft_gen = torch.Generator().manual_seed(seed)
    out = torch.full((rows, n_tokens + gamma + 1), -1, dtype=torch.long)
    n = torch.zeros(rows, dtype=torch.long)
    while bool((n < n_tokens).any()):
        act = (n < n_tokens).nonzero().flatten()
        A = act.numel()
        pos = n[act, None] + torch.arange(gamma + 1)  # [A, γ+1] output positions this step scores
        p, q = P[pos], Q[pos[:, :-1]]  # [A, γ+1, V], [A, γ, V]
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=draft_gen).view(A, gamma)
        accepted, nxt = verifier(p, q, drafts, [gens[i] for i in act.tolist()])
        assert ((accepted >= 0) & (accepted <= gamma)).all()
        emitted = torch.cat([drafts, nxt[:, None]], dim=1)
        emitted[torch.arange(A), accepted] = nxt  # d_1 … d_a, then the correction / bonus token
        for j in range(gamma + 1):
            m = j <= accepted
            out[act[m], n[act[m]] + j] = emitted[m, j]
        n[act] += accepted + 1
    return out[:, :n_tokens]


def sampling_case(temperature, top_p, kind, gamma, seed, rows=5000, n_tokens=3, verifier=verify_sampling):
    gen = torch.Generator().manual_seed(seed)
    K = n_tokens + gamma + 1
    target_logits = torch.randn(K, V, generator=gen) * 1.5
    P = make_dists(target_logits, temperature, top_p)
    Q = make_dists(draft_logits(kind, target_logits, gen), temperature, top_p)
    tokens = simulate(P, Q, gamma, rows, n_tokens, seed, verifier)
    return P, Q, tokens


CASES = [
    (t, top_p, kind, gamma)
    for (t, top_p) in [(0.5, 1.0), (1.0, 1.0), (1.5, 1.0), (1.0, 0.9)]
    for kind, gamma in [("random", 2), ("adversarial", 3), ("disjoint", 2)]
] + [(1.0, 1.0, "same", 1), (0.5, 0.9, "same", 2)]


@pytest.mark.parametrize("temperature,top_p,kind,gamma", CASES)
def test_verify_sampling_preserves_target_distribution(temperature, top_p, kind, gamma):
    seed = 1000 + CASES.index((temperature, top_p, kind, gamma))
    P, Q, tokens = sampling_case(temperature, top_p, kind, gamma, seed)
    if kind != "same":
        # The case is a real test: the draft is far from the target at the first position.
        assert 0.5 * (P[0] - Q[0]).abs().sum() > 0.2
    first, second, third = tokens[:, 0], tokens[:, 1], tokens[:, 2]
    label = f"T={temperature} top_p={top_p} draft={kind} γ={gamma}"
    assert_fits(first, P[0], f"{label}: first emitted token")
    # Joint of the first two emitted tokens (the second may be an accepted draft, a correction, a bonus
    # token or come from the next step): independent P[0] × P[1] in this context-free setup.
    assert_fits(first * V + second, torch.outer(P[0], P[1]), f"{label}: first two emitted tokens")
    assert_fits(third, P[2], f"{label}: third emitted token")


def test_verify_sampling_same_draft_accepts_everything():
    """q = p: every draft is accepted (u < 1 always) and the bonus comes from p at position γ+1."""
    gen = torch.Generator().manual_seed(3)
    p = make_dists(torch.randn(4, V, generator=gen), 1.0, 1.0)[None].expand(500, -1, -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, V), 1, generator=gen).view(500, 3)
    gens = [torch.Generator().manual_seed(i) for i in range(500)]
    accepted, nxt = verify_sampling(p, p[:, :3], drafts, gens)
    assert (accepted == 3).all()
    assert_fits(nxt, p[0, 3], "bonus token")


def test_verify_sampling_rejects_tokens_outside_target_support():
    """A draft token the target gives 0 probability (top-p cut) is always rejected; the correction then
    comes from the residual, which never puts mass where the target has none."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]]).expand(200, -1, -1)
    q = torch.tensor([[[0.0, 0.1, 0.9, 0.0]]]).expand(200, -1, -1)
    drafts = torch.full((200, 1), 2)
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    accepted, nxt = verify_sampling(p, q, drafts, gens)
    assert (accepted == 0).all()
    assert set(nxt.tolist()) <= {0, 1}
    # residual = max(p − q, 0) = [0.5, 0.4, 0, 0] → normalized [5/9, 4/9]
    assert_fits(nxt, torch.tensor([5 / 9, 4 / 9, 0.0, 0.0]), "residual")


def test_verify_sampling_reproducible_per_row_generator():
    gen = torch.Generator().manual_seed(4)
    p = make_dists(torch.randn(3 * 4, V, generator=gen), 1.0, 1.0).view(3, 4, V)
    q = make_dists(torch.randn(3 * 3, V, generator=gen), 1.0, 1.0).view(3, 3, V)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(3, 3)

    def run(order):
        gens = [torch.Generator().manual_seed(100 + i) for i in order]
        a, n = verify_sampling(p[order], q[order], drafts[order], gens)
        return {i: (int(x), int(y)) for i, x, y in zip(order, a, n)}

    assert run([0, 1, 2]) == run([0, 1, 2]) == run([2, 0, 1])
    assert run([1]) == {1: run([0, 1, 2])[1]}


def test_chi2_test_detects_a_lossy_verifier():
    """Control: a verifier that accepts whatever the target can emit (ignoring q) follows the draft, and
    the same χ² test rejects it — the fit tests above have power."""

    def lossy(p, q, drafts, gens):
        return verify_sampling(p, torch.zeros_like(q), drafts, gens)  # q = 0 → accept whenever p(d) > 0

    P, _, tokens = sampling_case(1.0, 1.0, "random", 2, seed=7, rows=2000, verifier=lossy)
    stat, limit, _ = chi2_fit(tokens[:, 0], P[0])
    assert stat > 10 * limit


# ------------------------------------------------------------------------------------------- end to end

VOCAB = 8
PROMPT = [1, 5, 3, 6, 0]


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    """A vocab-8 target and a different vocab-8 standalone draft (no tokenizers: token-id prompts)."""
    root = tmp_path_factory.mktemp("vocab8")
    for name, seed in (("target", 11), ("draft", 12)):
        config = tiny_hf_config("llama", vocab_size=VOCAB, eos_token_id=2, bos_token_id=0)
        random_hf_model(config, seed=seed).save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def tiny_vocab_llm(tiny_vocab_pair):
    from redwood import LLM
    from redwood.speculation.config import SpeculativeConfig

    target, draft = tiny_vocab_pair
    return LLM(str(target), speculative=SpeculativeConfig(draft_model=str(draft), num_draft_tokens=3))


@torch.inference_mode()
def exact_pair_distribution(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V]: the autoregressive probability of each (first, second) generated token pair."""
    ids = torch.tensor([prompt + [t] for t in range(VOCAB)])  # [V, len + 1]
    cache = model.new_cache(VOCAB, ids.shape[1])
    logits = model(ids, torch.arange(ids.shape[1])[None].expand(VOCAB, -1), cache)  # [V, len+1, V]

    def probs(x):
        n = x.shape[0]
        return probabilities(
            x, torch.full((n,), params.temperature), torch.full((n,), params.top_k), torch.full((n,), params.top_p)
        )

    p1 = probs(logits[:1, -2])[0]  # after the prompt
    p2 = probs(logits[:, -1])  # [V, V]: after prompt + [t1]
    return p1[:, None] * p2


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_end_to_end_first_two_tokens_follow_target(tiny_vocab_llm, temperature, top_p):
    """LLM(..., speculative=standalone draft): the first two generated tokens over 3,000 seeds follow the
    target's exact autoregressive joint distribution (64 pairs). The second token is the first one that
    goes through the verifier (the first comes from the prefill)."""
    llm = tiny_vocab_llm
    rows = 3000
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_new_tokens=2, ignore_eos=True)
        for s in range(rows)
    ]
    outs = llm.generate([PROMPT] * rows, params)
    pairs = torch.tensor([o.token_ids for o in outs])
    assert pairs.shape == (rows, 2)
    exact = exact_pair_distribution(llm.model, PROMPT, params[0])
    # The draft really differs from the target (not a trivial pass).
    stats = [o.stats["speculative"] for o in outs]
    acceptance = sum(s["accepted"] for s in stats) / sum(s["drafted"] for s in stats)
    assert 0.0 < acceptance < 0.9
    assert_fits(pairs[:, 0] * VOCAB + pairs[:, 1], exact, f"T={temperature} top_p={top_p}: token pairs")


def test_greedy_verifier_with_sampled_request_is_an_error(tiny_vocab_pair):
    from redwood import LLM
    from redwood.speculation.config import SpeculativeConfig

    target, draft = tiny_vocab_pair
    llm = LLM(str(target), speculative=SpeculativeConfig(draft_model=str(draft), verifier="greedy"))
    with pytest.raises(ConfigError, match="greedy verifier"):
        llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=1, max_new_tokens=4))
    # One sampled row in an otherwise greedy batch is enough to refuse.
    with pytest.raises(ConfigError, match="greedy verifier"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_new_tokens=4), SamplingParams(temperature=0.5)])
    # Greedy requests are fine with it.
    out = llm.generate([PROMPT], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
