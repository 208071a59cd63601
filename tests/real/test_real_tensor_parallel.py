"""The registry's 0.5B sharded over 2 ranks spawned by the test (gloo, float32, its GGUF cut as it is read): the
logits of a prompt and of decode steps over each rank's own KV heads equal one process's within 1e-4 (the bound
`test_real_models.py` holds redwood to against transformers: an all-reduce sums in another order than one matmul),
the same bits on both ranks, and the same greedy token at every position."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_forwards, run_ranks, sharded_checks

pytestmark = pytest.mark.real

PROMPT = "import numpy as np\n\n# compute the mean of each column of a matrix\n"
BOUND = 1e-4


def test_real_05b_sharded_logits_equal_one_process(real_model):
    from redwood.loading import inspect_model, load_model

    path = real_model("qwen2.5-coder-0.5b-instruct")
    ids = inspect_model(path).tokenizer.encode(PROMPT)
    steps = [ids, [ids[-1]], [ids[-2]], [ids[-3]]]  # a prompt, then one token at a time
    ranks = run_ranks(sharded_checks, 2, [(str(path), "float32")], steps, timeout=300)
    whole = run_forwards(load_model(path, weights="float32").model, steps)
    for step, want in enumerate(whole):
        got = torch.from_numpy(ranks[0][str(path)][step])
        assert (got - want).abs().max().item() <= BOUND, step
        assert torch.equal(got.argmax(-1), want.argmax(-1)), step
        assert torch.equal(torch.from_numpy(ranks[1][str(path)][step]), got), step
