"""The sharded forward on 2 ranks spawned by the test (gloo): the collectives give known sums and gathers, and the
sharded model's logits equal the whole model's (prefill, then decode steps over the rank's own KV heads) within
float tolerance — an all-reduce sums in another order than one process's matmul — and are the same bits on every
rank (what the lockstep engine relies on). Float32 models, and a kquant GGUF (the file's blocks cut per rank)
within its int8 activations' rounding."""

from __future__ import annotations

import torch

from redwood.cpu_kernels import kquant
from tests.models.test_cpu_kquant import write_mixed
from tests.parallel.ranks import model_info, run_forwards, run_ranks, sharded_checks
from tests.parallel.test_shard import kq_types_that_shard

STEPS = [[5, 17, 3, 99, 42, 7, 250, 11], [64], [8], [290]]  # a prompt, then one token at a time
# kquant logits at TP=2 vs TP=1, relative (norm): each is ~3% from the float model of the file's values
# (tests/models/test_cpu_kquant.py bounds that at 5%)
KQUANT_BOUND = 0.05


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
    models = [(str(tmp_path / "llama"), "float32"), (str(tmp_path / "qwen"), "float32")]
    if not kquant.why_unavailable():
        # kquant: the file's Q4_K / Q6_K blocks cut per rank, the packed head's rows gathered, the C++ layer aside
        kq = write_mixed(tmp_path / "kq.gguf", "qwen2", seed=6, types=kq_types_that_shard())
        models.append((str(kq), "kquant"))
    ranks = run_ranks(sharded_checks, 2, models, STEPS, timeout=90)

    for rank, got in enumerate(r["collectives"] for r in ranks):
        assert torch.equal(torch.from_numpy(got["reduced"]), torch.full((2, 3), 3.0)), rank  # 1 + 2
        gathered = torch.from_numpy(got["gathered"])
        assert torch.equal(gathered, torch.tensor([[0.0, 0.0, 1.0]] * 2)), rank  # rank 0's 2, rank 1's 1
        assert got["obj"] == {"from": 0}, rank

    for path, weights in models:
        whole = run_forwards(load_model(model_info(path), weights=weights).model, STEPS)
        exact = run_forwards(load_model(model_info(path), weights="float32").model, STEPS)  # (the file's values)
        for step, want in enumerate(whole):
            got = torch.from_numpy(ranks[0][path][step])
            assert got.shape == want.shape
            if weights == "float32":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{path} step {step}")
            else:
                # int8 activations: each rank quantizes its own part of a row (a row-parallel projection's input),
                # so TP=2 rounds differently from TP=1 — as near the file's float model as TP=1 is, and near TP=1
                f = exact[step]
                assert _rel(got, f) <= 1.25 * _rel(want, f), f"{path} step {step}"
                assert _rel(got, want) < KQUANT_BOUND, f"{path} step {step}"
            assert torch.equal(torch.from_numpy(ranks[1][path][step]), got), f"{path} step {step}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()
