"""The sharded forward on 2 ranks spawned by the test (gloo, float32): the collectives give known sums and
gathers, and the sharded model's logits equal the whole model's (prefill, then decode steps over the rank's own
KV heads) within float tolerance — an all-reduce sums in another order than one process's matmul — and are the
same bits on every rank (what the lockstep engine relies on)."""

from __future__ import annotations

import torch

from tests.parallel.ranks import run_forwards, run_ranks, sharded_checks

STEPS = [[5, 17, 3, 99, 42, 7, 250, 11], [64], [8], [300]]  # a prompt, then one token at a time


def test_collectives_and_sharded_logits_equal_the_whole_models(tmp_path):
    from redwood.loading import load_model
    from tests.conftest import random_hf_model, tiny_hf_config

    # llama: o_proj / MLP biases (rank 0 adds them), an uneven vocabulary (the gather pads), 2 KV heads over 2 ranks
    cfg = tiny_hf_config("llama", vocab_size=321, attention_bias=True, mlp_bias=True)
    random_hf_model(cfg).save_pretrained(tmp_path / "llama")
    # qwen2: q/k/v biases, tied embeddings (the vocab-parallel head is the embedding's rows), 1 KV head over 2
    # ranks (replicated)
    cfg = tiny_hf_config("qwen2", num_key_value_heads=1, tie_word_embeddings=True)
    random_hf_model(cfg, seed=2).save_pretrained(tmp_path / "qwen")
    folders = [str(tmp_path / "llama"), str(tmp_path / "qwen")]
    ranks = run_ranks(sharded_checks, 2, folders, STEPS, timeout=90)

    for rank, got in enumerate(r["collectives"] for r in ranks):
        assert torch.equal(torch.from_numpy(got["reduced"]), torch.full((2, 3), 3.0)), rank  # 1 + 2
        gathered = torch.from_numpy(got["gathered"])
        assert torch.equal(gathered, torch.tensor([[0.0, 0.0, 1.0]] * 2)), rank  # rank 0's 2, rank 1's 1
        assert got["obj"] == {"from": 0}, rank

    for folder in folders:
        whole = run_forwards(load_model(folder).model, STEPS)
        for step, want in enumerate(whole):
            got = torch.from_numpy(ranks[0][folder][step])
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{folder} step {step}")
            assert torch.equal(torch.from_numpy(ranks[1][folder][step]), got), f"{folder} step {step}"
