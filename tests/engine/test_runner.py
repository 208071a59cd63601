"""Step runners: eager forwards on the CPU; on CUDA, captured graphs that replay exactly the eager steps."""

from __future__ import annotations

import pytest
import torch

from redwood import LLM, SamplingParams
from redwood.config import ExecutionConfig
from redwood.engine.runner import StepRunner
from redwood.errors import ConfigError
from redwood.speculation.config import SpeculativeConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [list(range(5, 60)), [11, 3, 4], list(range(100, 130))]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)


def test_engine_runners_are_eager_on_the_cpu(tiny_llm):
    tiny_llm.generate(PROMPTS, GREEDY)
    runners = list(tiny_llm.engine.executor.runners.values())
    assert runners and not any(r.use_graphs for r in runners)
    # one runner per batch bucket, over the first rows of the engine's cache
    assert all(r.cache.k is tiny_llm.engine.cache.k for r in runners)


@torch.inference_mode()
def test_eager_runner_is_the_model_forward(tiny_llm):
    model = tiny_llm.model
    runner = StepRunner(model, model.new_cache(2, 32), use_graphs=False)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    pos = torch.arange(3)[None].expand(2, -1)
    expected = model(ids, pos, model.new_cache(2, 32))
    torch.testing.assert_close(runner.forward(ids, pos), expected)


def test_cuda_graphs_need_cuda(tiny_model_dir):
    with pytest.raises(ConfigError, match="cuda_graphs"):
        LLM(str(tiny_model_dir), cuda_graphs=True)


# ---------------------------------------------------------------------------------------------- CUDA only
def _outputs(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@cuda
def test_graphed_autoregressive_matches_eager_and_reuses_graphs(tiny_model_dir):
    eager = LLM(str(tiny_model_dir), device="cuda", cuda_graphs=False)
    eager.model.set_execution(ExecutionConfig(attention="reference"))
    graphed = LLM(str(tiny_model_dir), device="cuda")
    assert _outputs(graphed, PROMPTS, GREEDY) == _outputs(eager, PROMPTS, GREEDY)
    captures = {key: r.captures for key, r in graphed.engine.executor.runners.items()}
    assert captures and all(n == 1 for n in captures.values())  # one step graph per batch bucket
    # A second generation reuses the runners and their graphs, and still matches.
    again = [p[::-1] for p in PROMPTS]
    assert _outputs(graphed, again, GREEDY) == _outputs(eager, again, GREEDY)
    assert all(graphed.engine.executor.runners[key].captures == 1 for key in captures)


SPECS = {
    "self-streaming-chain": dict(self_speculate=True, draft_kv="streaming", sinks=2, window=12),
    "self-snapkv-chain": dict(self_speculate=True, draft_kv="snapkv", draft_budget=16, window=4),
    "self-streaming-tree": dict(self_speculate=True, draft_kv="streaming", sinks=2, window=12, tree="generic-16"),
    "draft-full-tree": dict(tree="generic-16"),
    "draft-snapkv-chain": dict(draft_kv="snapkv", draft_budget=16, window=4, num_draft_tokens=3),
    "draft-int8-chain": dict(num_draft_tokens=3, draft_weights="int8"),  # int8 draft weights: outputs unchanged
}


@cuda
@pytest.mark.parametrize(
    "name,pdl",
    [(name, "0") for name in SPECS]
    + [("self-streaming-chain", "1"), ("draft-int8-chain", "1"), ("draft-full-tree", "1")],
)
def test_graphed_speculation_is_exact_and_replays_eager(name, pdl, tiny_model_dir, tiny_draft_dir, monkeypatch):
    """pdl "1": the graphs' Triton kernels use programmatic dependent launch (redwood.kernels.pdl; on
    GPUs of compute capability >= 9) — the same outputs."""
    from redwood.kernels import pdl as pdl_launches

    monkeypatch.setattr(pdl_launches, "_requested", [pdl == "1"])
    kwargs = dict(SPECS[name])
    if not kwargs.get("self_speculate"):
        kwargs["draft_model"] = str(tiny_draft_dir)
    spec = SpeculativeConfig(**kwargs)
    ar = LLM(str(tiny_model_dir), device="cuda", cuda_graphs=False)
    ar.model.set_execution(ExecutionConfig(attention="reference"))
    graphed = LLM(str(tiny_model_dir), device="cuda", speculative=spec)
    eager = LLM(str(tiny_model_dir), device="cuda", speculative=spec, cuda_graphs=False)
    # float32 greedy: the target's own output, token for token
    assert _outputs(graphed, PROMPTS, GREEDY) == _outputs(ar, PROMPTS, GREEDY)
    # graphs replay the same kernels as the eager steps: seeded sampling is identical
    assert _outputs(graphed, PROMPTS, SAMPLED) == _outputs(eager, PROMPTS, SAMPLED)
    # other batch sizes and back (SnapKV reallocates its selection buffers; graphs must not read stale ones)
    for prompts in (PROMPTS[:2], [p[::-1] for p in PROMPTS]):
        assert _outputs(graphed, prompts, GREEDY) == _outputs(ar, prompts, GREEDY)


@cuda
def test_offloaded_target_runs_eager_while_its_draft_model_is_graphed(tiny_model_dir, tiny_draft_dir):
    spec = SpeculativeConfig(draft_model=str(tiny_draft_dir), num_draft_tokens=3)
    ar = LLM(str(tiny_model_dir), device="cuda", cuda_graphs=False)
    ar.model.set_execution(ExecutionConfig(attention="reference"))
    offloaded = LLM(str(tiny_model_dir), device="cuda", speculative=spec, offload=True)
    assert _outputs(offloaded, PROMPTS, GREEDY) == _outputs(ar, PROMPTS, GREEDY)
    runners = offloaded.engine.executor.runners
    # the offloaded target runs eagerly; the draft model's forwards are graphed
    assert all(not r.use_graphs for (role, _), r in runners.items() if role == "target")
    drafts = [r for (role, _), r in runners.items() if role == "draft"]
    assert drafts and all(r.use_graphs and r.captures > 0 for r in drafts)


@cuda
def test_graphed_plans_switching_every_step_are_exact(tiny_model_dir, tiny_draft_dir, monkeypatch, tmp_path):
    """The automatic policy's plans switched at every step under CUDA graphs (one captured step per plan and
    bucket; the ngram buffer and the draft's catch-up between them): greedy == AR, and the graphs replay what
    eager steps compute (seeded sampling identical)."""
    import redwood.speculation.costs_cache as cache
    from tests.engine.test_auto_policy import cycle_plans

    monkeypatch.setattr(cache, "costs_dir", lambda: tmp_path / "costs")
    cycle_plans(monkeypatch, order=[0, 1, 3, 9, 10, 12])  # ar, draft γ1, γ3, ngram γ1, γ2, γ4
    spec = SpeculativeConfig(draft_model=str(tiny_draft_dir), policy="auto", ngram_min=1)
    ar = LLM(str(tiny_model_dir), device="cuda", cuda_graphs=False)
    ar.model.set_execution(ExecutionConfig(attention="reference"))
    graphed = LLM(str(tiny_model_dir), device="cuda", speculative=spec)
    eager = LLM(str(tiny_model_dir), device="cuda", speculative=spec, cuda_graphs=False)
    assert _outputs(graphed, PROMPTS, GREEDY) == _outputs(ar, PROMPTS, GREEDY)
    assert _outputs(graphed, PROMPTS, SAMPLED) == _outputs(eager, PROMPTS, SAMPLED)
