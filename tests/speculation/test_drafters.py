"""Drafters (redwood.speculation.drafters): the coupled child rule for the match verifier.

A coupled draft proposes inverse_cdf(q, u) with the uniform the target draws its own token at that
position with, so a draft whose q equals the target's p proposes exactly the target's token: self-
speculation over the full cache (the target drafting for itself) is then accepted at every position —
which holds only if every drafted node reads the uniform of the right absolute position.
"""

from __future__ import annotations

import pytest

from redwood import SamplingParams
from redwood.kv.policies import FullPolicy
from redwood.speculation.drafters import SelfDrafter
from redwood.speculation.trees import Tree, resolve_tree
from tests.engine.driver import run_engine
from tests.engine.test_engine import _prompts, models  # noqa: F401 — the (target, draft, tokenizer) fixture


@pytest.mark.parametrize("tree", ["chain:3", "chains:2x3"])
def test_coupled_drafts_from_the_target_itself_are_always_accepted(models, tree):
    target, _, tok = models
    prompts = _prompts(3, seed=3, hi=40)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3)]
    shape = Tree.chain(3) if tree == "chain:3" else resolve_tree(tree)
    _, ar, _ = run_engine(target, tok, prompts, params)
    _, states, _ = run_engine(
        target, tok, prompts, params, drafter=SelfDrafter(target, FullPolicy()), tree=shape, verifier="match"
    )
    assert [s.output_ids for s in states] == [s.output_ids for s in ar]
    for s in states:  # every draft level of every step accepted (the first token comes from the prefill)
        spec = s.stats.spec
        assert spec.accepted == spec.steps * (shape.max_depth - 1) > 0, (spec.accepted, spec.steps)
