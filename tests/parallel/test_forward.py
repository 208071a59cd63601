"""The sharded forward on 2 ranks spawned by the test (gloo, float32): the collectives give known sums and
gathers, and the sharded model's logits equal the whole model's (prefill, then decode steps over the rank's own
KV heads) within float tolerance — an all-reduce sums in another order than one process's matmul."""

from __future__ import annotations

import torch

from tests.parallel.ranks import collective_pieces, run_forwards, run_ranks, sharded_logits

STEPS = [[5, 17, 3, 99, 42, 7, 250, 11], [64], [8], [300]]  # a prompt, then one token at a time


def test_collectives():
    for rank, got in enumerate(run_ranks(collective_pieces, 2, timeout=60)):
        assert torch.equal(torch.from_numpy(got["reduced"]), torch.full((2, 3), 3.0)), rank  # 1 + 2
        gathered = torch.from_numpy(got["gathered"])
        assert torch.equal(gathered, torch.tensor([[0.0, 0.0, 1.0]] * 2)), rank  # rank 0's 2, rank 1's 1
        assert got["obj"] == {"from": 0}, rank


def test_sharded_logits_equal_the_whole_models(tmp_path):
    from redwood.loading import load_model
    from tests.conftest import random_hf_model, tiny_hf_config

    # o_proj / MLP biases (rank 0 adds them), an uneven vocabulary (the gather pads), 2 KV heads over 2 ranks
    cfg = tiny_hf_config("llama", vocab_size=321, attention_bias=True, mlp_bias=True)
    random_hf_model(cfg).save_pretrained(tmp_path / "llama")
    # Qwen2: q/k/v biases, tied embeddings (the vocab-parallel head is the embedding's rows), 1 KV head over 2
    # ranks (replicated)
    cfg = tiny_hf_config("qwen2", num_key_value_heads=1, tie_word_embeddings=True)
    random_hf_model(cfg, seed=2).save_pretrained(tmp_path / "qwen")
    for name in ("llama", "qwen"):
        whole = run_forwards(load_model(tmp_path / name).model, STEPS)
        ranks = run_ranks(sharded_logits, 2, str(tmp_path / name), STEPS, timeout=90)
        for step, want in enumerate(whole):
            got = torch.from_numpy(ranks[0][step])
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name} step {step}")
            # every rank holds the same bits (the lockstep engine's premise: each rank samples the same tokens)
            assert torch.equal(torch.from_numpy(ranks[1][step]), got), f"{name} step {step}"
