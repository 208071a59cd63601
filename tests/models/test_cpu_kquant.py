"""weights="kquant": a GGUF file's Q4_K / Q6_K / Q8_0 / Q5_0 projections kept as the file's own blocks and
multiplied by int8 activations (redwood.cpu_kernels.kquant), every other projection in the fallback format
(`cpu_weights.file_kind`: w8a8 where it is exact here, else int8).

PackedLinear.from_kquant / concat / forward against the kernel; tiny GGUF files of mixed types through
load_model (each projection's kind, its weight == the file's values bit for bit — llama's Q/K rows
un-permuted as bytes —, logits near the float model's); a T-token forward row-equal to T one-token forwards;
greedy speculation == greedy AR (a chain and a tree); the ConfigErrors. Skipped where the kernel cannot run.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from redwood.cpu_kernels import kquant
from redwood.errors import ConfigError
from redwood.loading import load_model
from redwood.loading.gguf import dequantize, read_gguf
from redwood.models import cpu_weights
from redwood.models.cpu_weights import KQUANT, PackedLinear
from tests.loading.test_gguf import HIDDEN, VOCAB, gguf_name, random_state_dict, write_gguf

pytestmark = pytest.mark.skipif(
    not kquant.available(), reason=f"kquant kernel unavailable here: {kquant.why_unavailable()}"
)


def k_blocks(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, cols / 256 · block bytes]: random Q4_K / Q6_K super-blocks whose values are about a
    trained model's size (rms ~0.05: Q6_K d ~4e-5; Q4_K d ~3e-4 with dmin ~7.5 d, so sub-blocks are
    roughly centred) — random bytes elsewhere (gguf cannot quantize to K types)."""
    size = {QT.Q4_K: 144, QT.Q6_K: 210}[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    n = raw.shape[0]
    if qtype == QT.Q4_K:
        d = rng.uniform(2e-4, 4e-4, size=(n, 1))
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8)
        raw[:, 2:4] = (d * rng.uniform(6.5, 8.5, size=(n, 1))).astype(np.float16).view(np.uint8)
    else:
        d = rng.uniform(3e-5, 5e-5, size=(n, 1)) * rng.choice([-1.0, 1.0], size=(n, 1))
        raw[:, 208:210] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, cols // 256 * size)


def load(path, weights):
    """load_model of a tokenizer-less test file."""
    from redwood.loading import ModelInfo
    from redwood.loading.gguf import read_gguf_config

    info = ModelInfo(config=read_gguf_config(path), tokenizer=None, source=path.name, path=path)
    return load_model(info, weights=weights).model


KEPT = (QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q5_0)  # the types kquant keeps as the file's blocks


def fallback() -> str:
    """What kquant gives a projection whose type kquant does not keep (every shape here is int8-packable)."""
    return "w8a8" if cpu_weights.w8a8_exact() else "int8"


# GGUF name -> its type in the file (the rest F32). Layer 0: q | k | v all Q4_K (one kernel call), gate | up
# both Q6_K (one call), down Q4_K with K = 512; layer 1 mixes types, so nothing concatenates across them
# (q Q6_K, k Q4_K, v Q8_0; gate Q4_K, up Q5_0: kept as the file's blocks too; o F32: the fallback); the head
# Q6_K (300 rows: a tail of 12 after 16-row chunks); the embedding Q8_0 (a lookup, not packed).
KQ_TYPES = {
    "blk.0.attn_q.weight": QT.Q4_K,
    "blk.0.attn_k.weight": QT.Q4_K,
    "blk.0.attn_v.weight": QT.Q4_K,
    "blk.0.attn_output.weight": QT.Q6_K,
    "blk.0.ffn_gate.weight": QT.Q6_K,
    "blk.0.ffn_up.weight": QT.Q6_K,
    "blk.0.ffn_down.weight": QT.Q4_K,
    "blk.1.attn_q.weight": QT.Q6_K,
    "blk.1.attn_k.weight": QT.Q4_K,
    "blk.1.attn_v.weight": QT.Q8_0,
    "blk.1.ffn_gate.weight": QT.Q4_K,
    "blk.1.ffn_up.weight": QT.Q5_0,
    "blk.1.ffn_down.weight": QT.Q6_K,
    "output.weight": QT.Q6_K,
    "token_embd.weight": QT.Q8_0,
}


