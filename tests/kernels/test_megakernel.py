"""The one-token megakernel (redwood.kernels.megakernel): which models it takes, and on a GPU of compute
capability ≥ 9 that its forwards are as close to a float64 reference as the skinny path's.

The reference runs the same bf16 weights and cache contents in float64 through the reference attention;
the megakernel's logits and new K/V must be within twice the skinny path's error of it (plus a small
floor), for dense and paged caches (pages out of order), contexts on both sides of its 32-key chunks and
of its 32-split cap (warps walking several chunks), a pending draft token, a row that is not live, int8
weights, and a CUDA-graph replay; each check asserts the megakernel ran.
"""

from __future__ import annotations

import pytest
import torch

from redwood.config import ExecutionConfig, ModelConfig
from redwood.errors import ConfigError
from redwood.kernels import megakernel
from tests.conftest import decode_tokens

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the megakernel needs a GPU of compute capability >= 9",
)

SHAPES = {  # (hidden, heads, kv heads) → head_dim 128 / G 2, head_dim 64 / G 8, head_dim 128 / G 6
    "d128g2": (512, 4, 2),
    "d64g8": (512, 8, 1),
    "d128g6": (768, 6, 1),
}


def _config(name: str, layers: int = 2, tie: bool = True) -> ModelConfig:
    hidden, heads, kv = SHAPES[name]
    return ModelConfig.from_hf_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 2048,
            "hidden_size": hidden,
            "intermediate_size": 1024,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e4,
            "tie_word_embeddings": tie,
        }
    )


def _models(cfg: ModelConfig, int8: bool = False):
    """(bf16 model with fused projections, float64 copy of the same weights). int8: the model also gets
    quantize_skinny's int8 copies, and the copy holds their dequantized values (q · row scale) instead."""
    from redwood.models.transformer import Transformer, build_model

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {k: (torch.randn(s, device="cuda", generator=g) * 0.05).to(torch.bfloat16) for k, s in shapes.items()}
    for k in state:
        if k.endswith("norm.weight"):
            state[k] = (1 + state[k].float()).to(torch.bfloat16)
    model = build_model(cfg, state, torch.bfloat16, "cuda")
    model.set_execution(ExecutionConfig())
    ref_state = {k: v.double() for k, v in state.items()}
    if int8:
        from redwood.kernels.gemv import quantize_int8

        model.quantize_skinny()
        for k, v in state.items():  # per-row quantization: the same rows whether q/k/v are fused or not
            if k.endswith("proj.weight") or k == "lm_head.weight":
                q, scale = quantize_int8(v)
                ref_state[k] = q.double() * scale.double()[:, None]
    ref = build_model(cfg, ref_state, torch.float64, "cuda")
    ref.set_execution(ExecutionConfig(attention="reference", kernels="off"))
    return model, ref


def _cache(model, context: int, paged: bool, dtype=torch.bfloat16, seed: int = 1):
    from redwood.kv.cache import KVCache

    cfg = model.config
    cap = context + 64
    if paged:
        pages = -(-cap // 64)
        cache = KVCache.paged(cfg, 1, pages, 64, cap, dtype, "cuda")
        g = torch.Generator(device="cpu").manual_seed(seed)
        cache.block_table[0, :pages] = torch.randperm(pages, generator=g).to(torch.int32).cuda()
        cache.live.fill_(1)
    else:
        cache = KVCache(cfg, 1, cap, dtype, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, device="cuda").to(torch.bfloat16))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, device="cuda").to(torch.bfloat16))
    cache.lengths.fill_(context)
    return cache


def _as64(cache):
    """A copy of `cache` in float64 (its own table, lengths and live)."""
    from redwood.kv.cache import KVCache

    out = KVCache.__new__(KVCache)
    out.__dict__.update(cache.__dict__)
    out.k, out.v = cache.k.double(), cache.v.double()
    out.block_table, out.lengths, out.live = cache.block_table.clone(), cache.lengths.clone(), cache.live.clone()
    return out


