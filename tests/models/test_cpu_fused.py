"""The C++ decoder layer (redwood.models.cpu_fused, cpu_kernels/layer.cpp): a kquant-kind model's layers as one
call each on the CPU.

Against the Python layers (backends.cpu_packed.packed_layer, the same kquant products) for every forward shape the
path takes — a short prefill, decode, a chain verify after pending draft tokens, a tree verify, a ragged batch
with a finished row, a sliding window, a paged cache, a long prefill chunk (the plain layers' path before) — within float32 rounding of the non-matmul ops (their
sums run in another order); a T-token verify (chain or tree) scores each token bit for bit as the decode
steps it stands for; each in every build of the layer this CPU runs (`kquant_variant`), and every build the same
logits bit for bit; which forwards take the path; the op's argument errors. Greedy speculation == AR through
the Engine on a q4k target and draft: tests/models/test_cpu_kquant.py.
"""

from __future__ import annotations

import pytest
import torch

from redwood.config import ExecutionConfig
from redwood.cpu_kernels import kquant
from redwood.loading import load_model
from redwood.models import cpu_fused, cpu_weights
from tests.conftest import random_hf_model, tiny_hf_config
from tests.models.test_cpu_kquant import decode_steps, prefilled

pytestmark = pytest.mark.skipif(
    not kquant.available(), reason=f"kquant kernel unavailable here: {kquant.why_unavailable()}"
)

VOCAB = 320


def q4k_model(tmp_path, arch: str, **overrides):
    """A tiny random HF model of `arch` (Qwen2: q/k/v biases) loaded with every projection as Q4_K."""
    cfg = tiny_hf_config(
        arch,
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=320,
        num_attention_heads=4,
        num_key_value_heads=2,
        **overrides,
    )
    random_hf_model(cfg, seed=3).save_pretrained(tmp_path / arch)
    model = load_model(tmp_path / arch, weights="q4k").model
    assert cpu_fused.model_takes(model)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {arch: q4k_model(root, arch) for arch in ("llama", "qwen2")}


def run(model, fused: bool, monkeypatch, steps):
    """Apply `steps` (callables of (model, cache) returning logits) with the C++ layers on or off → logits."""
    model.set_execution(ExecutionConfig(cpu_fused=fused))
    try:
        with torch.inference_mode():
            return steps(model)
    finally:
        model.set_execution(ExecutionConfig())


def ids(*shape, seed=0):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def scenario(name: str):
    """A named sequence of forwards → the logits of each, concatenated along the tokens."""

    def prefill(m, cache, B=1, n=9):
        out = m(ids(B, n), torch.arange(n).expand(B, n), cache)
        cache.commit(n)
        return out

    def steps(m):
        if name == "decode":
            cache = m.new_cache(1, 40)
            outs = [prefill(m, cache)]
            for t in range(3):
                outs.append(m(ids(1, 1, seed=t + 1), torch.tensor([[9 + t]]), cache))
                cache.commit(1)
            return torch.cat(outs, 1)
        if name == "chain_after_pending":  # two pending draft tokens, then a 3-token forward after them
            cache = m.new_cache(1, 40)
            a = prefill(m, cache)
            b = m(ids(1, 2, seed=4), torch.tensor([[9, 10]]), cache)
            c = m(ids(1, 3, seed=5), torch.tensor([[11, 12, 13]]), cache, pending=2)
            return torch.cat([a, b, c], 1)
        if name == "tree":  # node 0 → children 1, 2; node 1 → child 3
            cache = m.new_cache(1, 40)
            a = prefill(m, cache)
            mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
            b = m(ids(1, 4, seed=6), torch.tensor([[9, 10, 10, 11]]), cache, new_mask=mask)
            return torch.cat([a, b], 1)
        if name == "ragged_batch_with_a_finished_row":
            cache = m.new_cache(3, 40)
            a = prefill(m, cache, B=3)
            cache.commit(torch.tensor([0, 2, 5]))  # rows 9, 11, 14 tokens long
            cache.live[1] = 0
            pos = cache.lengths[:, None] + torch.arange(2)
            b = m(ids(3, 2, seed=7), pos, cache)
            return torch.cat([a, b], 1)
        if name == "long_prefill":  # a prefill chunk past the packed gemm paths' rows, then decode steps
            cache = m.new_cache(1, 160)
            outs = [prefill(m, cache, n=150)]
            for t in range(2):
                outs.append(m(ids(1, 1, seed=t + 9), torch.tensor([[150 + t]]), cache))
                cache.commit(1)
            return torch.cat(outs, 1)
        if name == "paged":
            from redwood.kv.cache import KVCache

            cache = KVCache.paged(m.config, 2, 13, 4, 40, m.dtype, "cpu")
            cache.block_table[0, :10] = torch.tensor([7, 2, 9, 0, 1, 3, 4, 5, 6, 8])
            cache.block_table[1, :3] = torch.tensor([10, 11, 12])
            cache.live.fill_(1)
            a = prefill(m, cache, B=2, n=6)
            b = m(ids(2, 3, seed=8), torch.tensor([[6, 7, 8]] * 2), cache)
            return torch.cat([a, b], 1)
        raise ValueError(name)

    return steps


