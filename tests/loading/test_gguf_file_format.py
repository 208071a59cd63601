"""weights="gguf": a GGUF file's projections packed in the kernel format its own types fit — 4-bit group
types (Q4_0, Q4_1, Q4_K) as torch int4 with the file's q and a (scale, zero) per 32 values that reproduces
its values to bfloat16 precision (`cpu_weights.int4_scale_zero`), every other type int8 (or bfloat16).

Checked element-wise against `dequantize` (the file's float values) for every 4-bit layout, through the
kernel itself; on tiny files of mixed types (llama: Q/K rows un-permuted) through load_model; greedy
speculation == greedy AR for the format; the errors for a non-GGUF model.
"""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from redwood.errors import ConfigError
from redwood.loading import load_model
from redwood.loading.gguf import INT4_GROUP_TYPES, dequantize, int4_groups, read_gguf
from redwood.models import cpu_weights
from redwood.models.cpu_weights import PackedLinear, int4_scale_zero
from tests.loading.test_gguf import random_k_blocks, random_state_dict, write_gguf


def load(path, weights):
    """load_model of a tokenizer-less test file (its ModelInfo holds no tokenizer)."""
    from redwood.loading import ModelInfo
    from redwood.loading.gguf import read_gguf_config

    info = ModelInfo(config=read_gguf_config(path), tokenizer=None, source=path.name, path=path)
    return load_model(info, weights=weights).model


