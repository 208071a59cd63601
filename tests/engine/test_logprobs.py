"""Per-token outputs of the Engine: logprobs (the target's raw distribution), token sources, text spans.

Tiny random Qwen2-style models on the CPU in float32: a clear-margin target (so greedy speculation
reproduces autoregressive decoding token for token), a noisy copy of it as a standalone draft (accepts
and rejects), and the target's own weights as a second, identical draft (nearly everything accepted).
"""

from __future__ import annotations

import pytest
import torch

from redwood import LLM
from redwood.engine.engine import Engine
from redwood.errors import ConfigError
from redwood.kv.policies import make_policy
from redwood.loading import load_model
from redwood.sampling_params import SamplingParams
from redwood.speculation.drafters import ModelDrafter, SelfDrafter
from redwood.speculation.trees import Tree
from tests.conftest import save_target_and_draft

NEW = 24


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([37, 61, 12])


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """{"target", "draft" (target + N(0, 0.01²)), "twin" (the target's weights, loaded again)} and the
    target folder."""
    root = tmp_path_factory.mktemp("logprob-models")
    save_target_and_draft(root, tokenizer, noise=0.01)
    loaded = {
        name: load_model(root / folder)
        for name, folder in (("target", "target"), ("draft", "draft"), ("twin", "target"))
    }
    return {name: m.model for name, m in loaded.items()}, loaded["target"].tokenizer, root / "target"


def _drafter(kind, models):
    m, _, _ = models
    vocab = m["target"].config.vocab_size
    if kind == "self-streaming":
        return SelfDrafter(m["target"], make_policy("streaming", budget=16, sinks=4))
    return ModelDrafter(m["twin" if kind == "twin" else "draft"], make_policy("full"), vocab)


def _run(models, prompts, params, drafter=None, tree=None, max_num_seqs=None):
    """Run the prompts through one Engine; → per request: {token_ids, sources, logprobs, text, spans,
    deltas, state} gathered from its deltas."""
    m, tok, _ = models
    engine = Engine.build(
        m["target"], tok, drafter=drafter, tree=tree, max_num_seqs=max_num_seqs or len(prompts), block_size=16
    )
    plist = params if isinstance(params, list) else [params] * len(prompts)
    out = {}
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        rid = engine.add_request(p, sp, request_id=f"r{i}")
        out[rid] = dict(
            token_ids=[], sources=[], logprobs=None, text="", spans=[], deltas=[], state=engine._requests[rid].state
        )
    while engine.has_unfinished():
        for d in engine.step():
            r = out[d.request_id]
            assert len(d.sources) == len(d.token_ids)
            assert "".join(t for t, _ in d.spans) == d.text
            r["deltas"].append(d)
            r["token_ids"] += d.token_ids
            r["sources"] += d.sources
            r["text"] += d.text
            r["spans"] += d.spans
            if d.logprobs is not None:
                assert len(d.logprobs) == len(d.token_ids)
                r["logprobs"] = (r["logprobs"] or []) + d.logprobs
    return [out[f"r{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def _reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over prompt + output → [len(output), V]: row j scores output[j]."""
    ids = torch.tensor(prompt + output)[None]
    cache = model.new_cache(1, ids.shape[1])
    cache.live.fill_(1)
    logits = model(ids, torch.arange(ids.shape[1])[None], cache)[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def _assert_logprobs_match(logprobs, output, ref, k):
    assert logprobs is not None and len(logprobs) == len(output) == ref.shape[0]
    for j, (lp, tok) in enumerate(zip(logprobs, output)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[j, tok]), abs=1e-4), f"token {j}"
        assert len(lp.top) == k
        want = ref[j].topk(k)
        assert [t for t, _ in lp.top] == want.indices.tolist(), f"token {j}"
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def _assert_same_logprobs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)


# ------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "5"])
def test_logprobs_must_be_none_or_an_integer_up_to_20(bad):
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20


# ------------------------------------------------------------------------------------- autoregressive


def test_ar_logprobs_are_the_raw_target_distribution_per_row(models):
    """Greedy, sampled with top-k / top-p (logprobs stay raw: temperature 1, no filter), k = 0 / 5 / 20,
    and a request without logprobs, in one batch: each asking row gets log_softmax of a plain forward."""
    m, _, _ = models
    params = [
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=5),
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.7, top_k=8, top_p=0.9, seed=3, logprobs=20),
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=0),
        SamplingParams(max_new_tokens=NEW, ignore_eos=True),
    ]
    prompts = PROMPTS + [PROMPTS[0]]
    runs = _run(models, prompts, params)
    for prompt, sp, r in zip(prompts, params, runs):
        assert r["sources"] == ["target"] * NEW  # autoregressive: every token is the target's own
        if sp.logprobs is None:
            assert r["logprobs"] is None and all(d.logprobs is None for d in r["deltas"])
            continue
        _assert_logprobs_match(
            r["logprobs"], r["token_ids"], _reference_logprobs(m["target"], prompt, r["token_ids"]), sp.logprobs
        )
    assert runs[3]["token_ids"] == runs[0]["token_ids"]  # (the same prompt, greedy, with and without)


