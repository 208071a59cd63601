"""Real models: greedy speculation equals greedy autoregressive decoding, token for token (float32, CPU).

Target Qwen2.5-Coder 1.5B-Instruct with the 0.5B-Instruct as standalone draft, and the 1.5B drafting
for itself through a small compressed (StreamingLLM / SnapKV) view of its own cache. Each model is
loaded once per module (the 1.5B takes ~6 GB in float32). If a case ever diverges, the target's top-2
logit gap at the divergence is printed: under ~1e-5 it is a numerical tie (forwards over different
numbers of tokens round differently in the last bits — see DESIGN.md), anything larger is a bug.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.real

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
NEW_TOKENS = 24
TIE_GAP = 1e-5
PROMPTS = [  # two prompts: CPU decoding of the 1.5B runs at a few tokens/s
    "import numpy as np\n\n# compute the mean of each column of a matrix, ignoring NaN values\ndef column_means(m):\n",
    'class Stack:\n    """A last-in first-out stack backed by a Python list."""\n\n    def __init__(self):\n',
]


@pytest.fixture(scope="module")
def target(real_model):
    from redwood import LLM

    real_model(TARGET)  # (pulled when missing; skips only when the registry is unreachable)
    llm = LLM(TARGET, dtype="float32", weights="float32")
    yield llm
    del llm


@pytest.fixture(scope="module")
def draft(real_model):
    from redwood.loading import load_model

    real_model(DRAFT)
    loaded = load_model(DRAFT, dtype="float32")
    yield loaded
    del loaded


@pytest.fixture(scope="module")
def prompt_ids(target):
    ids = [target.encode(p) for p in PROMPTS]
    assert all(len(i) > 16 for i in ids)  # longer than the draft budget (12) below: the views compress
    return ids


@pytest.fixture(scope="module")
def ar_outputs(target, prompt_ids):
    from redwood import SamplingParams

    t = time.perf_counter()
    outs = target.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    print(f"\nAR: {time.perf_counter() - t:.1f}s for {len(PROMPTS)}×{NEW_TOKENS} tokens")
    return [o.token_ids for o in outs]


@torch.inference_mode()
def top2_gap(model, tokens: list[int]) -> tuple[float, list[int]]:
    """The target's gap between its two largest logits after `tokens`, and those two token ids."""
    from redwood.engine.prefill import prefill_batch as prefill

    cache = model.new_cache(1, len(tokens))
    logits = prefill(model, cache, [tokens])[0]
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def check_equal_or_tie(target, prompt_ids, ar_outputs, outputs, label):
    """Each row equals the AR output; a divergence is accepted only at a numerical tie (and reported)."""
    for b, (ar, ours) in enumerate(zip(ar_outputs, outputs)):
        if ours == ar:
            continue
        i = next((j for j, (x, y) in enumerate(zip(ar, ours)) if x != y), min(len(ar), len(ours)))
        gap, top = top2_gap(target.model, prompt_ids[b] + ar[:i])
        print(
            f"{label} row {b}: diverges at generated token {i}: AR {ar[i : i + 1]} vs speculative "
            f"{ours[i : i + 1]}; target top-2 {top}, logit gap {gap:.3g}"
        )
        assert gap < TIE_GAP, f"{label} row {b}: diverges at token {i} with top-2 logit gap {gap:.3g} (not a tie)"


def run_speculative(target, drafter, prompt_ids, gamma):
    from redwood import SamplingParams
    from redwood.speculation.trees import Tree
    from tests.engine.driver import run_engine

    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    t = time.perf_counter()
    _, requests, _ = run_engine(
        target.model, target.tokenizer, prompt_ids, params, drafter=drafter, tree=Tree.chain(gamma), kv_cache_memory=1.0
    )
    elapsed = time.perf_counter() - t
    return [r.output_ids for r in requests], [r.stats.spec.to_dict() for r in requests], elapsed


def test_standalone_draft_greedy_equals_autoregressive(target, draft, prompt_ids, ar_outputs):
    from redwood.kv.policies import make_policy
    from redwood.speculation.drafters import ModelDrafter, check_compatible

    check_compatible(target.tokenizer, draft.tokenizer, target.config.vocab_size, draft.config.vocab_size)
    drafter = ModelDrafter(draft.model, make_policy("full"), target.config.vocab_size)
    outputs, stats, elapsed = run_speculative(target, drafter, prompt_ids, gamma=4)
    print(f"standalone 0.5B draft, γ=4: {elapsed:.1f}s, acceptance {[s['acceptance_rate'] for s in stats]}")
    check_equal_or_tie(target, prompt_ids, ar_outputs, outputs, "standalone")
    assert all(s["acceptance_rate"] > 0.2 for s in stats)  # the 0.5B agrees with the 1.5B on easy code


@pytest.mark.parametrize(
    "policy_name,settings",
    [
        ("streaming", dict(budget=12, sinks=4)),
        ("snapkv", dict(budget=12, window=4)),
    ],
)
def test_self_speculation_greedy_equals_autoregressive(target, prompt_ids, ar_outputs, policy_name, settings):
    from redwood.kv.policies import make_policy
    from redwood.speculation.drafters import SelfDrafter

    drafter = SelfDrafter(target.model, make_policy(policy_name, **settings))
    outputs, stats, elapsed = run_speculative(target, drafter, prompt_ids, gamma=3)
    print(f"self {drafter.policy.describe()}, γ=3: {elapsed:.1f}s, acceptance {[s['acceptance_rate'] for s in stats]}")
    check_equal_or_tie(target, prompt_ids, ar_outputs, outputs, f"self-{policy_name}")
    assert all(s["steps"] > 0 for s in stats)