def _new_kv(cache, slot: int) -> torch.Tensor:
    ps = cache.k.shape[3]
    page = int(cache.block_table[0, slot // ps])
    return torch.stack([cache.k[:, page, :, slot % ps], cache.v[:, page, :, slot % ps]]).double()


def _check(model, ref, cache, ids, pending: int = 0):
    """Megakernel and skinny forwards on copies of `cache` against the float64 reference."""
    slot = int(cache.lengths[0]) + pending
    pos = torch.tensor([[slot]], device="cuda")
    c64 = _as64(cache)
    want = ref(ids, pos, c64, pending=pending)
    kv_want = _new_kv(c64, slot)
    got = {}
    for name, mega in (("skinny", None), ("mega", megakernel.MegaForward(model, int8=model.skinny_int8))):
        c = _as64(cache)
        c.k, c.v = cache.k.clone(), cache.v.clone()
        model.backend.set_megakernel(mega)
        logits = model(ids, pos, c, pending=pending)
        got[name] = ((logits.double() - want).abs().max().item(), (_new_kv(c, slot) - kv_want).abs().max().item())
        if mega is not None:
            assert mega.launches == 1 and mega.error() == 0  # (it ran: a forward it did not take would pass too)
    model.backend.set_megakernel(None)
    scale = want.abs().max().item()
    for i, what in enumerate(("logits", "new K/V")):
        assert got["mega"][i] <= 2 * got["skinny"][i] + 2e-3 * (scale if i == 0 else 1), (what, got)


def test_misfits_are_named():
    from redwood.models.transformer import Transformer

    model = Transformer(_config("d128g2"))  # float32 on the CPU
    assert megakernel.misfit(model) == "not on CUDA"
    with pytest.raises(ConfigError, match="megakernel cannot run this model: not on CUDA"):
        model.set_execution(ExecutionConfig(megakernel="on"))
    model.set_execution(ExecutionConfig(megakernel="off"))
    assert getattr(model.backend, "megakernel", None) is None
    model.set_execution(ExecutionConfig())  # "auto": where it fits, so not here
    assert getattr(model.backend, "megakernel", None) is None


def _hf(**over) -> ModelConfig:
    base = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
    }
    return ModelConfig.from_hf_dict({**base, **over})


def test_shapes_it_takes_and_the_down_tile():
    qwen_1_5b = _hf()
    qwen_0_5b = _hf(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    llama_8b = _hf(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    for cfg in (qwen_1_5b, qwen_0_5b, llama_8b):
        assert megakernel.config_misfit(cfg) is None
    # the down tile: as many rows as fit the slot the 8-row tiles of the other stages need, in whole K chunks
    assert megakernel.down_rows(qwen_1_5b) == 1  # one 8960-wide row (17.5 KB) in a 24 KB slot
    assert megakernel.down_rows(qwen_0_5b) == 1  # 14 KB slots (8 rows of 896): two 4864-wide rows do not fit
    assert megakernel.down_rows(_config("d128g2")) == 4


def test_shapes_it_does_not_take_are_named():
    assert "head_dim 96" in megakernel.config_misfit(_hf(hidden_size=1152))  # 12 heads of 96
    assert "whole number ≤ 8" in megakernel.config_misfit(_hf(num_attention_heads=12, num_key_value_heads=1))
    assert "sliding-window" in megakernel.config_misfit(
        _hf(model_type="mistral", use_sliding_window=True, sliding_window=4096)
    )
    assert "multiples of 8 / 32 / 8" in megakernel.config_misfit(_hf(intermediate_size=8968))
    assert "multiples of 8 / 32 / 8" in megakernel.config_misfit(_hf(vocab_size=151937))


def test_layout_on_an_h200():
    """The layouts the H200 runs measured (132 SMs, 227 KB a block): 8 ring slots of 24 KB (1.5B) / 14 KB (0.5B)."""
    qwen_1_5b = _hf()
    d, smem = megakernel.layout(qwen_1_5b, 64, 132, 232448)
    assert (d["NSLOT"], d["SLOT"], d["RD"], d["NB"], d["D"], d["PS"]) == (8, 24576, 1, 132, 128, 64)
    assert smem == 8 * (24576 + 52) + 4 * 128 + 16 + 8 * 6 * 128 * 4 + 8 * 32 * 8 * 4 <= 232448  # 8-head P rows
    qwen_0_5b = _hf(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    d, _ = megakernel.layout(qwen_0_5b, 64, 132, 232448)
    assert (d["NSLOT"], d["SLOT"], d["RD"], d["D"]) == (8, 14336, 1, 64)
    d, smem2 = megakernel.layout(qwen_1_5b, 64, 132, 232448, extra=megakernel.parse_defines("NSLOT=2 ATTN_CPB=16"))
    assert d["NSLOT"] == "2" and d["ATTN_CPB"] == "16"
    assert smem2 == 2 * (24576 + 52) + 4 * 128 + 16 + 8 * 6 * 128 * 4 + 8 * 32 * 8 * 4
    with pytest.raises(RuntimeError, match="fewer than two"):
        megakernel.layout(qwen_1_5b, 64, 132, 48 * 1024)
    # a slot also holds a chunk of 32 keys' K and V rows (the K/V ring), which outgrows a small model's tiles
    d, _ = megakernel.layout(_config("d128g2"), 64, 132, 232448)
    assert d["SLOT"] == 2 * 32 * 128 * 2 > 8 * 512 * 2
    # int8 weights (W8): tiles of a byte an element; a slot still holds a K/V chunk (16 KB at head_dim 128)
    d, _ = megakernel.layout(qwen_0_5b, 64, 132, 232448, int8=True)
    assert (d["W8"], d["SLOT"], d["RD"], d["NSLOT"]) == (1, 8192, 1, 8)
    d, _ = megakernel.layout(qwen_1_5b, 64, 132, 232448, int8=True)
    assert (d["W8"], d["SLOT"], d["RD"]) == (1, 16384, 1)
    assert megakernel.layout(qwen_1_5b, 64, 132, 232448)[0]["W8"] == 0


def test_experiment_defines():
    """A benchmark's experiment #defines (megakernel_bench.py --variants) parse; nothing in the environment or
    the library's settings reaches them."""
    assert megakernel.parse_defines("NSLOT=2 ATTN_CPB=16 ATTN_NO_MERGE") == {
        "NSLOT": "2",
        "ATTN_CPB": "16",
        "ATTN_NO_MERGE": "1",
    }
    assert megakernel.parse_defines("") == {}
    with pytest.raises(ValueError, match="not NAME or NAME=VALUE"):
        megakernel.parse_defines("2=NSLOT")
    assert not hasattr(megakernel, "experiment_defines")


def test_which_forwards_it_takes():
    from redwood.kv.cache import KVCache

    cfg = _config("d128g2")
    bf16, f32 = (KVCache(cfg, 1, 64, dt, "cpu") for dt in (torch.bfloat16, torch.float32))
    one, two = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)
    assert megakernel.MegaForward.takes(one, bf16, None, None, None)
    assert not megakernel.MegaForward.takes(two, bf16, None, None, None)  # a verify / prefill
    assert not megakernel.MegaForward.takes(torch.zeros(2, 1, dtype=torch.long), bf16, None, None, None)  # batch 2
    assert not megakernel.MegaForward.takes(one, f32, None, None, None)
    assert not megakernel.MegaForward.takes(one, bf16, torch.ones(1, 1, dtype=torch.bool), None, None)  # a tree mask
    assert not megakernel.MegaForward.takes(one, bf16, None, object(), None)  # a compressed view
    assert not megakernel.MegaForward.takes(one, bf16, None, None, object())  # an observer
    two_rows = KVCache(cfg, 2, 64, torch.bfloat16, "cpu")
    assert not megakernel.MegaForward.takes(one, two_rows, None, None, None)  # one row of a larger cache


def test_taken_only_with_the_skinny_path_on(monkeypatch):
    """The CUDA backend hands a one-token forward to the megakernel only while its skinny path is on (off: the
    cuBLAS A/B path must measure cuBLAS), and only forwards it takes. (On the CPU: the backend taken with
    kernels="on", its Triton kernels switched off so that other forwards run the plain layers.)"""
    from redwood.kv.cache import KVCache
    from redwood.models.transformer import Transformer

    class Recorder:
        calls = 0

        @staticmethod
        def takes(*args):
            return megakernel.MegaForward.takes(*args)

        def forward(self, ids, pos, cache, pending=0):
            self.calls += 1
            return torch.zeros(1, 1, cfg.vocab_size)

    cfg = _config("d128g2")
    model = Transformer(cfg).to(torch.bfloat16)
    model.set_execution(ExecutionConfig(kernels="on", skinny=False))
    monkeypatch.setattr(model.backend, "kernels", False)  # (no Triton interpreter: the plain layers)
    model.backend.set_megakernel(mega := Recorder())
    cache = KVCache(cfg, 1, 64, torch.bfloat16, "cpu")
    one = torch.zeros(1, 1, dtype=torch.long)
    model(one, one, cache)  # skinny off
    assert mega.calls == 0
    model.set_execution(ExecutionConfig(kernels="on"))
    model.backend.set_megakernel(mega)
    assert torch.equal(model(one, one, cache), torch.zeros(1, 1, cfg.vocab_size))
    assert mega.calls == 1


def test_a_build_failure_falls_back_to_the_other_path(monkeypatch):
    """A GPU whose shared memory cannot hold the ring, or an NVRTC that refuses the source: the first forward
    warns, drops the megakernel and returns the other path's logits (nothing has run when the build fails)."""
    from redwood.kv.cache import KVCache
    from redwood.models.transformer import Transformer

    def no_build(*args, **kwargs):
        raise RuntimeError("megakernel: shared memory 101376 B holds fewer than two 24576 B weight tiles")

    monkeypatch.setattr(megakernel, "_kernel", no_build)
    torch.manual_seed(0)
    model = Transformer(_config("d128g2")).to(torch.bfloat16)
    mega = megakernel.MegaForward.__new__(megakernel.MegaForward)  # (no buffers: the build is all that runs)
    mega.model, mega.profile, mega._kernels, mega.int8, mega.defines = model, False, {}, None, {}
    model.set_execution(ExecutionConfig(kernels="on"))  # (the megakernel is taken only with the skinny path on)
    monkeypatch.setattr(model.backend, "kernels", False)  # (no Triton interpreter: the layers run plain)
    model.backend.set_megakernel(mega)
    ids = torch.tensor([[7]])
    caches = [KVCache(model.config, 1, 64, torch.bfloat16, "cpu") for _ in range(2)]
    with pytest.warns(UserWarning, match="could not be built for this model .*fewer than two"):
        got = model(ids, ids * 0, caches[0])
    assert model.backend.megakernel is None
    assert torch.equal(got, model(ids, ids * 0, caches[1]))


def test_on_unless_turned_off():
    assert ExecutionConfig().megakernel == "auto"
    assert ExecutionConfig(megakernel="off").megakernel == "off"
    with pytest.raises(ConfigError, match="execution megakernel='yes': choose one of auto, on, off"):
        ExecutionConfig(megakernel="yes")


def test_offloaded_layers_drop_it():
    """offload_layers points layer weights at host buffers and per-layer slots: the megakernel's pointer table
    would read neither, so the model loses it, and misfit names why."""
    from redwood.models.offload import offload_layers
    from redwood.models.transformer import Transformer

    model = Transformer(_config("d128g2"))
    model.set_execution(ExecutionConfig(kernels="on"))
    model.backend.set_megakernel(object())  # (as the CUDA backend leaves a fitting CUDA model)
    offload_layers(model, prefetch=1)
    assert model.backend.megakernel is None
    assert megakernel.misfit(model).startswith("layers offloaded")


@hopper
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("paged", [False, True])
def test_forward_is_as_close_to_float64_as_the_skinny_path(shape, paged):
    model, ref = _models(_config(shape))
    assert megakernel.misfit(model) is None
    g = torch.Generator(device="cuda").manual_seed(2)
    # chunk edges; 33-256 chunks: a block per 8 chunks; 9000 keys: past SMAX splits, so warps walk several chunks
    for context in (0, 1, 31, 32, 33, 200, 1100, 9000):
        cache = _cache(model, context, paged)
        ids = torch.randint(0, model.config.vocab_size, (1, 1), device="cuda", generator=g)
        _check(model, ref, cache, ids)


@hopper
def test_pending_token_and_a_row_that_is_not_live():
    model, ref = _models(_config("d128g6"))
    cache = _cache(model, 70, paged=True)
    ids = torch.tensor([[5]], device="cuda")
    _check(model, ref, cache, ids, pending=2)  # slots 70, 71 hold earlier drafts; the token goes to 72
    cache.live.fill_(0)
    _check(model, ref, cache, ids)  # attends only to itself


@hopper
def test_int8_weights_are_as_close_to_float64_as_the_skinny_path():
    """quantize_skinny's int8 copies (a draft model's): the megakernel's W8 build against float64 over the
    dequantized weights, next to the skinny path's int8 kernels; the head untied (int8) from the embedding."""
    model, ref = _models(_config("d128g2", tie=False), int8=True)
    assert megakernel.misfit(model) is None
    g = torch.Generator(device="cuda").manual_seed(3)
    for context, paged in ((0, False), (33, True), (300, True), (1100, False)):
        cache = _cache(model, context, paged)
        ids = torch.randint(0, model.config.vocab_size, (1, 1), device="cuda", generator=g)
        _check(model, ref, cache, ids)
    _check(model, ref, _cache(model, 70, paged=True), torch.tensor([[5]], device="cuda"), pending=2)


@hopper
def test_quantizing_a_model_rebuilds_its_megakernel():
    """quantize_skinny after the megakernel was taken (a draft loaded, then made int8): the bf16 build must not
    run on against int8 pointer tables; the model's forwards go through a fresh W8 build."""
    model, _ = _models(_config("d128g2"))
    assert model.backend.megakernel is not None  # the CUDA backend gave it one (on by default)
    bf16_build = model.backend.megakernel
    model.quantize_skinny()
    mega = model.backend.megakernel
    assert mega is not None and mega is not bf16_build
    cache = _cache(model, 40, paged=True)
    model(torch.tensor([[3]], device="cuda"), torch.tensor([[40]], device="cuda"), cache)
    assert mega.launches == 1 and mega.error() == 0
    assert mega._kernels[64][2]["W8"] == 1


@hopper
def test_graph_replays_equal_eager_launches():
    from redwood.engine.runner import StepRunner

    model, _ = _models(_config("d128g2", layers=3))
    model.set_execution(ExecutionConfig(megakernel="on"))
    ids = torch.randint(0, model.config.vocab_size, (1, 6), device="cuda")

    def run(graphs: bool):
        cache = _cache(model, 90, paged=True)
        return decode_tokens(StepRunner(model, cache, use_graphs=graphs), cache, ids)

    eager, graphed = run(False), run(True)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    assert model.backend.megakernel.launches > 0 and model.backend.megakernel.error() == 0


def test_timeline_reads_the_profile_stamps():
    """timeline() (host arithmetic over a profiling launch's stamps): per stage kind, mean over layers of the
    wait from the previous stage's last block to the median start, the median and the slowest block's work,
    the span, and the median consumer / producer slot waits."""
    n_layers, n_blocks = 2, 3
    prof = torch.zeros(6 * n_layers + 1, n_blocks, 8, dtype=torch.int64)
    t = 0
    for s in range(prof.shape[0]):
        if s % 6 == 2 and s != prof.shape[0] - 1:
            continue  # counter 2 of a layer is unused
        t += 1000  # every stage starts 1 µs after the previous one ends
        for b in range(n_blocks):
            prof[s, b, 0] = t + 100 * b
            prof[s, b, 1] = t + 100 * b + 2000 + (1000 if b == n_blocks - 1 else 0)  # the last block 1 µs slower
            prof[s, b, 2] = 300 * (b + 1)
            prof[s, b, 3] = 50 * (b + 1)
        t += 3000 + 100 * (n_blocks - 1)
    mf = object.__new__(megakernel.MegaForward)
    mf.prof = prof
    tl = mf.timeline()
    assert set(tl) == {"qkv", "attention", "o", "gate/up", "down", "head", "total"}
    for kind in ("attention", "o", "gate/up", "down", "head"):
        assert tl[kind]["wait"] == pytest.approx(1.1)  # median block starts 1.1 µs after the last one ended
        assert tl[kind]["work"] == pytest.approx(2.0)
        assert tl[kind]["max"] == pytest.approx(3.0)
        assert tl[kind]["span"] == pytest.approx(3.2)
        assert tl[kind]["starve"] == pytest.approx(0.6)
        assert tl[kind]["stall"] == pytest.approx(0.1)
    assert tl["total"]["span"] == pytest.approx((int(prof[-1, :, 1].max()) - int(prof[0, :, 0].min())) / 1e3)


def test_attention_phases_read_the_slowest_key_blocks_stamps():
    """attention_phases() (host arithmetic): per layer, the slowest of the blocks that stamped key chunks (slot 4 > 0),
    split at its phase stamps; with one split (no count stamped) the merge phase runs from the warps' stamp; blocks
    without keys are ignored; mean over layers."""
    n_layers, n_blocks = 2, 4
    prof = torch.zeros(6 * n_layers + 1, n_blocks, 8, dtype=torch.int64)
    for layer in range(n_layers):
        s = 6 * layer + 1
        prof[s, :, 0], prof[s, :, 1] = 10_000, 10_300  # every block: 0.3 µs (no keys)
        # block 1: keys, two splits, 9 µs: chunks 2, warps 1, block merge 0.5, count 1.5, merge 4
        prof[s, 1, :] = torch.tensor([10_000, 19_000, 0, 0, 12_000, 13_000, 13_500, 15_000])
        # block 2: keys, a faster block (ignored: not the slowest)
        prof[s, 2, :] = torch.tensor([10_000, 12_000, 0, 0, 11_000, 11_500, 11_600, 11_800])
    prof[7, 1, 6:] = 0  # layer 1's slowest key block has one split instead: no count stamped
    mf = object.__new__(megakernel.MegaForward)
    mf.prof = prof
    ph = mf.attention_phases()
    assert ph["chunks"] == pytest.approx(2.0)
    assert ph["warps"] == pytest.approx(1.0)
    assert ph["block merge"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert ph["count"] == pytest.approx(0.75)  # (1.5 + 0) / 2
    assert ph["merge"] == pytest.approx((4.0 + 6.0) / 2)  # one split: from the warps' stamp (13 µs) to the end
    prof[:, :, 4] = 0  # no block held keys
    assert mf.attention_phases() == {}


def test_source_is_its_parts_in_order():
    """The kernel's source: megakernel_cu's five parts, each once, in dependency order, each after a #line
    marker (NVRTC's errors then name the part and its line)."""
    src = megakernel.source()
    marks = [src.index(f'#line 1 "{name}"\n') for name in megakernel._PARTS]
    assert marks == sorted(marks) and marks[0] == 0 and len(set(marks)) == 5
    assert src.count('extern "C" __global__') == 1 and src.index("redwood_decode_forward") > marks[-1]
