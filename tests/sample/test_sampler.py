"""Sampling distributions: temperature / top-k / top-p against a direct reference; draws follow them."""

from __future__ import annotations

import pytest
import torch

from redwood.sample.sampler import Sampler, probabilities, token_logprobs
from redwood.sampling_params import SamplingParams


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row, written the obvious way: sort, cut to k, cut to the top-p nucleus, renormalize."""
    if temperature == 0:
        out = torch.zeros_like(logits)
        out[logits.argmax()] = 1
        return out
    p = (logits / temperature).softmax(-1)
    order = p.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    p_k = torch.zeros_like(p)
    p_k[order] = p[order]
    p_k /= p_k.sum()
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += float(p_k[i])
        if mass >= top_p:
            break
    out = torch.zeros_like(p)
    out[kept] = p_k[kept]
    return out / out.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (1.5, 0, 0.9),
        (1.0, 5, 1.0),
        (0.7, 10, 0.8),
        (0.0, 0, 1.0),
        (2.0, 3, 0.5),
    ],
)
def test_probabilities_match_reference(temperature, top_k, top_p):
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 3
    n = logits.shape[0]
    probs = probabilities(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))
    for row in range(n):
        assert torch.allclose(probs[row], reference_probs(logits[row], temperature, top_k, top_p), atol=1e-6)


def test_mixed_rows_use_their_own_parameters():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(1))
    settings = [(0.0, 0, 1.0), (1.0, 4, 1.0), (0.8, 0, 0.7)]
    probs = probabilities(
        logits,
        torch.tensor([s[0] for s in settings]),
        torch.tensor([s[1] for s in settings]),
        torch.tensor([s[2] for s in settings]),
    )
    for row, (t, k, p) in enumerate(settings):
        assert torch.allclose(probs[row], reference_probs(logits[row], t, k, p), atol=1e-6)


@pytest.mark.parametrize("noise", ["position", "counter"])
def test_draws_follow_the_distribution(noise):
    """χ² goodness of fit of 5,000 draws against `probabilities` (top-k 6, T 0.8): successive draws of
    the counter stream, or the draws at positions 0 … 4,999."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.8, top_k=6, seed=5)
    sampler = Sampler([params], torch.device("cpu"), noise)
    expected = sampler.probs(logits)[0]
    n = 5000
    draws = torch.stack([sampler.sample(logits, torch.tensor([i]))[0] for i in range(n)])
    counts = torch.bincount(draws, minlength=12).float()
    support = expected > 0
    exp_counts = expected[support] * n
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    assert counts[~support].sum() == 0
    assert chi2 < 20.5  # 99.9% quantile of χ² with 5 degrees of freedom


def test_sampling_params_validation():
    from redwood.errors import ConfigError

    for kwargs, msg in [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("vocab", [7, 300])
def test_token_logprobs_are_log_softmax_with_the_20_best(vocab):
    """Raw logprobs of given tokens and the min(20, V) most likely tokens, descending, from [B, A, V]
    logits of any scale (float32 log-softmax: no overflow at large logits)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 4, vocab, generator=g) * 30 + 500
    tokens = torch.randint(0, vocab, (3, 4), generator=g)
    chosen, top_v, top_i = token_logprobs(logits, tokens)
    ref = torch.log_softmax(logits.double(), -1)
    k = min(20, vocab)
    assert chosen.shape == (3, 4) and top_v.shape == top_i.shape == (3, 4, k)
    torch.testing.assert_close(chosen.double(), ref.gather(-1, tokens[..., None])[..., 0], atol=1e-4, rtol=0)
    want = ref.topk(k, dim=-1)
    assert torch.equal(top_i, want.indices)
    torch.testing.assert_close(top_v.double(), want.values, atol=1e-4, rtol=0)
    assert bool((top_v[..., :-1] >= top_v[..., 1:]).all())