def test_a_request_with_logprobs_beside_one_without_gives_both_their_solo_results(models):
    for drafter, tree in ((None, None), (_drafter("draft", models), Tree.chain(3))):
        with_lp = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=4)
        without = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        both = _run(models, PROMPTS[:2], [with_lp, without], drafter, tree)
        alone_with = _run(models, PROMPTS[:1], with_lp, drafter, tree, max_num_seqs=2)[0]
        alone_without = _run(models, PROMPTS[1:2], without, drafter, tree, max_num_seqs=2)[0]
        assert both[0]["token_ids"] == alone_with["token_ids"]
        assert both[1]["token_ids"] == alone_without["token_ids"]
        assert both[1]["logprobs"] is None
        _assert_same_logprobs(both[0]["logprobs"], alone_with["logprobs"])


# ------------------------------------------------------------------------------------- speculative


@pytest.fixture(scope="module")
def ar_reference(models):
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=6)
    return _run(models, PROMPTS, params)


SPEC_CASES = {
    "draft-chain": ("draft", Tree.chain(3)),
    "self-chain": ("self-streaming", Tree.chain(2)),
    "draft-tree": ("draft", Tree.from_branching([2, 2, 1, 1])),
    "self-tree": ("self-streaming", Tree.from_branching([3, 1, 1])),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_logprobs_equal_the_autoregressive_ones(case, models, ar_reference):
    kind, tree = SPEC_CASES[case]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=6)
    runs = _run(models, PROMPTS, params, _drafter(kind, models), tree)
    drafted = 0
    for ar, r in zip(ar_reference, runs):
        assert r["token_ids"] == ar["token_ids"]
        _assert_same_logprobs(r["logprobs"], ar["logprobs"])
        drafted += r["sources"].count("draft")
    assert 0 < drafted < NEW * len(PROMPTS)  # (both accepted drafts and target tokens were scored)


def _assert_sources_follow_the_steps(r, gamma):
    """The prefill's token is the target's; each decoding step emits its accepted drafts, then one target
    token (the last step may be cut short by the length limit); the drafts are the accepted count (less
    the drafts of a last step cut short, < γ)."""
    deltas = r["deltas"]
    assert deltas[0].sources == ["target"]
    for d in deltas[1:-1]:
        assert d.sources == ["draft"] * (len(d.token_ids) - 1) + ["target"]
    last = deltas[-1].sources
    assert last in (["draft"] * (len(last) - 1) + ["target"], ["draft"] * len(last))
    accepted = r["state"].stats.spec.accepted
    drafts = r["sources"].count("draft")
    if r["sources"][-1] == "target":  # no step was cut short
        assert drafts == accepted
    else:
        assert accepted - gamma < drafts <= accepted


def test_sources_mark_accepted_drafts(models):
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    twin = _run(models, PROMPTS, params, _drafter("twin", models), Tree.chain(3))
    for r in twin:
        _assert_sources_follow_the_steps(r, 3)
        assert r["sources"].count("draft") > NEW // 2  # the draft is the target: almost all accepted
    noisy = _run(models, PROMPTS, params, _drafter("draft", models), Tree.from_branching([2, 1, 1]))
    for r in noisy:
        _assert_sources_follow_the_steps(r, 3)


# ------------------------------------------------------------------------------------- text spans


