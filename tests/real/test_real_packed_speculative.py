"""Real models, the README's main job as it runs on the CPU: the 1.5B target and the 0.5B draft in their packed
defaults (`cpu_weights.gguf_default`: the target kquant and the draft q4k where the kquant kernel runs, else w8a8 on an
AVX512-VNNI CPU; elsewhere the target's Q4_K tensors int4 on their own grid and its Q6_K ones int8, the draft int4), γ 3 —
greedy speculation emits exactly greedy AR's tokens (no tie allowance: the packed linears compute each row
like a one-row forward and the CPU attention scores each query like the one-token step, so a verify is bit
for bit the AR steps it stands for). Also the target in int8 and the draft in "gguf", both in w8a8, and the default
target's decode and verify logits at 1 and 2 threads (bit for bit: the thread count does not change a
decode step's result). The defaults run once per build of the kquant kernel this CPU runs (`kquant_variant`:
avx512, avx2, portable on an AVX-512 machine)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
NEW_TOKENS = 48
PROMPTS = [  # scripts/run.sh's prompt (its answer left AR's at token 6 before the per-query attention)
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that merges two sorted lists into one sorted list.",
]


def _w8a8_here() -> bool:
    from redwood.models.cpu_weights import w8a8_exact

    return w8a8_exact()


@pytest.mark.parametrize(
    "target_weights, draft_weights",
    [
        ("int8", "gguf"),
        pytest.param(
            "w8a8",
            "w8a8",
            marks=pytest.mark.skipif(
                not _w8a8_here(),
                reason="w8a8 needs fbgemm's exact int32 sums (AVX512-VNNI); this CPU / build lacks them",
            ),
        ),
    ],
)
def test_main_job_greedy_speculation_equals_ar(real_model, target_weights, draft_weights):
    main_job(real_model, target_weights, draft_weights)


def test_main_job_greedy_speculation_equals_ar_in_each_kernel_build(real_model, kquant_variant):
    """The defaults (kquant target, q4k draft) with the kquant kernel and C++ layers of each build."""
    main_job(real_model, "auto", "auto")


def main_job(real_model, target_weights: str, draft_weights: str) -> None:
    from redwood import LLM, SamplingParams
    from redwood.speculation.config import SpeculativeConfig

    real_model(TARGET)
    real_model(DRAFT)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    spec = LLM(
        TARGET,
        weights=target_weights,
        speculative=SpeculativeConfig(draft_model=DRAFT, num_draft_tokens=3, draft_weights=draft_weights),
    )
    from redwood.models.cpu_weights import gguf_default

    want_target = gguf_default() if target_weights == "auto" else target_weights  # (the target's CPU default)
    assert spec.model.weights == want_target
    want_draft = gguf_default(draft=True) if draft_weights == "auto" else draft_weights  # (the draft's default)
    assert f"{want_draft} weights" in spec.draft_name
    ids = [spec.encode(p, chat=True) for p in PROMPTS]
    got = [o.token_ids for o in spec.generate(ids, params)]
    del spec
    ar = LLM(TARGET, weights=target_weights)
    want = [o.token_ids for o in ar.generate(ids, params)]
    assert got == want


def test_default_target_decode_and_verify_logits_equal_at_1_and_2_threads(real_model, kquant_variant):
    """The packed kernels (every forward under the gemm threshold: decode steps, verifies, short prefills)
    give the same logits bit for bit at 1 and 2 threads — what lets the thread count change without changing
    a decode. (A prefill chunk of ≥ 128 rows takes oneDNN's bfloat16 gemm, whose sums do depend on the count:
    measured up to 0.25 apart in the 1.5B's logits, docs/perf/cpu.md session 13.)"""
    import torch

    from redwood.loading import load_model

    real_model(TARGET)
    from redwood.models.cpu_weights import gguf_default

    m = load_model(TARGET, weights="auto").model
    assert m.weights == gguf_default()
    ids = list(range(1000, 1048))
    before = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                c = m.new_cache(1, 64)
                logits = [m(torch.tensor([ids[:40]]), torch.arange(40)[None], c)]
                c.commit(40)
                for p in range(40, 43):
                    logits.append(m(torch.tensor([[ids[p]]]), torch.tensor([[p]]), c))
                    c.commit(1)
                logits.append(m(torch.tensor([ids[43:47]]), torch.arange(43, 47)[None], c))
            out[n] = logits
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(out[1], out[2]))


def test_draft_in_kquant_keeps_its_q5_0_and_q8_0_blocks_near_the_float_model(real_model):
    """The 0.5B draft under weights="kquant": its Q5_0 / Q8_0 projections (q, k, v, o, gate, up; the Q8_0 head) are
    the file's own blocks (bit for bit the dequantized file's values), every projection a kquant one, so its layers
    run as C++ calls; its logits over a prompt stay near the float32 model's (the file's values dequantized), as
    near as the default q4k draft's or nearer."""
    import torch

    from redwood.loading import load_model
    from redwood.loading.gguf import read_gguf_header
    from redwood.models import cpu_fused
    from redwood.models.cpu_weights import KQUANT, PackedLinear

    path = real_model(DRAFT)
    m = load_model(DRAFT, weights=KQUANT).model
    kinds, types = set(), {}
    for name, module in m.named_modules():
        if isinstance(module, PackedLinear) and name != "packed_head":
            kinds.add(module.kind)
            types[module.type_name] = types.get(module.type_name, 0) + 1
    file_types = {t.type_name for t in read_gguf_header(path).tensors.values()}
    assert {"Q5_0", "Q8_0"} <= file_types
    assert kinds == {KQUANT} and types["Q5_0"] > 0 and types["Q8_0"] > 0, types
    assert m.lm_head.type_name == "Q8_0" and cpu_fused.model_takes(m)
    q = m.layers[0].self_attn.q_proj
    f32 = load_model(DRAFT, weights="float32").model
    assert torch.equal(q.dequantized(), f32.layers[0].self_attn.q_proj.weight.float())
    q4k = load_model(DRAFT, weights="q4k").model
    ids = torch.tensor([list(range(1000, 1040))])
    pos = torch.arange(40)[None]
    with torch.inference_mode():
        ref = f32(ids, pos, f32.new_cache(1, 48))
        got = {w: mm(ids, pos, mm.new_cache(1, 48)) for w, mm in (("kquant", m), ("q4k", q4k))}
    err = {w: ((y - ref).norm() / ref.norm()).item() for w, y in got.items()}
    agree = {w: (y.argmax(-1) == ref.argmax(-1)).float().mean().item() for w, y in got.items()}
    assert err["kquant"] < 0.1 and err["kquant"] <= err["q4k"], err
    assert agree["kquant"] >= 0.9 and agree["kquant"] >= agree["q4k"], agree


def test_main_job_with_a_kquant_draft_greedy_speculation_equals_ar(real_model):
    """The default target with the 0.5B draft in kquant (its Q5_0 / Q8_0 / Q4_K / Q6_K blocks as the file holds
    them): greedy speculation == greedy AR."""
    main_job(real_model, "auto", "kquant")