SCENARIOS = ["decode", "chain_after_pending", "tree", "ragged_batch_with_a_finished_row", "paged", "long_prefill"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_the_cpp_layers_match_the_python_layers(models, arch, name, monkeypatch, kquant_variant):
    """Same logits as packed_layer up to float32 rounding of norms / rotary / softmax / SiLU, which sum in
    another order (~1e-6 here). Now and then such a last bit sends an int8 activation to the neighbouring
    integer (a step of max|x| / 127 in that value), which the following layers of a random model carry to
    ~1% of the logits' scale (seen once in these cases: 0.054 of 5.7, the same in a decode along the path) —
    hence 2%; a wrong key, position, bias or cache slot moves them by tens of percent. Argmax equal wherever
    the reference's top two are further apart than twice that."""
    m = models[arch]
    steps = scenario(name)
    want = run(m, False, monkeypatch, steps)
    got = run(m, True, monkeypatch, steps)
    assert got.shape == want.shape
    tol = 2e-2 * want.abs().max()
    assert (got - want).abs().max() <= tol, (got - want).abs().max() / want.abs().max()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tol
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_a_sliding_window_model_matches_too(tmp_path, monkeypatch):
    m = q4k_model(tmp_path, "mistral", sliding_window=5)
    steps = scenario("decode")
    want, got = run(m, False, monkeypatch, steps), run(m, True, monkeypatch, steps)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_verify_scores_each_token_exactly_as_decode_steps(models, arch, kquant_variant):
    """Bit for bit: a 4-token chain verify == 4 decode steps; a tree verify's nodes == decode along their path
    (a node's keys then sit in other slots and come as two ranges — the same values in the same order)."""
    m = models[arch]
    prompt, toks = ids(1, 11, seed=1), ids(1, 4, seed=2)
    with torch.inference_mode():
        cache = prefilled(m, prompt, 40)
        verify = m(toks, torch.arange(11, 15)[None], cache)
        assert torch.equal(verify, decode_steps(m, cache, toks, range(11, 15)))
        # tree: node 0 → 1, 2; node 2 → 3. Node 3's path is 0, 2, 3.
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        tree = m(toks, torch.tensor([[11, 12, 12, 13]]), prefilled(m, prompt, 40), new_mask=mask)
        path = decode_steps(m, prefilled(m, prompt, 40), toks[:, [0, 2, 3]], (11, 12, 13))
    assert torch.equal(tree[:, [0, 2, 3]], path)


def test_which_forwards_take_the_cpp_layers(models, tmp_path, monkeypatch):
    calls = []
    real = cpu_fused.run_layers
    monkeypatch.setattr(cpu_fused, "run_layers", lambda *a: calls.append(1) or real(*a))
    m = models["qwen2"]

    def forward(model, n, **kw):
        calls.clear()
        with torch.inference_mode():
            model(ids(1, n), torch.arange(n)[None], model.new_cache(1, 128), **kw)
        return bool(calls)

    assert forward(m, 1) and forward(m, 80) and forward(m, 81) and forward(m, 128)  # prefill chunks too
    assert cpu_fused.takes_every_forward(m)
    assert not forward(m, 4, observer=lambda *a: None)  # SnapKV's scores
    view = lambda layer: (torch.zeros(1, 1, 1, dtype=torch.long), torch.ones(1, 1, 1, dtype=torch.bool))
    assert not forward(m, 1, view=view)  # a compressed draft view
    m.set_execution(ExecutionConfig(cpu_fused=False))
    assert not forward(m, 1) and not cpu_fused.takes_every_forward(m)
    m.set_execution(ExecutionConfig())
    random_hf_model(tiny_hf_config("llama", vocab_size=VOCAB)).save_pretrained(tmp_path / "f")
    assert not cpu_fused.model_takes(load_model(tmp_path / "f").model)  # float32: not a kquant kind
    if cpu_weights.w8a8_exact():  # (w8a8 loads where fbgemm's sums are exact: AVX512-VNNI)
        assert not cpu_fused.model_takes(load_model(tmp_path / "f", weights="w8a8").model)


# The op's checks guard the Python glue's own arguments (users never call it directly), run in a child process:
# on a torch build where an extension's exception kills the process (redwood.cpu_kernels.kquant's docstring),
# this fails alone instead of ending the session.
OP_CHECKS = r"""
import tempfile
from pathlib import Path
import torch
from redwood.cpu_kernels import kquant
from redwood.models import cpu_fused
from tests.models.test_cpu_fused import q4k_model
m = q4k_model(Path(tempfile.mkdtemp()), "llama")
w, types, biases, groups, n1, n2, eps = cpu_fused.layer_args(m.layers[0])
cache = m.new_cache(1, 8)
x, cs = torch.zeros(1, 128), torch.zeros(1, 32)
good = dict(cos=cs, types=types, ranges=torch.tensor([[0, 1]]), write_at=torch.zeros(1, 2, dtype=torch.long))
def call(**kw):
    a = {**good, **kw}
    try:
        kquant.ops().decoder_layer(x, w, a["types"], biases, groups, n1, n2, eps, a["cos"], a["cos"],
                                   cache.k[0], cache.v[0], a["write_at"], cache.block_table, 1,
                                   torch.tensor([0, 1]), a["ranges"], 4, 2)
        print("ran")
    except RuntimeError as e:
        print(str(e).splitlines()[0])
call()
call(cos=torch.zeros(1, 16))
call(types=[7] * len(types))
call(ranges=torch.tensor([[0, 9]]))
call(write_at=torch.tensor([[0, 8]]))
"""


def test_the_op_rejects_bad_arguments():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", OP_CHECKS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()[-5:]
    assert lines[0] == "ran"
    assert "cos / sin must be [1, 32]" in lines[1]
    assert "type must be Q4_K (12), Q6_K (14), Q8_0 (8) or Q5_0 (6), got 7" in lines[2]
    assert "key range [0, 9) of token 0 is outside its 8 slots" in lines[3]
    assert "write position of token 0 is outside the cache" in lines[4]


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_cpp_layers_give_the_same_bits_at_1_and_2_threads(models, name, monkeypatch, kquant_variant):
    """What lets the Engine pick each decode step's thread count as it runs (engine.threads.AdaptiveThreads):
    the kquant rows and the (token, head) attention tasks are split among threads, never a sum."""
    steps = scenario(name)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(models["qwen2"], True, monkeypatch, steps)
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        two = run(models["qwen2"], True, monkeypatch, steps)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_build_gives_the_same_logits(models, name, monkeypatch):
    """The layer's norms, rotary, exp, softmax and SiLU, and the kquant products, are the same IEEE operations in
    the same order in every build (kq_simd.h): the logits agree bit for bit, not just within rounding."""
    names = [v for v in kquant.supported() if kquant.variant_unavailable(v) is None]
    if len(names) < 2:
        pytest.skip(f"one kquant build runs here ({names})")
    logits = {}
    for arch in ("llama", "qwen2"):
        for v in names:
            monkeypatch.setenv("REDWOOD_CPU_KERNEL", v)
            assert kquant.variant() == v
            logits[arch, v] = run(models[arch], True, monkeypatch, scenario(name))
        for v in names[1:]:
            assert torch.equal(logits[arch, v], logits[arch, names[0]]), (arch, v)
