"""The w8a8 CPU weight format (redwood.models.cpu_weights: int8 weights × int8 activations quantized per row,
fbgemm's integer dot products): each row of an M-row product equals its one-row product bit for bit (the
kernel's sums are exact and each row has its own scale), the product is the exact integer product scaled,
concatenation keeps the members' products, the packed layer forward equals the plain one, and greedy
speculation equals greedy AR. Skipped where this torch build / CPU cannot multiply w8a8 exactly.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from redwood.kv.policies import FullPolicy
from redwood.models import cpu_weights
from redwood.models.cpu_weights import PackedLinear, quantize_rows
from redwood.sampling_params import SamplingParams
from redwood.speculation.drafters import ModelDrafter
from redwood.speculation.trees import Tree, resolve_tree
from tests.engine.driver import run_engine
from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture

pytestmark = pytest.mark.skipif(not cpu_weights.w8a8_exact(), reason="no exact fbgemm w8a8 on this CPU / build")


@pytest.mark.parametrize("shape", [(96, 128), (64, 48), (320, 64), (40, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_equal_one_row_products_and_the_exact_product(shape, bias):
    """M = 1..9 and a prefill-sized 130 rows (w8a8 has no gemm path: one kernel at every M), a row of
    zeros and outlier channels; the product against float64(q · w8) · s · scale + b."""
    N, K = shape
    g = torch.Generator().manual_seed(N + K)
    w, b = torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g) if bias else None
    p = PackedLinear(w, b, "w8a8")
    x = torch.randn(130, K, generator=g)
    x[:, :3] *= 50  # outlier channels
    x[5] = 0
    ones = torch.cat([p(x[i : i + 1]) for i in range(130)])
    for m in list(range(1, 10)) + [130]:
        assert torch.equal(p(x[:m]), ones[:m])
    assert torch.equal(p(x.view(10, 13, K)), ones.view(10, 13, N))  # [B, T, K] inputs
    q, s = quantize_rows(x.bfloat16())
    assert torch.equal(q, q.round()) and q.abs().max() == 127
    w8 = p.int8_weight()
    exact = (q.double() @ w8.double().T) * s.double() * p.scale.double() + (0 if b is None else b.double())
    assert (ones.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    assert ones[5].eq(0 if b is None else b).all()
    # within the two quantizations of the float product (weights: half a step per row; activations: per row)
    ref = x @ w.T + (0 if b is None else b)
    assert (ones - ref).abs().max() <= 0.05 * ref.abs().max()


def test_from_int8_multiplies_by_the_int8_weight():
    g = torch.Generator().manual_seed(1)
    i8 = PackedLinear(torch.randn(64, 96, generator=g), None, "int8")
    p = PackedLinear.from_int8(i8.w8, i8.scale)
    assert p.kind == "w8a8" and torch.equal(p.int8_weight(), i8.w8) and torch.equal(p.dequantized(), i8.dequantized())
    assert p.nbytes == 64 * 96 + 64 * 4 + i8.scale.nbytes


@pytest.mark.parametrize("bias", [False, True])
def test_concat_equals_the_members_side_by_side(bias):
    g = torch.Generator().manual_seed(0)
    members = [
        PackedLinear(torch.randn(n, 128, generator=g) * 0.05, torch.randn(n, generator=g) if bias else None, "w8a8")
        for n in (192, 32, 32)
    ]
    x = torch.randn(17, 128, generator=g)
    before, nbytes = [m(x) for m in members], sum(m.nbytes for m in members)
    assert cpu_weights.can_concat(members)
    assert not cpu_weights.can_concat([members[0], PackedLinear(torch.randn(32, 128), None, "int8")])
    whole = PackedLinear.concat(members)
    assert whole.out_features == 256 and whole.nbytes == nbytes == sum(m.nbytes for m in members)
    assert torch.equal(whole(x), torch.cat(before, 1))
    for m, y in zip(members, before):  # a member alone: a slice of the whole's product
        assert m._w8a8 is None and torch.equal(m(x), y)
    assert torch.equal(whole.raw(x[:3].bfloat16()), torch.cat([m.raw(x[:3].bfloat16()) for m in members], 1))
    c = copy.deepcopy(whole)
    assert torch.equal(c(x), whole(x))


def test_packed_forward_equals_the_plain_forward_bit_for_bit(monkeypatch):
    """The layer forward of packed projections (backends.cpu_packed.packed_layer: q | k | v and gate | up as one
    w8a8 call each) against the plain one: prefill, decode, verify and a tree at batch 2 (the int8/int4
    test's scenario, tests/models/test_cpu_packed_forward.py)."""
    from tests.models import test_cpu_packed_forward as packed_forward

    model = packed_forward._tiny("w8a8")
    assert len(model.layers[0].self_attn.cpu_qkv) == 1 and len(model.layers[0].mlp.cpu_gate_up) == 1
    monkeypatch.setattr(packed_forward, "_tiny", lambda kinds: model)
    # (the shared scenario takes "int8" only for its group counts: w8a8 concatenates like int8)
    packed_forward.test_packed_forward_equals_the_plain_forward_bit_for_bit("int8", monkeypatch)


def test_a_model_in_w8a8_is_the_float_model_of_its_weights_within_quantization(models):
    target = models[0]
    q = copy.deepcopy(target)
    q.quantize_cpu("w8a8")
    assert q.weights == "w8a8" and q.packed_head is not None and q.packed_head.kind == "w8a8"
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    ids = torch.tensor([[random.Random(0).randrange(3, 300) for _ in range(40)]])
    pos = torch.arange(40)[None]
    out, ref = q(ids, pos, q.new_cache(1, 64)), target(ids, pos, target.new_cache(1, 64))
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("draft_kind", ["w8a8", "int4"])
def test_greedy_speculation_equals_greedy_ar(models, mode, draft_kind):
    """Three ragged prompts batched: a w8a8 target's speculative greedy output equals its greedy AR output
    token for token (verify rows = decode rows), with a w8a8 or an int4 draft; drafts partly accepted."""
    target, draft = copy.deepcopy(models[0]), copy.deepcopy(models[1])
    target.quantize_cpu("w8a8")
    draft.quantize_cpu(draft_kind)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    _, ar, _ = run_engine(target, models[2], prompts, params, max_num_seqs=3)
    tree = Tree.chain(3) if mode == "chain" else resolve_tree("chains:2x3")
    _, spec, _ = run_engine(
        target, models[2], prompts, params, drafter=ModelDrafter(draft, FullPolicy(), 320), tree=tree, max_num_seqs=3
    )
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and len(a.output_ids) == 24
    assert 0 < sum(s.stats.spec.accepted for s in spec) < sum(s.stats.spec.drafted for s in spec)
