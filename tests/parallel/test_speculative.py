"""Greedy speculation (and seeded sampling) under tensor parallelism equals one process's, token for token, for every drafter × KV
policy × tree shape here, under continuous batching (requests joining while others run): 2 and 4 ranks spawned by
the test (gloo, float32), each running the same Engine calls over its shards (the lockstep the rank-0 driver
reproduces, `engine.tp_worker`), on the conftest's clear-margin target and its noisy copy as the draft."""

from __future__ import annotations

import pytest

from redwood.loading import load_model
from tests.parallel.ranks import engine_tokens, run_ranks, sharded_engine_tokens

MODES = [
    "ar",
    "chain-draft-full",
    "chain-draft-replicated",  # (the draft whole on every rank; draft_tensor_parallel="replicate")
    "chain-self-streaming",
    "chain-self-snapkv",
    "tree-self-streaming",
    "tree-draft-full",
    # the draft on rank 0 alone (draft_tensor_parallel=1): rank 1 skips the draft levels; with SnapKV its prefills
    # still run one row at a time, as rank 0's observed ones do
    "chain-draft-subset",
    "chain-draft-subset-snapkv",
    # seeded sampling: a request's draws depend on its seed and positions only, so the ranks (and TP=1) agree
    "ar-seeded",
    "chain-draft-full-seeded",
    "chain-draft-replicated-seeded",  # (rank 0's draft distributions broadcast with its tokens)
    "chain-draft-subset-seeded",
    # rejection sampling: the draft's children and the verifier's numbers come from each row's counter, so rank 0's
    # counters are broadcast with its tokens (rank 1 drew nothing while rank 0 drafted)
    "chain-draft-subset-sampling",
]
PROMPTS = [[5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 1, 33], [250, 11, 64], [7, 7, 7, 7, 7, 7, 7, 9], [31, 41, 59, 26, 5]]
ARRIVALS = [0, 0, 2, 5]  # (2 slots: the later ones join as the first finish)
MAX_NEW = 14


@pytest.mark.parametrize(
    "world, modes",
    [
        (2, MODES),
        # 4 ranks: one query head each, the 2 KV heads replicated on 2 ranks each; the draft sharded over ranks 0, 1
        # alone (draft_tensor_parallel=2: its all-reduces in their sub-group)
        (4, ["ar", "chain-self-snapkv", "tree-draft-full", "chain-draft-subset", "tree-draft-subset"]),
    ],
)
def test_greedy_speculation_under_tensor_parallelism_equals_one_process(folders, world, modes):
    target, draft = map(str, folders)  # (the ranks load them by name)
    t, d = load_model(target).model, load_model(draft, weights="float32").model
    want = {mode: engine_tokens(t, d, mode, PROMPTS, ARRIVALS, MAX_NEW) for mode in modes}
    ranks = run_ranks(sharded_engine_tokens, world, target, draft, modes, PROMPTS, ARRIVALS, MAX_NEW, timeout=120)
    for rank, got in enumerate(ranks):
        for mode in modes:
            assert got[mode] == want[mode], (rank, mode)
