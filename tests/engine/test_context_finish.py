"""A request stopped by the model's context (max_model_len) before max_new_tokens finishes "context", not
"length": in the Engine's last delta, `LLM.generate` and `redwood generate`'s stats line / JSON (the
server's mapping to OpenAI's "length" is tested in tests/serve)."""

from __future__ import annotations

import json

import pytest

from redwood import LLM, Engine, SamplingParams
from redwood.cli import main
from tests.engine.test_engine import MODES, models  # noqa: F401 — (target, draft, tokenizer) fixture


def _finish(models, mode, prompt, max_new_tokens, max_model_len):  # noqa: F811
    """Run one greedy request alone → (tokens, its last delta)."""
    target, draft, tok = models
    drafter, tree = MODES[mode](target, draft)
    engine = Engine.build(
        target, tok, drafter=drafter, tree=tree, max_num_seqs=1, block_size=8, max_model_len=max_model_len
    )
    engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    ids, last = [], None
    while engine.has_unfinished():
        for d in engine.step():
            ids, last = ids + d.token_ids, d
    return ids, last


@pytest.mark.parametrize("mode", ["ar", "chain-draft-full", "tree-self-streaming"])
def test_the_context_filling_first_is_context_not_length(models, mode):  # noqa: F811
    """A 20-token prompt in a 29-token context: asking for 50 tokens gives the 9 that fit, "context";
    asking for exactly 9 or fewer is "length" (max_new_tokens reached, even when the context is full too).
    Speculative steps emit several tokens at once and are cut at the same boundary."""
    prompt = list(range(10, 30))
    ids, last = _finish(models, mode, prompt, 50, 29)
    assert len(ids) == 9 and last.finish_reason == "context"
    assert last.stats["generated_tokens"] == 9
    for asked in (9, 4):
        ids, last = _finish(models, mode, prompt, asked, 29)
        assert len(ids) == asked and last.finish_reason == "length"


def test_llm_generate_reports_context(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=24)
    ids = llm.encode("The quick brown fox")
    assert len(ids) < 20
    out = llm.generate([ids], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "context" and len(ids) + len(out.token_ids) == 24
    assert llm.generate([ids], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_generate_stats_line_and_json_say_context(tiny_model_dir, tokenizer, capsys):
    prompt = "Paris is the capital of France."
    n = len(tokenizer.encode(prompt))
    base = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        prompt,
        "--ignore-eos",
        "--max-model-len",
        str(n + 5),
    ]
    assert main(base + ["--max-new-tokens", "100"]) == 0
    line = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    assert line.startswith("[") and "5 generated (context)" in line
    assert main(base + ["--max-new-tokens", "100", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["finish_reason"] == "context" and len(obj["token_ids"]) == 5
    assert main(base + ["--max-new-tokens", "3"]) == 0  # max_new_tokens first: "length" as before
    assert "3 generated (length)" in capsys.readouterr().out
