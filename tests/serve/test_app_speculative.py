"""The server with speculation on — a standalone draft model, self-speculation, and the draftless ngram and
suffix drafters — gives the same
greedy text as offline autoregressive `LLM.generate`, reports its acceptance in the `redwood` extension
(whole and streamed, with token spans from both sources) and counts it in the vLLM-named metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from redwood import LLM, SamplingParams
from tests.serve.conftest import MODEL_NAME
from tests.serve.test_engine_loop import metric

PROMPTS = ["The quick brown fox", "def add(a, b):"]
N = 32


@pytest.fixture(scope="module", params=["draft", "self", "ngram", "suffix"])
def spec_server(request, serve_factory, tiny_draft_dir):
    flags = {
        "draft": ["--draft-model", str(tiny_draft_dir), "--gamma", "3"],
        "self": ["--self-speculate", "--draft-kv", "streaming", "--draft-budget", "12", "--sinks", "2", "--gamma", "3"],
        "ngram": ["--draft", "ngram", "--ngram-min", "1", "--gamma", "3"],  # (draftless: prompt lookup)
        "suffix": ["--draft", "suffix", "--ngram-min", "1", "--tree", "chains:3x1"],  # (draftless: a tree)
    }[request.param]
    return serve_factory(*flags)


def test_speculative_server_matches_offline_autoregressive(spec_server, tiny_model_dir):
    want = LLM(str(tiny_model_dir)).generate(PROMPTS, SamplingParams(max_new_tokens=N, ignore_eos=True))
    url = spec_server.url
    for prompt, w in zip(PROMPTS, want):
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": N,
            "temperature": 0,
            "ignore_eos": True,
            "redwood": {"stats": True},
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["text"] == w.text
        stats = r["redwood"]
        assert stats["drafted"] > 0 and stats["steps"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
        assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"], abs=1e-4)
        assert stats["mean_accepted_length"] == pytest.approx(
            (stats["accepted"] + stats["steps"]) / stats["steps"], abs=1e-4
        )
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == w.text
        # each chunk's spans partition its text; the last chunk carries the request's stats
        for c in chunks:
            assert "".join(t for t, _ in c["redwood"]["spans"]) == c["choices"][0]["text"]
        sources = {src for c in chunks for _, src in c["redwood"]["spans"]}
        assert sources <= {"draft", "target"} and "target" in sources
        assert chunks[-1]["redwood"]["drafted"] == stats["drafted"]
    m = httpx.get(url + "/metrics", timeout=10).text
    drafts, tokens, accepted = (
        metric(m, f"spec_decode_num_{k}_total") for k in ("drafts", "draft_tokens", "accepted_tokens")
    )
    # (γ 3 per step, fewer on a greedy request's last steps: cut to the tokens it can still emit)
    assert drafts > 0 and drafts <= tokens <= 3 * drafts and 0 <= accepted <= tokens
    assert metric(m, "spec_decode_num_accepted_tokens_per_pos_total") == accepted  # (summed over positions)
    assert 'position="0"' in m


def test_auto_policy_server_matches_offline_autoregressive_and_counts_its_plans(
    tiny_model_dir, tiny_draft_dir, tmp_path
):
    """`redwood serve --speculative auto`: greedy text equal to offline AR's; /metrics counts the plans the
    finished requests ran and shows the policy's live acceptance of the draftless drafter."""
    from tests.serve.conftest import MODEL_NAME as NAME
    from tests.serve.server_process import start_server

    want = LLM(str(tiny_model_dir)).generate(PROMPTS * 3, SamplingParams(max_new_tokens=N, ignore_eos=True))
    flags = ["--model", str(tiny_model_dir), "--served-model-name", NAME, "--speculative", "auto"]
    server = start_server(flags + ["--draft-model", str(tiny_draft_dir)], env={"REDWOOD_HOME": str(tmp_path)})
    try:
        for prompt, w in zip(PROMPTS * 3, want):
            body = {"model": NAME, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            assert r["choices"][0]["text"] == w.text
        m = httpx.get(server.url + "/metrics", timeout=10).text
        spec = httpx.get(server.url + "/speculation", timeout=10).json()
    finally:
        server.stop(timeout=30)
    plans = [line for line in m.splitlines() if line.startswith("redwood:spec_decode_plan_steps_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in plans) >= 6 * (N - 1) // 9  # (≥ one step per 9 tokens)
    assert any('plan="ar"' in line for line in plans)
    assert 'drafter="ngram@t0"' in m
    assert list((tmp_path / "costs").glob("*.json"))  # the calibration went to the server's REDWOOD_HOME
    # /speculation: the policy's report, its plan counts those /metrics counted
    assert spec["policy"] == "auto"
    report = spec["report"]
    assert sum(report["plans"].values()) > 0 and "ar" in report["plans"]
    assert report["expected_tokens_per_step"] >= 1.0 and report["achieved_tokens_per_step"] >= 1.0
    for key, ratio in report["measured_over_predicted"].items():  # "family@bucket" → a positive ratio
        family, bucket = key.rsplit("@", 1)
        assert family and int(bucket) >= 1 and ratio > 0
    assert report["steps_measured"]
    for key, got in report["steps_measured"].items():  # "plan@bucket" → the timed steps of a plan that ran
        plan, bucket = key.rsplit("@", 1)
        assert plan in report["plans"] and int(bucket) >= 1 and 1 <= got["steps"] <= report["plans"][plan]
        assert got["ms"] > 0 and got["tokens_per_row"] >= 1.0
