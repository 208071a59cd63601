"""CPU weight formats (redwood.models.cpu_weights, Transformer.quantize_cpu): each packed projection
multiplies by its dequantized weight; greedy speculation equals greedy AR for each format (same weights in
every forward); bad formats and unpackable shapes are ConfigErrors.

Tiny random Qwen2-style models (hidden 64, KV projections 32 wide, vocabulary 320: every shape int4 can
pack) on the CPU through torch's own packed-weight kernels.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from redwood.errors import ConfigError
from redwood.kv.policies import FullPolicy, StreamingPolicy
from redwood.models import cpu_weights
from redwood.models.cpu_weights import INT4_GROUP, INT8_GEMM_ROWS, PackedLinear
from redwood.sampling_params import SamplingParams
from redwood.speculation.drafters import ModelDrafter, SelfDrafter
from redwood.speculation.trees import Tree, resolve_tree
from tests.engine.driver import run_engine
from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture

KINDS = ["int8", "int4", "bfloat16"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_projection_equals_its_dequantized_weight(kind, bias):
    """y = x Wᵀ + b against a float32 matmul of the bfloat16-rounded input by the dequantized weight:
    the kernels round their output to bfloat16, so within 2⁻⁷ of the output's scale (bfloat16 keeps 8
    significant bits). The dequantized weight is within half a quantization step of the original."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.05
    b = torch.randn(96, generator=g) if bias else None
    p = PackedLinear(w, b, kind)
    x = torch.randn(2, 5, 128, generator=g)
    wq = p.dequantized()
    ref = x.bfloat16().float() @ wq.T + (0 if b is None else b)
    y = p(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    assert (y - ref).abs().max() <= 2**-7 * ref.abs().max()
    if kind == "int8":
        step = w.abs().amax(1, keepdim=True) / 127  # per output row
    elif kind == "int4":
        groups = w.reshape(96, -1, INT4_GROUP)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(INT4_GROUP, 1)
    else:
        step = w.abs() * 2**-7  # a bfloat16 ulp is at most 2⁻⁷ of the value
    # (the scales and int4's zeros are bfloat16 themselves: the grid moves by a fraction of a percent)
    assert ((wq - w).abs() <= step * 0.52 + 1e-7).all()
    # each row of a multi-row forward equals a one-row forward (what makes verification exact)
    rows = torch.cat([p(x.reshape(10, 128)[i : i + 1]) for i in range(10)])
    assert torch.equal(rows, p(x.reshape(10, 128)))
    # a prefill-sized forward (int8: the bfloat16 gemm from INT8_GEMM_ROWS rows) within the same bound
    xl = torch.randn(INT8_GEMM_ROWS + 3, 128, generator=g)
    ref = xl.bfloat16().float() @ wq.T + (0 if b is None else b)
    assert (p(xl) - ref).abs().max() <= 2**-7 * ref.abs().max()


def _spy_on_kernel(monkeypatch) -> list[int]:
    """Record the row count of every call into the packed kernels (`PackedLinear.raw`); the gemm paths of
    prefill chunks never call it."""
    calls: list[int] = []
    kernel = PackedLinear.raw
    monkeypatch.setattr(PackedLinear, "raw", lambda self, x2: calls.append(x2.shape[0]) or kernel(self, x2))
    return calls


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_batch_of_verify_steps_stays_on_the_row_exact_kernel(kind, monkeypatch):
    """[B, T, K] with B × T past the gemm threshold but few tokens per row (a verify at batch 40, γ 3) is
    computed by the packed kernel like one-row forwards — the AR steps it stands for — bit for bit; a prefill
    chunk ([1, T ≥ threshold, K]) takes the gemm (int8 always; int4 where `int4_layout_known`, else it stays
    in torch's kernel) within bfloat16 rounding. Which path ran is observed on the kernel, not inferred from
    rounding (the gemm and the kernel round alike on some CPUs)."""
    g = torch.Generator().manual_seed(5)
    p = PackedLinear(torch.randn(128, 256, generator=g) * 0.05, None, kind)
    verify = torch.randn(40, 4, 256, generator=g)  # 160 rows ≥ the 128-row threshold
    assert verify.shape[0] * verify.shape[1] >= max(cpu_weights.INT8_GEMM_ROWS, cpu_weights.INT4_GEMM_ROWS)
    one_rows = torch.stack([torch.cat([p(verify[b, t][None, None]) for t in range(4)], 1)[0] for b in range(40)])
    calls = _spy_on_kernel(monkeypatch)
    assert torch.equal(p(verify), one_rows)
    assert calls == [160]  # all 160 rows in one kernel call
    chunk = verify.reshape(1, 160, 256)
    assert cpu_weights.prefill_rows(chunk) == 160 and cpu_weights.prefill_rows(verify) == 4
    calls.clear()
    y = p(chunk)[0]
    gemm = kind == "int8" or cpu_weights.int4_layout_known(128)
    assert calls == ([] if gemm else [160])
    ref = one_rows.reshape(160, -1)
    assert (y - ref).abs().max() <= 2**-7 * ref.abs().max()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packing_in_row_slices_equals_packing_whole(kind, monkeypatch):
    """PACK_ROWS slices (the float temporaries of one slice, not the whole matrix) give the same buffers."""
    w = torch.randn(320, 64, generator=torch.Generator().manual_seed(2))
    whole = PackedLinear(w, None, kind)
    monkeypatch.setattr(cpu_weights, "PACK_ROWS", 64)
    sliced = PackedLinear(w, None, kind)
    a, b = dict(whole.named_buffers()), dict(sliced.named_buffers())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(
    not cpu_weights.int4_layout_known(192),
    reason="this torch build / CPU packs int4 in a layout unpack_int4 does not read (the prefill "
    "stays in torch's kernel: test_int4_prefill_in_an_unknown_layout_stays_in_the_kernel)",
)
def test_int4_prefill_rows_take_the_unpacked_bfloat16_gemm(monkeypatch):
    """int4 forwards of INT4_GEMM_ROWS rows or more multiply by the weight unpacked from the kernel's layout
    (`unpack_int4`: exactly the weight the kernel reads back, `dequantized`), in slices of output rows,
    within bfloat16 rounding of the kernel's product; fewer rows (every batch-1 verify) stay in the kernel."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(192, 256, generator=g) * 0.05, torch.randn(192, generator=g)
    p = PackedLinear(w, b, "int4")
    assert cpu_weights.int4_layout_known(192) and not cpu_weights.int4_layout_known(96)
    unpacked = cpu_weights.unpack_int4(p.packed, p.scale_zero, 0, 192)  # Wᵀ [K, N]
    assert unpacked.dtype == torch.bfloat16 and torch.equal(unpacked.float().T, p.dequantized())
    assert torch.equal(cpu_weights.unpack_int4(p.packed, p.scale_zero, 64, 192), unpacked[:, 64:])
    monkeypatch.setattr(cpu_weights, "INT4_SLICE", 64)  # three slices
    x = torch.randn(cpu_weights.INT4_GEMM_ROWS + 5, 256, generator=g)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), p.packed, INT4_GROUP, p.scale_zero).float() + b
    slices, unpack = [], cpu_weights.unpack_int4
    monkeypatch.setattr(cpu_weights, "unpack_int4", lambda *a: slices.append(a[2:]) or unpack(*a))
    calls = _spy_on_kernel(monkeypatch)
    y = p(x)
    assert (y - kernel).abs().max() <= 2**-7 * kernel.abs().max()
    assert slices == [(0, 64), (64, 128), (128, 192)] and calls == []  # (the unpacked gemm ran, in slices)
    short = x[: cpu_weights.INT4_GEMM_ROWS - 1]
    slices.clear()
    assert torch.equal(p(short), kernel[: cpu_weights.INT4_GEMM_ROWS - 1])
    assert slices == [] and calls == [cpu_weights.INT4_GEMM_ROWS - 1]
    assert cpu_weights.INT4_GEMM_ROWS > 65  # above a batch-1 verify of the largest tree (64 drafts)


def test_int4_prefill_in_an_unknown_layout_stays_in_the_kernel(monkeypatch):
    """Where the int4 probe fails (another torch build / CPU layout), a prefill chunk never reads the packed
    bytes as if they were our layout: it stays in torch's kernel, bit for bit the kernel's product."""
    monkeypatch.setattr(cpu_weights, "_INT4_LAYOUT", [False])
    assert not cpu_weights.int4_layout_known(192)
    g = torch.Generator().manual_seed(1)
    p = PackedLinear(torch.randn(192, 256, generator=g) * 0.05, None, "int4")
    x = torch.randn(cpu_weights.INT4_GEMM_ROWS + 5, 256, generator=g)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), p.packed, INT4_GROUP, p.scale_zero).float()
    calls = _spy_on_kernel(monkeypatch)
    assert torch.equal(p(x), kernel) and calls == [x.shape[0]]


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_model_equals_float_model_of_its_dequantized_weights(models, kind):
    """Logits of a 40-token prompt: the packed model against a float32 model holding the dequantized
    weights (so only the kernels' bfloat16 activations and outputs differ): within 3% of the logits'
    scale, same argmax everywhere. A mis-packed or transposed weight is off by ~100%."""
    target = models[0]
    q = copy.deepcopy(target)
    q.quantize_cpu(kind)
    assert q.weights == kind and q.packed_head is not None
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())  # every projection and the head
    ref_model = copy.deepcopy(target)
    for name, m in q.named_modules():
        if isinstance(m, PackedLinear) and name != "packed_head":
            ref_model.get_submodule(name).weight.copy_(m.dequantized())
    head = q.packed_head.dequantized()  # the reference's logits: its final-norm output × this head
    ids = torch.tensor([[random.Random(0).randrange(3, 300) for _ in range(40)]])
    pos = torch.arange(40)[None]
    out = q(ids, pos, q.new_cache(1, 64))
    hidden = {}
    ref_model.norm.register_forward_hook(lambda mod, inp, o: hidden.setdefault("h", o))
    ref_model(ids, pos, ref_model.new_cache(1, 64))
    ref = hidden["h"] @ head.T
    assert (out - ref).abs().max() <= 0.03 * ref.abs().max()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


MODES = {
    "chain-draft-full": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), Tree.chain(3)),
    "chain-self-streaming": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), Tree.chain(4)),
    "tree-draft-full": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), resolve_tree("chains:2x3")),
    "tree-self-streaming": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), resolve_tree("generic-16")),
}


@pytest.fixture(scope="module")
def packed(models):
    """{kind: (target, draft)} quantized copies (the draft in the same format, as --weights sets both)."""
    out = {}
    for kind in KINDS:
        t, d = copy.deepcopy(models[0]), copy.deepcopy(models[1])
        t.quantize_cpu(kind)
        d.quantize_cpu(kind)
        out[kind] = (t, d)
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculation_equals_greedy_ar(models, packed, kind, mode):
    """Three ragged prompts batched together: each speculative greedy output equals the same format's
    greedy AR output token for token, and the drafts were partly accepted (so both paths ran)."""
    target, draft = packed[kind]
    tok = models[2]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    _, ar, _ = run_engine(target, tok, prompts, params, max_num_seqs=3)
    drafter, tree = MODES[mode](target, draft)
    _, spec, _ = run_engine(target, tok, prompts, params, drafter=drafter, tree=tree, max_num_seqs=3)
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and len(a.output_ids) == 24
    assert 0 < sum(s.stats.spec.accepted for s in spec) < sum(s.stats.spec.drafted for s in spec)


@pytest.mark.parametrize("target_kind", ["float32", "int8"])
@pytest.mark.parametrize("tree", ["chain:3", "chains:2x3"])
def test_greedy_speculation_with_an_int4_draft_equals_greedy_ar(models, packed, target_kind, tree):
    """A draft in a format of its own (--draft-weights int4 under a float32 or int8 target): the speculative
    greedy tokens equal the target's greedy AR tokens — the draft's format moves only acceptance."""
    target = models[0] if target_kind == "float32" else packed[target_kind][0]
    draft = packed["int4"][1]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    _, ar, _ = run_engine(target, models[2], prompts, params, max_num_seqs=3)
    _, spec, _ = run_engine(
        target,
        models[2],
        prompts,
        params,
        drafter=ModelDrafter(draft, FullPolicy(), 320),
        tree=resolve_tree(tree),
        max_num_seqs=3,
    )
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and len(a.output_ids) == 24
    assert 0 < sum(s.stats.spec.accepted for s in spec) < sum(s.stats.spec.drafted for s in spec)


def test_bad_formats_are_config_errors(models, tokenizer, tmp_path):
    from tests.conftest import random_hf_model, tiny_hf_config

    q = copy.deepcopy(models[0])
    with pytest.raises(ConfigError, match="unknown weights 'int3'; choose one of float32, bfloat16, int8, int4"):
        q.quantize_cpu("int3")
    q.quantize_cpu("float32")  # the model as loaded: nothing changes
    assert q.weights == "float32" and q.packed_head is None
    q.quantize_cpu("int8")
    with pytest.raises(ConfigError, match="already int8"):
        q.quantize_cpu("int4")
    # hidden 48: 48-wide inputs are not whole 32-input int4 groups (int8 still packs it)
    config = tiny_hf_config("qwen2", hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    random_hf_model(config).save_pretrained(tmp_path / "odd")
    from redwood.loading import load_model

    odd = load_model(tmp_path / "odd").model
    with pytest.raises(ConfigError, match="int4 needs out_features % 16 == 0 and in_features % 32 == 0"):
        odd.quantize_cpu("int4")
    assert odd.weights == "float32"  # checked before anything was replaced
    odd.quantize_cpu("int8")
    # hidden 40: torch's int8 kernel needs inputs in multiples of 16
    config = tiny_hf_config("qwen2", hidden_size=40, num_attention_heads=4, num_key_value_heads=2)
    random_hf_model(config).save_pretrained(tmp_path / "odd8")
    with pytest.raises(ConfigError, match="int8 needs in_features % 16 == 0; this projection is 40×40"):
        load_model(tmp_path / "odd8").model.quantize_cpu("int8")


def test_weight_bytes_counts_the_packed_bytes(models):
    """bench.ar.weight_bytes (the floor of a decode step) of a packed model: the packed projections and
    head plus the float norms; the float embedding is not read whole once the head has its own copy."""
    from redwood.bench.ar import weight_bytes

    q = copy.deepcopy(models[0])
    float_bytes = weight_bytes(q)
    q.quantize_cpu("int8")
    packed = sum(m.nbytes for m in q.modules() if isinstance(m, PackedLinear))
    norms = sum(p.nbytes for n, p in q.named_parameters() if "norm" in n)
    assert weight_bytes(q) == packed + norms
    assert weight_bytes(q) < 0.4 * float_bytes  # 1 byte a weight (+ scales) instead of 4