def raw_blocks(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """A tensor's bytes in `qtype`: Q4_K from random blocks (gguf cannot quantize K types), Q4_0 / Q4_1
    quantized from random floats by gguf."""
    if qtype == QT.Q4_K:
        return random_k_blocks(qtype, rows, cols, seed)
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def kernel_weight(q, step, offset):
    """The float32 weight the int4 kernel multiplies by for the file's groups: (q − 8) · scale + zero."""
    scale, zero = int4_scale_zero(step, offset)
    N, K = q.shape
    w = (q.float().view(N, K // 32, 32) - 8) * scale.float()[..., None] + zero.float()[..., None]
    return w.view(N, K)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K])
@pytest.mark.parametrize("rows", [48, 192])  # 48: not whole 64-row blocks (packed at once); 192: sliced
def test_int4_groups_reproduce_the_files_values_through_the_kernel(qtype, rows, monkeypatch):
    monkeypatch.setattr(cpu_weights, "PACK_ROWS", 64)  # (192 rows: three slices of the packing)
    cols = 512
    raw = raw_blocks(qtype, rows, cols, seed=rows)
    ref = dequantize(raw, qtype.name, (rows, cols))  # the file's values (bit-exact with gguf)
    q, step, offset = int4_groups(raw, qtype.name, (rows, cols))
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and step.shape == offset.shape == (rows, cols // 32)
    # the decomposition is the file's values: Q4_K bit for bit (dequantize computes q · step − offset);
    # Q4_0 / Q4_1 within a float32 rounding of theirs (d · (q − 8), d · q + m)
    groups = (q.float().view(rows, -1, 32) * step[..., None] - offset[..., None]).view(rows, cols)
    if qtype == QT.Q4_K:
        assert torch.equal(groups, ref)
    else:
        assert ((groups - ref).abs() <= 2**-23 * ref.abs() * 2 + 1e-12).all()
    # the kernel's weight against the file's: within the bound int4_scale_zero derives (bfloat16 half ulps)
    w = kernel_weight(q, step, offset)
    scale, zero = int4_scale_zero(step, offset)
    zero_star = 8 * scale.float() - offset - 7.5 * (scale.float() - step)
    bound = (2**-8 * (7.5 * step.abs() + zero_star.abs()) * 1.001).repeat_interleave(32, 1)
    err = (w - ref).abs()
    assert (err <= bound + 1e-12).all()
    # the packed projection multiplies by exactly that weight (its products: rounded once to bfloat16)
    p = PackedLinear.from_int4_groups(q, step, offset)
    assert p.kind == "int4" and (p.out_features, p.in_features) == (rows, cols)
    assert torch.equal(p.dequantized(), w.bfloat16().float())
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    assert torch.equal(p(x), (x.bfloat16().double() @ w.double().T).bfloat16().float())
    # re-quantizing the file's floats (--weights int4: min/max per group) moves them by up to half a step
    # where the file's grid is not its group's min/max (Q4_K's fitted mins, Q4_0's symmetric grid); Q4_1 is
    # gguf's min/max quantizer itself, so only bfloat16 roundings separate them there (this format: closer)
    old = (PackedLinear(ref, None, "int4").dequantized() - ref).abs().max()
    assert old > (10 * err.max() if qtype != QT.Q4_1 else err.max())


def test_int4_groups_checks_type_and_size():
    from redwood.errors import ModelLoadError, UnsupportedModelError

    raw = raw_blocks(QT.Q4_K, 16, 256, 0)
    with pytest.raises(UnsupportedModelError, match="Q6_K is not a 4-bit group type"):
        int4_groups(raw, "Q6_K", (16, 256))
    with pytest.raises(ModelLoadError, match="Q4_K tensor of shape \\(16, 512\\) has 2304 bytes, expected 4608"):
        int4_groups(raw, "Q4_K", (16, 512))
    assert set(INT4_GROUP_TYPES) == {"Q4_0", "Q4_1", "Q4_K"}


def test_zero_scale_groups_and_negative_offsets():
    """A group whose scale is 0 (all values equal −offset) and offsets of either sign map exactly enough."""
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    step = torch.tensor([[0.0, 1e-3]]).repeat(16, 1)
    offset = torch.tensor([[-0.02, 0.011]]).repeat(16, 1)
    ref = (q.float().view(16, 2, 32) * step[..., None] - offset[..., None]).view(16, 64)
    w = kernel_weight(q, step, offset)
    assert ((w - ref).abs()[:, :32] <= 2**-8 * 0.02).all()  # (the zero's bfloat16 rounding alone)
    assert ((w - ref).abs()[:, 32:] <= 2**-8 * (7.5e-3 + 0.02)).all()


# A tiny llama file (Q/K rows permuted by the converter) of every layout the format handles.
FILE_TYPES = {  # GGUF name -> the kernel format "gguf" must give it
    "blk.0.attn_q.weight": (QT.Q4_K, "int4"),
    "blk.0.attn_k.weight": (QT.Q4_0, "int4"),
    "blk.0.ffn_gate.weight": (QT.Q4_1, "int4"),
    "blk.0.ffn_down.weight": (QT.Q6_K, "int8"),
    "blk.0.attn_v.weight": (QT.Q8_0, "int8"),
    "blk.1.attn_q.weight": (QT.Q5_0, "int8"),
    "blk.1.attn_k.weight": (QT.Q4_K, "int4"),
    "blk.1.ffn_up.weight": (QT.F16, "int8"),
    "output.weight": (QT.Q4_K, "int8"),  # (300 rows: int4 cannot tile them → int8 from the file's floats)
}  # (the rest F32 → int8)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    from tests.loading.test_gguf import HIDDEN, gguf_name

    sd = random_state_dict(4, qkv_bias=False, tied=False)
    shapes = {gguf_name(k): v.shape for k, v in sd.items()}
    raw, types = {}, {}
    for i, (name, (qtype, _)) in enumerate(FILE_TYPES.items()):
        if qtype in (QT.Q4_K, QT.Q6_K):
            raw[name] = (random_k_blocks(qtype, *shapes[name], 20 + i), qtype)
        else:
            types[name] = qtype
    assert shapes["output.weight"][1] == HIDDEN
    path = tmp_path_factory.mktemp("gguf-format") / "tiny-mixed.gguf"
    write_gguf(path, "llama", sd, types=types, raw=raw)
    return path


def test_load_gguf_format_packs_each_projection_by_its_file_type(mixed_file):
    from tests.loading.test_gguf import gguf_name

    m = load(mixed_file, "gguf")
    assert m.weights == "gguf" and m.packed_head is m.lm_head
    ref = read_gguf(mixed_file).tensors  # the file's values, Q/K rows un-permuted
    kinds = {}
    for name, module in m.named_modules():
        if not isinstance(module, PackedLinear) or name == "packed_head":
            continue
        hf = "lm_head.weight" if name == "lm_head" else f"model.{name}.weight"
        g = gguf_name(hf)
        want = FILE_TYPES.get(g, (QT.F32, "int8"))[1]
        kinds[g] = module.kind
        assert module.kind == want, g
        w, r = module.dequantized(), ref[hf]
        if want == "int4":  # the file's grid: within bfloat16 roundings (scale, zero; the read-out's output)
            assert ((w - r).abs() <= 2**-7 * r.abs().amax(1, keepdim=True)).all(), g
        else:  # int8 per row: half a step of the row's largest value
            assert ((w - r).abs() <= r.abs().amax(1, keepdim=True) / 127 * 0.52 + 1e-7).all(), g
    assert len(kinds) == 2 * 7 + 1
    # the model's logits against a float32 model of the file's values
    f32 = load(mixed_file, "float32")
    ids = torch.tensor([[random.Random(0).randrange(3, 300) for _ in range(24)]])
    pos = torch.arange(24)[None]
    a, b = m(ids, pos, m.new_cache(1, 32)), f32(ids, pos, f32.new_cache(1, 32))
    assert (a - b).abs().max() <= 0.03 * b.abs().max()


def test_a_tied_head_under_gguf_is_int8_and_q_k_rows_are_unpermuted(tmp_path):
    """qwen2 (no permutation) and a tied head: the head is an int8 copy of the float embedding; the Q4_K
    q projection of a llama file equals the float load's (un-permuted) rows — a row order bug would fail."""
    from tests.loading.test_gguf import HIDDEN, QWEN_TYPES

    path = tmp_path / "tied.gguf"
    raw = {"blk.0.attn_q.weight": (random_k_blocks(QT.Q4_K, HIDDEN, HIDDEN, 7), QT.Q4_K)}
    write_gguf(path, "qwen2", random_state_dict(5, qkv_bias=True, tied=True), types=QWEN_TYPES, raw=raw)
    m = load(path, "gguf")
    assert m.lm_head is None and m.packed_head.kind == "int8"
    assert m.layers[0].self_attn.q_proj.kind == "int4" and m.layers[0].self_attn.q_proj.bias is not None
    assert m.layers[0].self_attn.v_proj.kind == "int4"  # (QWEN_TYPES: Q4_0)


def test_llama_q_rows_follow_the_unpermutation(mixed_file):
    m = load(mixed_file, "gguf")
    ref = read_gguf(mixed_file).tensors["model.layers.0.self_attn.q_proj.weight"]
    w = m.layers[0].self_attn.q_proj.dequantized()
    err = (w - ref).abs().amax(1)
    assert (err <= 2**-7 * ref.abs().amax(1)).all()
    from redwood.loading.gguf import permute_qk

    wrong = permute_qk(ref, 4)  # (the converter's order: what an un-permutation bug would leave)
    assert (w - wrong).abs().max() > 10 * err.max()


def test_gguf_format_errors(tmp_path, mixed_file):
    from tests.conftest import random_hf_model, tiny_hf_config

    random_hf_model(tiny_hf_config("qwen2")).save_pretrained(tmp_path / "hf")
    with pytest.raises(
        ConfigError,
        match="weights='gguf' keeps a GGUF file's own quantization, and .* is not a "
        ".gguf file; choose one of float32, bfloat16, int8, int4",
    ):
        load_model(tmp_path / "hf", weights="gguf")
    f32 = load(mixed_file, "float32")
    with pytest.raises(ConfigError, match="chosen as the file loads: load_model\\(path, weights='gguf'\\)"):
        f32.quantize_cpu("gguf")
    with pytest.raises(ConfigError, match="weights='gguf' is a CPU format"):
        cpu_weights.check_weights("gguf", torch.device("cuda"))


@pytest.mark.parametrize("mode", ["self-streaming", "draft-int4"])
def test_greedy_speculation_equals_greedy_ar_under_gguf(mixed_file, tokenizer, mode):
    """The format mixes int4 and int8 projections; each is row-exact, so a verify scores what the AR
    steps would: greedy speculative tokens == greedy AR tokens, drafts partly accepted."""
    from redwood.kv.policies import FullPolicy, StreamingPolicy
    from redwood.sampling_params import SamplingParams
    from redwood.speculation.drafters import ModelDrafter, SelfDrafter
    from redwood.speculation.trees import Tree, resolve_tree
    from tests.engine.driver import run_engine

    target = load(mixed_file, "gguf")
    if mode == "self-streaming":
        drafter, tree = SelfDrafter(target, StreamingPolicy(2, 10)), Tree.chain(3)
    else:
        drafter, tree = ModelDrafter(load(mixed_file, "int4"), FullPolicy(), 300), resolve_tree("chains:2x3")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    _, ar, _ = run_engine(target, tokenizer, prompts, params, max_num_seqs=3)
    _, spec, _ = run_engine(target, tokenizer, prompts, params, drafter=drafter, tree=tree, max_num_seqs=3)
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and len(a.output_ids) == 20
    assert 0 < sum(s.stats.spec.accepted for s in spec) < sum(s.stats.spec.drafted for s in spec)
