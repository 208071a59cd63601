"""Step runners: eager forwards on the CPU; on CUDA, captured graphs that replay exactly the eager steps."""

from __future__ import annotations

import pytest
import torch

from redwood import LLM, SamplingParams
from redwood.config import SpeculativeConfig
from redwood.engine.runner import CAPACITY_STEP, RunnerPool, StepRunner
from redwood.errors import ConfigError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [list(range(5, 60)), [11, 3, 4], list(range(100, 130))]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)


def test_pool_without_graphs_gives_fresh_exact_caches(tiny_llm):
    pool = RunnerPool(use_graphs=True)  # on the CPU graphs are off whatever the setting
    a = pool.get("target", tiny_llm.model, 2, 40)
    b = pool.get("target", tiny_llm.model, 2, 40)
    assert a.cache is not b.cache and a.cache.capacity == 40 and not a.use_graphs


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
    eager.model.attention_backend = "reference"
    graphed = LLM(str(tiny_model_dir), device="cuda")
    assert _outputs(graphed, PROMPTS, GREEDY) == _outputs(eager, PROMPTS, GREEDY)
    (runner,) = graphed.runners.runners()
    assert runner.captures == 1 and runner.cache.capacity % CAPACITY_STEP == 0
    # A second generation reuses the cache and its graph, and still matches.
    again = [p[::-1] for p in PROMPTS]
    assert _outputs(graphed, again, GREEDY) == _outputs(eager, again, GREEDY)
    assert runner.captures == 1


SPECS = {
    "self-streaming-chain": dict(self_speculate=True, draft_kv="streaming", sinks=2, window=12),
    "self-snapkv-chain": dict(self_speculate=True, draft_kv="snapkv", draft_budget=16, window=4),
    "self-streaming-tree": dict(self_speculate=True, draft_kv="streaming", sinks=2, window=12, tree="generic-16"),
    "draft-full-tree": dict(tree="generic-16"),
    "draft-snapkv-chain": dict(draft_kv="snapkv", draft_budget=16, window=4, num_draft_tokens=3),
    "draft-int8-chain": dict(num_draft_tokens=3, draft_quant="int8"),  # int8 draft weights: outputs unchanged
}


@cuda
@pytest.mark.parametrize("name,pdl", [(name, "0") for name in SPECS]
                         + [("self-streaming-chain", "1"), ("draft-int8-chain", "1"), ("draft-full-tree", "1")])
def test_graphed_speculation_is_exact_and_replays_eager(name, pdl, tiny_model_dir, tiny_draft_dir, monkeypatch):
    """pdl "1": the graphs' Triton kernels use programmatic dependent launch (redwood.kernels.pdl; on
    GPUs of compute capability >= 9) — the same outputs."""
    monkeypatch.setenv("REDWOOD_PDL", pdl)
    kwargs = dict(SPECS[name])
    if not kwargs.get("self_speculate"):
        kwargs["draft_model"] = str(tiny_draft_dir)
    spec = SpeculativeConfig(**kwargs)
    ar = LLM(str(tiny_model_dir), device="cuda", cuda_graphs=False)
    ar.model.attention_backend = "reference"
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
    ar.model.attention_backend = "reference"
    offloaded = LLM(str(tiny_model_dir), device="cuda", speculative=spec, offload=True)
    assert _outputs(offloaded, PROMPTS, GREEDY) == _outputs(ar, PROMPTS, GREEDY)
    pooled = offloaded.runners.runners()
    # the offloaded target gets a fresh eager runner per call (nothing to keep); the draft's is pooled
    assert [r.model for r in pooled] == [offloaded.drafter.model]
    assert pooled[0].use_graphs and pooled[0].captures > 0