def write_mixed(path, arch: str, seed: int, tied: bool = False, types: dict | None = None):
    types = KQ_TYPES if types is None else types
    sd = random_state_dict(seed, qkv_bias=arch == "qwen2", tied=tied)
    shapes = {gguf_name(k): v.shape for k, v in sd.items()}
    raw, other = {}, {}
    for i, (name, qtype) in enumerate(types.items()):
        if name not in shapes:
            continue
        if qtype in (QT.Q4_K, QT.Q6_K):
            raw[name] = (k_blocks(qtype, *shapes[name], seed * 100 + i), qtype)
        else:
            other[name] = qtype
    write_gguf(path, arch, sd, types=other, raw=raw)
    return path


@pytest.fixture(scope="module")
def kq_file(tmp_path_factory):
    return write_mixed(tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf", "qwen2", seed=6)


@pytest.fixture(scope="module")
def kq_model(kq_file):
    return load(kq_file, KQUANT)


def prefilled(m, prompt: torch.Tensor, capacity: int):
    """A fresh one-row cache holding the committed prompt [1, n] (its forward's logits dropped)."""
    cache = m.new_cache(1, capacity)
    n = prompt.shape[1]
    m(prompt, torch.arange(n)[None], cache)
    cache.commit(n)
    return cache


def decode_steps(m, cache, toks: torch.Tensor, positions) -> torch.Tensor:
    """One-token forwards of toks[:, t] at positions[t], each committed → their logits side by side [1, T, V]."""
    out = []
    for t, pos in enumerate(positions):
        out.append(m(toks[:, t : t + 1], torch.tensor([[pos]]), cache))
        cache.commit(1)
    return torch.cat(out, 1)


def projections(model):
    """(GGUF name, PackedLinear) of every packed projection and the head."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear) and name != "packed_head":
            out.append((gguf_name("lm_head.weight" if name == "lm_head" else f"model.{name}.weight"), module))
    return out


# ---------------------------------------------------------------- PackedLinear


@pytest.mark.parametrize(
    "qtype, K", [(QT.Q4_K, 512), (QT.Q6_K, 512), (QT.Q8_0, 512), (QT.Q8_0, 896), (QT.Q5_0, 512), (QT.Q5_0, 896)]
)
def test_from_kquant_forward_is_the_kernel_on_float32_inputs(qtype, K):
    """(K = 896, the 0.5B's hidden size: 3.5 super-blocks, the packed rows padded with zero blocks)"""
    from tests.cpu_kernels.test_kquant import random_blocks

    N = 80
    if qtype in (QT.Q4_K, QT.Q6_K):
        rows = torch.from_numpy(k_blocks(qtype, N, K, 1))
    else:
        rows = random_blocks(qtype.name, N, K, seed=1, d_range=(2e-4, 4e-4))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(0))
    p = PackedLinear.from_kquant(rows, qtype.name, bias)
    assert (p.kind, p.type_name, p.out_features, p.in_features) == (KQUANT, qtype.name, N, K)
    assert torch.equal(p.dequantized(), dequantize(rows, qtype.name, (N, K)))
    assert p.nbytes == N * kquant.padded(K) // 256 * kquant.TYPES[qtype.name][2] + 4 * N
    x = torch.randn(2, 7, K, generator=torch.Generator().manual_seed(1))
    y = p(x)
    assert y.shape == (2, 7, N) and y.dtype == torch.float32
    assert p.act_dtype == torch.float32  # (the kernel quantizes float32 rows itself: no bfloat16 round trip)
    xf = x.reshape(-1, K)
    assert torch.equal(p.raw(xf), kquant.kquant_linear(xf, p.kq, qtype.name))
    assert torch.equal(y.view(-1, N), p.raw(xf) + bias)
    # no gemm path: a prefill-sized forward is the same kernel, each row its one-row product
    xl = torch.randn(1, 130, K, generator=torch.Generator().manual_seed(2))
    yl = p(xl)
    assert torch.equal(yl[0, 77], p(xl[:, 77:78])[0, 0]) and torch.equal(yl[0, :5], p(xl[:, :5])[0])
    c = copy.deepcopy(p)
    assert c.type_name == p.type_name and torch.equal(c(x), y)


@pytest.mark.parametrize("bias", [False, True])
def test_concat_equals_the_members_side_by_side(bias):
    g = torch.Generator().manual_seed(3)
    members = [
        PackedLinear.from_kquant(
            torch.from_numpy(k_blocks(QT.Q4_K, n, 256, n)), "Q4_K", torch.randn(n, generator=g) if bias else None
        )
        for n in (96, 48, 40)
    ]
    x = torch.randn(9, 256, generator=g)
    before, nbytes = [m(x) for m in members], sum(m.nbytes for m in members)
    assert cpu_weights.can_concat(members)
    q6 = PackedLinear.from_kquant(torch.from_numpy(k_blocks(QT.Q6_K, 32, 256, 9)), "Q6_K")
    assert not cpu_weights.can_concat([members[0], q6])  # (one kernel call needs one block type)
    assert not cpu_weights.can_concat([members[0], PackedLinear(torch.randn(32, 256), None, "int8")])
    wide = PackedLinear.from_kquant(torch.from_numpy(k_blocks(QT.Q4_K, 32, 512, 9)), "Q4_K")
    assert not cpu_weights.can_concat([members[0], wide])
    whole = PackedLinear.concat(members)
    assert (whole.kind, whole.type_name, whole.out_features, whole.in_features) == (KQUANT, "Q4_K", 184, 256)
    assert whole.nbytes == nbytes == sum(m.nbytes for m in members)  # (members hold views of whole's blocks)
    assert torch.equal(whole(x), torch.cat(before, 1))
    for m, y in zip(members, before):
        assert torch.equal(m(x), y)
    xb = x[:3].bfloat16()
    assert torch.equal(whole.raw(xb), torch.cat([m.raw(xb) for m in members], 1))
    assert torch.equal(whole.dequantized(), torch.cat([m.dequantized() for m in members]))


# ---------------------------------------------------------------- loading


def test_load_kquant_keeps_the_files_blocks_and_packs_the_rest_in_the_fallback(kq_file, kq_model):
    m = kq_model
    assert m.weights == KQUANT and m.packed_head is m.lm_head
    ref = read_gguf(kq_file).tensors  # the file's values as floats
    kinds = {}
    for g, module in projections(m):
        qtype = KQ_TYPES.get(g, QT.F32)
        want = KQUANT if qtype in KEPT else fallback()
        kinds[g] = module.kind
        assert module.kind == want, g
        hf = "lm_head.weight" if g == "output.weight" else next(k for k in ref if gguf_name(k) == g)
        w, r = module.dequantized(), ref[hf]
        if want == KQUANT:
            assert module.type_name == qtype.name, g
            assert torch.equal(w, r), g  # the file's own values, bit for bit
        else:  # int8 per row: half a step of the row's largest value
            assert ((w - r).abs() <= r.abs().amax(1, keepdim=True) / 127 * 0.52 + 1e-7).all(), g
    assert len(kinds) == 2 * 7 + 1 and kinds["output.weight"] == KQUANT
    attn0, attn1 = m.layers[0].self_attn, m.layers[1].self_attn
    assert all(p.bias is not None for p in (attn0.q_proj, attn0.k_proj, attn0.v_proj, attn1.v_proj))
    # concatenations: one call for layer 0's q | k | v and gate | up, none across types in layer 1
    assert len(attn0.cpu_qkv) == 1 and attn0.cpu_qkv[0].out_features == HIDDEN + 2 * 128
    assert len(m.layers[0].mlp.cpu_gate_up) == 1 and m.layers[0].mlp.cpu_gate_up[0].type_name == "Q6_K"
    assert len(attn1.cpu_qkv) == 3 and len(m.layers[1].mlp.cpu_gate_up) == 2
    assert (attn1.v_proj.type_name, m.layers[1].mlp.up_proj.type_name) == ("Q8_0", "Q5_0")


def test_logits_are_near_the_float_model_of_the_files_values(kq_file, kq_model):
    f32 = load(kq_file, "float32")
    ids = torch.tensor([[random.Random(0).randrange(3, VOCAB) for _ in range(24)]])
    pos = torch.arange(24)[None]
    with torch.inference_mode():
        a = kq_model(ids, pos, kq_model.new_cache(1, 32))
        b = f32(ids, pos, f32.new_cache(1, 32))
    assert a.shape == b.shape == (1, 24, VOCAB)
    assert not torch.equal(a, b)  # (the activations are quantized)
    assert ((a - b).norm() / b.norm()).item() < 5e-2
    assert (a - b).abs().max() <= 5e-2 * b.abs().max()


def test_q_k_rows_of_a_llama_file_are_unpermuted_as_bytes(tmp_path):
    """llama.cpp permutes llama's Q / K rows; the loader un-permutes the raw rows of bytes it hands the
    kernel: the projections' weights equal the float load's (un-permuted) rows bit for bit."""
    path = write_mixed(tmp_path / "llama.gguf", "llama", seed=8)
    m = load(path, KQUANT)
    ref = read_gguf(path).tensors
    for name in ("q_proj", "k_proj"):
        for i in (0, 1):
            module = getattr(m.layers[i].self_attn, name)
            assert module.kind == KQUANT
            assert torch.equal(module.dequantized(), ref[f"model.layers.{i}.self_attn.{name}.weight"]), (i, name)


def test_a_tied_head_takes_the_fallback_from_the_float_embedding(tmp_path):
    path = write_mixed(tmp_path / "tied.gguf", "qwen2", seed=9, tied=True)
    m = load(path, KQUANT)
    assert m.lm_head is None and m.packed_head.kind == fallback()
    assert m.layers[0].self_attn.q_proj.kind == KQUANT


# ---------------------------------------------------------------- exactness of verification


def test_every_projection_and_a_t_token_forward_are_row_exact(kq_model, kquant_variant):
    """Each loaded projection: rows of a T-row product == one-row products. The model: a 4-token verify
    after a prefill scores each token exactly as 4 one-token decode steps would (the logits, bit for bit). In
    every build of the kernel this CPU runs."""
    g = torch.Generator().manual_seed(5)
    for name, module in projections(kq_model):
        x = torch.randn(7, module.in_features, generator=g)
        ones = torch.cat([module(x[i : i + 1]) for i in range(7)])
        assert torch.equal(module(x), ones), name
    m = kq_model
    prompt = torch.randint(3, VOCAB, (1, 20), generator=g)
    steps = torch.randint(3, VOCAB, (1, 4), generator=g)
    with torch.inference_mode():
        cache = prefilled(m, prompt, 32)
        verify = m(steps, torch.arange(20, 24)[None], cache)
        decode = decode_steps(m, cache, steps, range(20, 24))
    assert torch.equal(verify, decode)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculation_equals_greedy_ar(kq_file, kq_model, tokenizer, mode, kquant_variant):
    """Three ragged prompts batched: the kquant target's speculative greedy output equals its greedy AR
    output token for token (verify rows = decode rows), with an int4 copy of the file as the draft (γ 3
    chain, a 2×3 tree); drafts partly accepted. In every build of the kernel this CPU runs."""
    from redwood.kv.policies import FullPolicy
    from redwood.sampling_params import SamplingParams
    from redwood.speculation.drafters import ModelDrafter
    from redwood.speculation.trees import Tree, resolve_tree
    from tests.engine.driver import run_engine

    target = kq_model
    draft = load(kq_file, "int4")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    _, ar, _ = run_engine(target, tokenizer, prompts, params, max_num_seqs=3)
    tree = Tree.chain(3) if mode == "chain" else resolve_tree("chains:2x3")
    _, spec, _ = run_engine(
        target, tokenizer, prompts, params, drafter=ModelDrafter(draft, FullPolicy(), VOCAB), tree=tree, max_num_seqs=3
    )
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and len(a.output_ids) == 20
    assert 0 < sum(s.stats.spec.accepted for s in spec) < sum(s.stats.spec.drafted for s in spec)


# Every projection a type kquant keeps (Q8_0 / Q5_0 as the 0.5B draft's q, k, v, o, gate, up; Q4_K / Q6_K down and
# head), so the C++ decoder layer takes each layer (cpu_fused) with the 32-value block types in it.
ALL_KEPT = {
    **{f"blk.{i}.{n}.weight": QT.Q5_0 for i in (0, 1) for n in ("attn_q", "attn_k", "attn_output", "ffn_gate")},
    **{f"blk.{i}.{n}.weight": QT.Q8_0 for i in (0, 1) for n in ("attn_v", "ffn_up")},
    "blk.0.ffn_down.weight": QT.Q4_K,
    "blk.1.ffn_down.weight": QT.Q6_K,
    "output.weight": QT.Q8_0,
    "token_embd.weight": QT.Q5_0,
}


def test_q8_0_and_q5_0_projections_run_in_the_cpp_layers_row_exact_and_near_the_python_layers(tmp_path, kquant_variant):
    """A model whose every projection is a type kquant keeps: each layer one C++ call (Q8_0 / Q5_0 blocks in it);
    a 4-token verify scores each token bit for bit as 4 decode steps; the C++ layers' logits within float32
    rounding of the Python layers' (the same products: test_cpu_fused's tolerance) and near the float model's."""
    from redwood.config import ExecutionConfig
    from redwood.models import cpu_fused

    path = write_mixed(tmp_path / "kept.gguf", "qwen2", seed=12, types=ALL_KEPT)
    m = load(path, KQUANT)
    types = {module.type_name for _, module in projections(m)}
    assert types == {"Q4_K", "Q6_K", "Q8_0", "Q5_0"} and cpu_fused.model_takes(m)
    g = torch.Generator().manual_seed(13)
    prompt, steps = torch.randint(3, VOCAB, (1, 20), generator=g), torch.randint(3, VOCAB, (1, 4), generator=g)
    with torch.inference_mode():
        cache = prefilled(m, prompt, 32)
        verify = m(steps, torch.arange(20, 24)[None], cache)
        decode = decode_steps(m, cache, steps, range(20, 24))
        assert torch.equal(verify, decode)
        ids, pos = torch.cat([prompt, steps], 1), torch.arange(24)[None]
        fused = m(ids, pos, m.new_cache(1, 32))
        m.set_execution(ExecutionConfig(cpu_fused=False))
        try:
            plain = m(ids, pos, m.new_cache(1, 32))
        finally:
            m.set_execution(ExecutionConfig())
        f32 = load(path, "float32")
        ref = f32(ids, pos, f32.new_cache(1, 32))
    assert (fused - plain).abs().max() <= 2e-2 * plain.abs().max()
    assert ((fused - ref).norm() / ref.norm()).item() < 5e-2


# ---------------------------------------------------------------- errors


def test_kquant_errors(tmp_path, kq_file, monkeypatch):
    from tests.conftest import random_hf_model, tiny_hf_config

    random_hf_model(tiny_hf_config("qwen2")).save_pretrained(tmp_path / "hf")
    with pytest.raises(
        ConfigError,
        match="weights='kquant' keeps a GGUF file's own quantization, and .* is not a "
        ".gguf file; choose one of float32, bfloat16, int8, int4, w8a8",
    ):
        load_model(tmp_path / "hf", weights="kquant")
    with pytest.raises(ConfigError, match="draft_weights='kquant' keeps a GGUF file's own quantization"):
        cpu_weights.resolve_weights("kquant", torch.device("cpu"), tmp_path / "hf", draft=True)
    assert cpu_weights.resolve_weights("kquant", torch.device("cpu"), kq_file) == KQUANT
    f32 = load(kq_file, "float32")
    with pytest.raises(ConfigError, match="chosen as the file loads: load_model\\(path, weights='kquant'\\)"):
        f32.quantize_cpu(KQUANT)
    with pytest.raises(ConfigError, match="weights='kquant' is a CPU format"):
        cpu_weights.check_weights(KQUANT, torch.device("cuda"))
    assert cpu_weights.auto_formats(KQUANT) == (KQUANT, "w8a8", "int8", "float32")
    # where the kernel cannot run, an explicit kquant says why before any weight is read
    monkeypatch.setattr(kquant, "why_unavailable", lambda: "this CPU lacks avx512_vnni")
    with pytest.raises(
        ConfigError, match="weights='kquant' cannot be used: .*kernel.* cannot run here: this CPU lacks avx512_vnni"
    ):
        load(kq_file, KQUANT)


# ---------------------------------------------------------------- q4k: any float weight re-quantized to Q4_K


@pytest.mark.parametrize("K", [96, 256, 300])
def test_q4k_quantizes_near_the_weight_pads_with_zeros_and_is_row_exact(K):
    """quantize_q4k: a Q4_K grid within 4-bit error of the weight (min/max per 32 values), in_features
    padded with zero weights; PackedLinear "q4k" multiplies by exactly its dequantized blocks (the kernel on
    the padded input) and its rows equal one-row products at M = 1–9."""
    g = torch.Generator().manual_seed(K)
    w = torch.randn(40, K, generator=g) * 0.05
    rows = kquant.quantize_q4k(w)
    Kp = kquant.padded(K)
    assert rows.shape == (40, Kp // 256 * 144) and Kp % 256 == 0 and Kp - K < 256
    dq = dequantize(rows, "Q4_K", (40, Kp))
    # (whole padded sub-blocks are zero; one that mixes weights and padding holds 0 on its grid, which need
    # not be exactly 0 — the padded inputs are zero, so it never counts)
    assert torch.all(dq[:, -(-K // 32) * 32 :] == 0)
    assert ((dq[:, :K] - w).norm() / w.norm()).item() < 0.12
    bias = torch.randn(40, generator=g)
    m = PackedLinear(w, bias, "q4k")
    assert m.kind == "q4k" and m.in_features == K and torch.equal(m.dequantized(), dq[:, :K])
    x = torch.randn(9, K, generator=g)
    want = kquant.kquant_linear(torch.nn.functional.pad(x, (0, Kp - K)), m.kq, "Q4_K") + bias
    assert torch.equal(m(x), want)
    for M in range(1, 10):
        assert torch.equal(m(x[:M]), torch.cat([m(x[i : i + 1]) for i in range(M)]))


def test_q4k_target_and_draft_greedy_speculation_equals_greedy_ar(kq_file, tokenizer, kquant_variant):
    """A q4k target (its every projection and head re-quantized: the same kernel for verify and decode rows)
    with a q4k draft: speculative greedy == greedy AR, token for token."""
    from redwood.kv.policies import FullPolicy
    from redwood.sampling_params import SamplingParams
    from redwood.speculation.drafters import ModelDrafter
    from redwood.speculation.trees import Tree
    from tests.engine.driver import run_engine

    target = load(kq_file, "q4k")
    assert target.weights == "q4k" and target.packed_head.kind == "q4k"
    draft = load(kq_file, "q4k")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    _, ar, _ = run_engine(target, tokenizer, prompts, params, max_num_seqs=3)
    _, spec, _ = run_engine(
        target,
        tokenizer,
        prompts,
        params,
        drafter=ModelDrafter(draft, FullPolicy(), VOCAB),
        tree=Tree.chain(3),
        max_num_seqs=3,
    )
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and len(a.output_ids) == 16


def test_kquant_names_its_types_in_errors():
    with pytest.raises(ValueError, match="takes Q4_K, Q6_K, Q8_0, Q5_0 blocks, not 'Q5_K'"):
        kquant.pack(torch.zeros(1, 176, dtype=torch.uint8), "Q5_K")
