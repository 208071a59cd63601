"""Benchmarks under tensor parallelism (float32, gloo, 2 ranks, a tiny clear-margin model): `Engine.rebuild`
replaces the engine on every rank (plain decoding, then speculation, over one sharded load) and the replaced
engine refuses calls; `Engine.prompt_logits` (a fresh forward every rank joins) equals one process's logits;
`redwood bench throughput --tensor-parallel-size 2` measures AR and speculation — a fresh engine per mode,
repeat and rate — with speculative greedy output identical to AR's and the same tokens per step as one process.
Every subprocess is bounded in time."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from redwood import LLM, SamplingParams
from redwood.engine.prefill import fresh_logits
from tests.parallel.test_generate import MAX_NEW, PROMPTS, _run

REBUILD_SCRIPT = """
import json, sys
from redwood import LLM, SamplingParams
from redwood.errors import ConfigError
from redwood.speculation.config import SpeculativeConfig
target, draft, prompts, max_new = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
llm = LLM(target, tensor_parallel_size=2, speculative=SpeculativeConfig(draft_model=draft, num_draft_tokens=3),
          max_num_seqs=2)
first = llm.engine
llm.engine = first.rebuild(speculate=False, max_num_seqs=3)
ar = [o.token_ids for o in llm.generate(prompts, params)]
try:
    first.step()
    refused = ""
except ConfigError as e:
    refused = str(e)
plain = {"drafter": llm.engine.drafter is None, "max_num_seqs": llm.engine.max_num_seqs}
llm.engine = llm.engine.rebuild(speculate=True, max_num_seqs=2)
spec = [o.token_ids for o in llm.generate(prompts, params)]
logits = llm.engine.prompt_logits(prompts[1]).tolist()
print(json.dumps({"ar": ar, "spec": spec, "refused": refused, "plain": plain, "logits": logits,
                  "steps": llm.engine.num_steps}))
"""


def test_rebuild_swaps_the_engine_on_every_rank_and_prompt_logits_match_one_process(folders, tmp_path):
    target, draft = folders
    one = LLM(str(target), max_num_seqs=2)
    want = [o.token_ids for o in one.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))]
    want_logits = fresh_logits(one.model, PROMPTS[1])
    script = tmp_path / "script.py"  # (no `__main__` guard: the spawned rank must not run it again)
    script.write_text(REBUILD_SCRIPT)
    out = _run([sys.executable, str(script), str(target), str(draft), json.dumps(PROMPTS), str(MAX_NEW)])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ar"] == want and got["spec"] == want  # (the second engine speculated: fewer steps than tokens)
    assert got["steps"] < len(PROMPTS) * MAX_NEW
    assert got["plain"] == {"drafter": True, "max_num_seqs": 3}
    assert "this engine was closed" in got["refused"]
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, rtol=0, atol=1e-4)


def _throughput(target, draft, text_file, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "redwood",
        "bench",
        "throughput",
        "--model",
        str(target),
        "--draft-model",
        str(draft),
        "--gamma",
        "3",
        "--prompts-file",
        str(text_file),
        "--num-requests",
        "4",
        "--prompt-len",
        "16",
        "--min-new-tokens",
        "8",
        "--max-new-tokens",
        "12",
        "--max-num-seqs",
        "2",
        "--block-size",
        "8",
        "--json",
        *extra,
    ]


def test_bench_throughput_tp2_measures_both_modes_like_one_process(folders, tmp_path):
    target, draft = folders
    text_file = tmp_path / "text.txt"
    text_file.write_text(" ".join(f"word{i % 97} and {i}" for i in range(600)))
    one = _run(_throughput(target, draft, text_file), timeout=120, REDWOOD_HOME=str(tmp_path))
    assert one.returncode == 0, one.stderr
    # two rates with prefix caching (a fresh engine per rate) and two repeats: 8 engines, each rebuilt on both ranks
    many = ["--repeats", "2", "--request-rate", "inf", "50", "--enable-prefix-caching"]
    tp = _run(
        _throughput(target, draft, text_file, "--tensor-parallel-size", "2", *many),
        timeout=180,
        REDWOOD_HOME=str(tmp_path),
    )
    assert tp.returncode == 0, tp.stderr
    r1, r2 = json.loads(one.stdout), json.loads(tp.stdout)
    assert r2["all_identical"] is True
    assert [(r["method"], r["request_rate"]) for r in r2["runs"]] == [
        ("ar", 50.0),
        ("spec", 50.0),
        ("ar", "inf"),
        ("spec", "inf"),
    ]
    assert all(len(r["tokens_per_s_repeats"]) == 2 for r in r2["runs"])
    spec1 = next(r for r in r1["runs"] if r["method"] == "spec")
    spec2 = next(r for r in r2["runs"] if r["method"] == "spec" and r["request_rate"] == "inf")
    # greedy over clear margins: the same proposals accepted in the same steps, whatever the ranks
    assert spec2["mean_accepted_length"] == pytest.approx(spec1["mean_accepted_length"])


def _standalone(target, draft, text_file, out_dir, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "redwood",
        "bench",
        "standalone",
        "--model",
        str(target),
        "--draft-model",
        str(draft),
        "--prompts-file",
        str(text_file),
        "--batch-size",
        "2",
        "--prefix-len",
        "16",
        "--gen-len",
        "8",
        "--gamma",
        "2",
        "3",
        "--output",
        str(out_dir),
        *extra,
    ]


def test_bench_standalone_tp2_rebuilds_per_gamma_like_one_process(folders, tmp_path):
    """`bench standalone` at two γ over one sharded load: the AR baseline and each chain rebuilt on both ranks;
    identical to AR (float32) with one process's tokens per step."""
    target, draft = folders
    text_file = tmp_path / "text.txt"
    text_file.write_text(" ".join(f"word{i % 89} or {i}" for i in range(600)))
    one = _run(_standalone(target, draft, text_file, tmp_path / "one"), timeout=120, REDWOOD_HOME=str(tmp_path))
    assert one.returncode == 0, one.stderr
    tp = _run(
        _standalone(target, draft, text_file, tmp_path / "tp", "--tensor-parallel-size", "2"),
        timeout=150,
        REDWOOD_HOME=str(tmp_path),
    )
    assert tp.returncode == 0, tp.stderr
    r1 = json.loads((tmp_path / "one" / "report.json").read_text())
    r2 = json.loads((tmp_path / "tp" / "report.json").read_text())
    assert [r.get("tree") for r in r2["runs"]] == [r.get("tree") for r in r1["runs"]]
    spec = [r for r in r2["runs"] if r.get("tree")]
    assert len(spec) == 2 and all(r["identical_to_ar"] is True for r in spec)
    for a, b in zip(r1["runs"], r2["runs"]):
        assert b.get("mean_accepted_length") == pytest.approx(a.get("mean_accepted_length"))