def _char_sources(spans) -> str:
    """Each character's source, one letter per character ("d" / "t")."""
    return "".join(src[0] * len(text) for text, src in spans)


def test_spans_through_the_engine_join_to_the_text_and_keep_each_tokens_source(models):
    """Sampled streams with stop strings (and EOS) over a speculative engine: every delta's spans join to
    its text, all of them to the request's text, and each character carries the source of the token that
    made it — as the same tokens, appended in one go to a fresh RequestState, attribute them."""
    from redwood.engine.request import RequestState

    m, tok, _ = models
    stopped = 0
    for seed in range(5):
        params = [
            SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed * 10 + i, stop=[" the", "e"] if i == 0 else [])
            for i in range(3)
        ]
        runs = _run(models, PROMPTS, params, _drafter("draft", models), Tree.chain(3))
        for sp, r in zip(params, runs):
            state = r["state"]
            assert r["text"] == state.text == "".join(t for t, _ in r["spans"])
            fresh = RequestState(
                prompt_ids=state.prompt_ids,
                params=sp,
                tokenizer=tok,
                eos_ids=state.eos_ids,
                max_new_tokens=state.max_new_tokens,
            )
            for t, src in zip(r["token_ids"], r["sources"]):
                fresh.append(t, src)
            text, spans = fresh.pop_delta_spans()
            assert text == r["text"] and _char_sources(r["spans"]) == _char_sources(spans)
            stopped += state.finish_reason == "stop"
    assert stopped > 0  # (stop strings did cut some texts)


def test_abort_delta_has_empty_per_token_lists(models):
    m, tok, _ = models
    engine = Engine.build(m["target"], tok, max_num_seqs=1, block_size=16)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=NEW, logprobs=2), request_id="a")
    engine.step()
    engine.abort("a")
    (d,) = engine.step()
    assert d.finish_reason == "abort" and d.token_ids == [] and d.sources == [] and d.logprobs == []
    assert "".join(t for t, _ in d.spans) == d.text


def test_llm_passes_logprobs_sources_and_spans_through(models):
    _, _, folder = models
    llm = LLM(str(folder))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    (out,) = llm.generate(PROMPTS[0], params)
    assert len(out.logprobs) == len(out.token_ids) == 12
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    streamed = list(llm.stream(PROMPTS[0], params))
    assert [t for d in streamed for t in d.token_ids] == out.token_ids
    assert [s for d in streamed for s in d.sources] == ["target"] * 12
    assert "".join(t for d in streamed for t, _ in d.spans) == out.text
    _assert_same_logprobs([lp for d in streamed for lp in d.logprobs], out.logprobs)
    (plain,) = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=4))
    assert plain.logprobs is None


# ------------------------------------------------------------------------------------- CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [None, "chain", "tree"])
def test_graphed_steps_give_the_eager_logprobs_and_capture_apart(spec, tiny_model_dir, tiny_draft_dir):
    """On CUDA the logprobs come out of the captured step: the same as eager steps; a step with
    logprobs and one without are different graphs (the flag is in the step's key)."""
    from redwood.speculation.config import SpeculativeConfig

    kwargs = {
        None: None,
        "chain": dict(draft_model=str(tiny_draft_dir), num_draft_tokens=3),
        "tree": dict(self_speculate=True, draft_kv="streaming", sinks=2, window=12, tree="generic-16"),
    }[spec]
    config = None if kwargs is None else SpeculativeConfig(**kwargs)
    graphed = LLM(str(tiny_model_dir), device="cuda", speculative=config)
    eager = LLM(str(tiny_model_dir), device="cuda", speculative=config, cuda_graphs=False)
    params = [
        SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=20),
        SamplingParams(max_new_tokens=16, ignore_eos=True),
    ]
    got, want = graphed.generate(PROMPTS[:2], params), eager.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    _assert_same_logprobs(got[0].logprobs, want[0].logprobs)
    assert got[1].logprobs is None
    plain = graphed.generate(PROMPTS[:2], params[1])  # the same bucket without logprobs: its own graph
    assert [o.token_ids for o in plain] == [o.token_ids for o in want]
    keys = [key for r in graphed.engine.executor.runners.values() for key in r._steps]
    assert {key[4] for key in keys} == {True, False}  # (Executor._decode's key: want_lp is its 5th entry)
