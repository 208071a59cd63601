"""The autoregressive engine: batch rows are independent, greedy equals HF, stops, streaming, errors."""

from __future__ import annotations

import pytest
import torch

from redwood import SamplingParams
from redwood.errors import ConfigError, ContextLengthError
from redwood.models.hf_compat import to_hf_model

PROMPTS = [[5, 17, 42, 99, 7], [11, 3], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_greedy_matches_hf_generate(tiny_llm):
    hf = to_hf_model(tiny_llm.model)
    for p in PROMPTS:
        ours = tiny_llm.generate([p], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert ours.token_ids == ref


def test_ragged_batch_equals_each_row_alone(tiny_llm):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    batch = tiny_llm.generate(PROMPTS, params)
    for p, out in zip(PROMPTS, batch):
        assert out.token_ids == tiny_llm.generate([p], params)[0].token_ids


def test_seeded_sampling_reproducible_and_batch_independent(tiny_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=16, ignore_eos=True)
    a = tiny_llm.generate(PROMPTS, params)
    b = tiny_llm.generate(PROMPTS, params)
    alone = tiny_llm.generate([PROMPTS[1]], params)[0]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[1].token_ids == alone.token_ids
    other_seed = tiny_llm.generate(
        PROMPTS, SamplingParams(temperature=0.9, seed=99, max_new_tokens=16, ignore_eos=True)
    )
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in a]


def test_rows_finish_independently(tiny_llm):
    """Per-row max_new_tokens: a row that stops early does not stop (or change) the others."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 20, 9)]
    outs = tiny_llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [3, 20, 9]
    assert all(o.finish_reason == "length" for o in outs)
    long_alone = tiny_llm.generate([PROMPTS[1]], params[1])[0]
    assert outs[1].token_ids == long_alone.token_ids


def test_eos_stops_a_row(tiny_llm):
    """Declare a token the free run produces an EOS: that row ends right at it, the other runs on."""
    from tests.engine.driver import run_engine

    free = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0].token_ids

    def configure(reqs):
        reqs[0].eos_ids = frozenset({free[3]})
        reqs[1].eos_ids = frozenset()

    _, reqs, _ = run_engine(
        tiny_llm.model,
        tiny_llm.tokenizer,
        [PROMPTS[0], PROMPTS[1]],
        SamplingParams(max_new_tokens=30),
        configure=configure,
    )
    assert reqs[0].output_ids == free[: free.index(free[3]) + 1] and reqs[0].finish_reason == "stop"
    assert len(reqs[1].output_ids) == 30 and reqs[1].finish_reason == "length"


def test_stop_string_truncates_text(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=40, ignore_eos=True)
    full = tiny_llm.generate(["The quick brown"], params)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = tiny_llm.generate(
        ["The quick brown"], SamplingParams(temperature=1.0, seed=7, max_new_tokens=40, ignore_eos=True, stop=(stop,))
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text


def test_stream_concatenates_to_generate(tiny_llm):
    params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=25, ignore_eos=True, stop=("zz",))
    prompts = ["def add(a, b):", "Paris is"]
    outs = tiny_llm.generate(prompts, params)
    texts, ids, finals = ["", ""], [[], []], [None, None]
    for d in tiny_llm.stream(prompts, params):
        texts[d.index] += d.text
        ids[d.index] += d.token_ids
        if d.finish_reason:
            finals[d.index] = d.stats
    assert texts == [o.text for o in outs]
    assert ids == [o.token_ids for o in outs]
    assert all(f is not None and f["generated_tokens"] == len(i) for f, i in zip(finals, ids))


def test_chat_template_applied(tiny_llm):
    ids = tiny_llm.encode("hello", chat=True)
    text = tiny_llm.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nhello<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_stats_reported(tiny_llm):
    out = tiny_llm.generate(["Paris is"], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert out.stats["generated_tokens"] == 8 and out.stats["prompt_tokens"] == len(out.prompt_token_ids)
    assert out.stats["prefill_s"] > 0 and out.stats["decode_tokens_per_s"] > 0


def test_context_limits(tiny_llm):
    ctx = tiny_llm.config.max_position_embeddings
    with pytest.raises(ContextLengthError, match="context"):
        tiny_llm.generate([[1] * ctx], SamplingParams(max_new_tokens=4))
    # A prompt that fits but leaves less room than asked: generation stops at the context, "context".
    out = tiny_llm.generate([[1] * (ctx - 5)], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "context"


def test_bad_inputs(tiny_llm):
    with pytest.raises(ContextLengthError, match="outside the vocabulary"):
        tiny_llm.generate([[tiny_llm.config.vocab_size + 3]])
    with pytest.raises(ConfigError, match="SamplingParams for"):
        tiny_llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ConfigError, match="no prompts"):
        tiny_llm.generate([])
    with pytest.raises(ContextLengthError, match="empty"):
        tiny_llm.generate([[]])


@torch.inference_mode()
def test_chunked_prefill_equals_one_forward(tiny_llm, monkeypatch):
    """Ragged prompts prefilled in 256-token chunks give the same last-token logits and cache as one
    forward (rows end in different chunks; padding never leaks into a row)."""
    import redwood.engine.prefill as gen

    model = tiny_llm.model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (700, 255, 513)]
    whole = model.new_cache(3, 800)
    monkeypatch.setattr(gen, "PREFILL_SCORE_BUDGET", 1 << 40)
    expected = gen.prefill_batch(model, whole, prompts)
    monkeypatch.setattr(gen, "PREFILL_SCORE_BUDGET", 1)  # → the minimum chunk, 256 tokens
    assert gen.prefill_chunk(3, model.config.num_heads, 700) == 256
    chunked = model.new_cache(3, 800)
    logits = gen.prefill_batch(model, chunked, prompts)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert chunked.lengths.tolist() == [700, 255, 513]
    for b, n in enumerate((700, 255, 513)):
        torch.testing.assert_close(chunked.k[:, b, :, :n], whole.k[:, b, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(chunked.v[:, b, :, :n], whole.v[:, b, :, :n], rtol=1e-4, atol=1e-5)
