"""Real registry models (pulled by the `real_model` fixture when missing): logits and greedy generations
equal HF transformers'.

The reference is transformers loading the same GGUF file with its own GGUF reader and dequantizer, so
these tests also cross-check redwood's GGUF loading (Q/K un-permutation for llama-architecture files).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.real

PROMPTS = [
    "def fibonacci(n):",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of each column of a matrix\n",
]


def _load_both(name: str, real_model):
    import transformers

    from redwood import LLM

    path = real_model(name)  # (pulled when missing; skips only when the registry is unreachable)
    llm = LLM(name, weights="float32")  # HF runs the dequantized float32 weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return llm, hf


@pytest.fixture(scope="module")
def qwen05(real_model):
    llm, hf = _load_both("qwen2.5-coder-0.5b-instruct", real_model)
    yield llm, hf
    del llm, hf


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_logits_match_hf_from_gguf(name, request, real_model):
    llm, hf = request.getfixturevalue("qwen05") if name.startswith("qwen") else _load_both(name, real_model)
    ids = llm.encode(PROMPTS[2])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    cache = llm.model.new_cache(1, len(ids))
    ours = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_generation_matches_hf_qwen05(qwen05):
    from redwood import SamplingParams

    llm, hf = qwen05
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([llm.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
        assert out.token_ids == ref, f"prompt {prompt!r}"
    assert len(set(tuple(o.token_ids) for o in outs)) == len(PROMPTS)


def test_chat_generation_qwen05(qwen05):
    """The chat template comes from the GGUF; the instruct model answers and stops on its own EOS."""
    from redwood import SamplingParams

    llm, _ = qwen05
    out = llm.generate(["What is 2 + 3? Answer with one number."], SamplingParams(max_new_tokens=40), chat=True)[0]
    assert "5" in out.text and out.finish_reason == "stop"
