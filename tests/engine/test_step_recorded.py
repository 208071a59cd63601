"""Engine.step against a recording: the same deltas — tokens, text, token sources, finish reasons, step by
step — as the Engine produced before its step became schedule → execute → update (recorded from commit
b84a76f by `python -m tests.engine.test_step_recorded OUT.json` run over that tree's src/).

The workload mixes what a step can meet: AR, a draft model's chain (full and streaming KV) and tree, self-
speculation chains over streaming and SnapKV views and a self tree; ragged prompts arriving at different
steps, greedy and seeded sampled requests, a stop string, two aborts, and a pool small enough to preempt.
Tiny models with clear logit margins (the conftest's), so rounding on another CPU cannot flip a token.
Timings are left out.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture

RECORDING = Path(__file__).with_name("recorded_workload.json")

MODES = [
    "ar",
    "chain-draft-full",
    "chain-draft-streaming",
    "tree-draft-full",
    "chain-self-streaming",
    "chain-self-snapkv",
    "tree-self-streaming",
]


def _drafter(mode, target, draft):
    from redwood.kv.policies import FullPolicy, SnapKVPolicy, StreamingPolicy
    from redwood.speculation.drafters import ModelDrafter, SelfDrafter
    from redwood.speculation.trees import Tree, resolve_tree

    return {
        "ar": lambda: (None, None),
        "chain-draft-full": lambda: (ModelDrafter(draft, FullPolicy(), 320), Tree.chain(3)),
        "chain-draft-streaming": lambda: (ModelDrafter(draft, StreamingPolicy(4, 12), 320), Tree.chain(4)),
        "tree-draft-full": lambda: (ModelDrafter(draft, FullPolicy(), 320), resolve_tree("chains:2x3")),
        "chain-self-streaming": lambda: (SelfDrafter(target, StreamingPolicy(2, 10)), Tree.chain(3)),
        "chain-self-snapkv": lambda: (SelfDrafter(target, SnapKVPolicy(16, window=4)), Tree.chain(3)),
        "tree-self-streaming": lambda: (SelfDrafter(target, StreamingPolicy(2, 10)), resolve_tree("generic-16")),
    }[mode]()


def run_workload(target, draft, tokenizer, mode: str) -> dict:
    """→ {"deltas": [[step, request id, token ids, text, sources, finish reason], …] for every delta of the
    run, "preempted": how many times the scheduler preempted a request}."""
    from redwood import Engine, SamplingParams

    rng = random.Random(7)
    n = 7
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(n)]
    prompts[3] = "def add(a, b):\n    return a + b\n"  # (text: the stop string below can match)
    params = []
    for i in range(n):
        sampled = i % 3 == 1
        params.append(
            SamplingParams(
                max_new_tokens=rng.randrange(4, 28),
                ignore_eos=i != 4,
                temperature=0.8 if sampled else 0.0,
                seed=100 + i if sampled else None,
                stop=("w\r",) if i == 3 else (),
            )
        )
    arrivals = sorted(rng.randrange(0, 12) for _ in range(n))
    aborts = {2: arrivals[2] + 2, 5: arrivals[5] + 1}
    c = target.config
    per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 8 * 4
    if draft is not None and mode.startswith(("chain-draft", "tree-draft")):
        d = draft.config
        per_block += 2 * d.num_layers * d.num_kv_heads * d.head_dim * 8 * 4
    drafter, tree = _drafter(mode, target, draft)
    engine = Engine.build(
        target,
        tokenizer,
        drafter=drafter,
        tree=tree,
        max_num_seqs=3,
        block_size=8,
        max_num_batched_tokens=16,
        kv_cache_memory=(14 + 1) * per_block / 2**30,
        sampling_noise="counter",  # (the recording's sampled tokens were drawn from the counter streams)
    )
    preempted = [0]
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        preempted[0] += len(out.preempted)
        return out

    engine.scheduler.schedule = counting
    ids = [f"r{i}" for i in range(n)]
    out, step, done = [], 0, set()
    while len(done) < n:
        for i in range(n):
            if arrivals[i] == step:
                engine.add_request(prompts[i], params[i], request_id=ids[i])
        for i, at in aborts.items():
            if at == step and ids[i] not in done:
                engine.abort(ids[i])
        for d in engine.step():
            out.append([step, d.request_id, list(d.token_ids), d.text, list(d.sources), d.finish_reason])
            if d.finish_reason is not None:
                done.add(d.request_id)
        step += 1
        assert step < 500, "the workload did not finish"
    return {"deltas": out, "preempted": preempted[0]}


@pytest.mark.parametrize("mode", MODES)
def test_step_matches_the_recording(models, mode):
    want = json.loads(RECORDING.read_text())[mode]
    got = json.loads(json.dumps(run_workload(*models, mode)))  # (tuples → lists, as recorded)
    # the first differing delta named in full (a rare, unreproduced mismatch of tree-draft-full in session 32's CI
    # printed only pytest's truncated diff)
    first = next((i for i, (g, w) in enumerate(zip(got["deltas"], want["deltas"])) if g != w), None)
    assert first is None, f"delta {first}: got {got['deltas'][first]}, recorded {want['deltas'][first]}"
    assert got == want


def test_the_recording_covers_preemption_aborts_stops_and_both_sources():
    rec = json.loads(RECORDING.read_text())
    assert set(rec) == set(MODES)
    for mode, run in rec.items():
        assert {d[5] for d in run["deltas"]} >= {"abort", "stop", "length"}, mode
        assert run["preempted"] > 0, f"{mode}: the pool was not small enough to preempt"
        assert (mode == "ar") != any("draft" in d[4] for d in run["deltas"]), mode


if __name__ == "__main__":  # record: python -m tests.engine.test_step_recorded OUT.json
    import torch

    from tests.conftest import make_tokenizer

    torch.set_num_threads(1)
    import tempfile

    from redwood import LLM
    from tests.conftest import save_target_and_draft

    with tempfile.TemporaryDirectory() as tmp:
        tok = make_tokenizer()
        save_target_and_draft(Path(tmp), tok, noise=0.01)
        target, draft = LLM(str(Path(tmp) / "target")), LLM(str(Path(tmp) / "draft"))
        rec = {m: run_workload(target.model, draft.model, target.tokenizer, m) for m in MODES}
    Path(sys.argv[1]).write_text(json.dumps(rec, indent=None))
