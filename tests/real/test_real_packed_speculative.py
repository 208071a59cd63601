"""Real models, the README's main job as it runs on the CPU: the 1.5B target in its packed default (int8),
the 0.5B draft packed int4, γ 3 — greedy speculation emits exactly greedy AR's tokens (no tie allowance:
the packed linears compute each row like a one-row forward and the CPU attention scores each query like
the one-token step, so a verify is bit for bit the AR steps it stands for)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
NEW_TOKENS = 48
PROMPTS = [  # scripts/run.sh's prompt (its answer left AR's at token 6 before the per-query attention)
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that merges two sorted lists into one sorted list.",
]


def test_main_job_greedy_speculation_equals_ar(real_model):
    from redwood import LLM, SamplingParams
    from redwood.config import SpeculativeConfig

    real_model(TARGET)
    real_model(DRAFT)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    spec = LLM(TARGET, speculative=SpeculativeConfig(draft_model=DRAFT, num_draft_tokens=3))
    assert "int4" in spec.draft_name  # (the draft's CPU default)
    ids = [spec.encode(p, chat=True) for p in PROMPTS]
    got = [o.token_ids for o in spec.generate(ids, params)]
    del spec
    ar = LLM(TARGET)
    want = [o.token_ids for o in ar.generate(ids, params)]
    assert got == want
