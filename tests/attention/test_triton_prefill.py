"""The Triton prefill attention kernel (attention.triton_prefill) against the reference path in float64.

The reference is the project's own: `reference.read_kv` (through a real paged `KVCache` holding the same
values in float64) + `reference.attention`, with the `AttentionMetadata` a plain prefill forward builds
(lengths, T, live, q_positions, sliding_window). Bounds, per element of every real token:
    |out − ref| ≤ c · u · (|ref| + P|V|)
with u the unit roundoff of the dtype (2^-9 bf16, 2^-11 fp16, 2^-24 fp32), P|V| the attention of the
absolute values (the scale of the rounding of P before the PV product), c = 4 for 16-bit dtypes (output
rounding: ≤ 1 ulp — the interpreter truncates where CUDA rounds to nearest — plus P's rounding) and 256
for fp32 (IEEE dots; sums over D and over the keys); and the decode tests' relative norm bounds (1e-2,
1e-5). The output is poisoned (NaN) before each call: every element, padding tokens too, must be written
and finite. Cache slots the kernel must not read hold NaN: slots at and past L_b + T of a row's pages,
pages no row owns (the table's unused entries name one), and a finished row's context.

Cases: GQA G = 1, 2, 6 at head dim 64 and 128; page sizes 64 and 128 (one table lookup per key tile), 48
and 16 and the dense layout (page_size = capacity: per-key lookups); context lengths 0 and not multiples of
the key tile; T not a multiple of the query tile; the ragged batches `engine.prefill.prefill_rows` makes
(chunks right-padded to the longest: padding tokens' K/V in the row's own pages past its chunk or on the
shared trash page); sliding windows (Mistral); finished rows (live 0); fp32 / bf16 / fp16, int32 / int64
tables; several tile configurations; and a tiny model's batched prefill through `prefill_rows` with the
kernel on vs the reference backend.

Where they run: on CUDA in this process; on the CPU through Triton's interpreter in a child pytest run
of this file (`test_interpreter_suite`, as tests/attention/test_triton_decode.py). Cases marked
`cuda_only` (long contexts) run only on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from redwood.attention import reference  # noqa: E402
from redwood.attention import triton_prefill as tp  # noqa: E402
from redwood.config import ModelConfig  # noqa: E402
from redwood.kv.cache import KVCache  # noqa: E402
from tests.conftest import import_without_triton, interpreter_broken, run_in_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
UNIT = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
ULPS = {torch.bfloat16: 4, torch.float16: 4, torch.float32: 256}
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}

needs_kernel = pytest.mark.skipif(
    DEVICE is None, reason="no CUDA device (the interpreter runs these in test_interpreter_suite)"
)
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="long contexts: CUDA only (too slow in the interpreter)")

if INTERPRET and (why := interpreter_broken()):
    pytest.skip(why, allow_module_level=True)

SMALL_TILES = dict(BLOCK_M=32, BLOCK_N=16)  # many tiles (and diagonal tiles) at interpreter sizes


# ----------------------------------------------------------------------------------------------------
# A paged cache as the Engine holds it, and the float64 reference


def layer_config(Hq: int, Hkv: int, D: int) -> ModelConfig:
    return ModelConfig(
        arch="qwen2",
        vocab_size=16,
        hidden_size=Hq * D,
        intermediate_size=16,
        num_layers=1,
        num_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
    )


class Case:
    """One prefill forward's attention inputs over a paged cache.

    Row b has L_b = lengths[b] context tokens and counts[b] ≤ T real new tokens (prefill_rows pads the
    rest); it owns the pages covering its real slots [0, L_b + counts[b]) — what the scheduler allocated
    — at a random permutation of physical pages; its other table entries name the trash page. Every slot
    s < L_b + T is written through `KVCache.physical`, as the forward's cache write: the padding tokens'
    K/V land in the row's own last page or on the trash page (rows overwrite each other there). Every
    other slot of every page holds NaN (`kp`, `vp`: what the kernel reads); the float64 `cache` holds the
    same values with NaN → 0 (the reference gathers every slot below max L + T, masked).
    """

    def __init__(
        self,
        gen,
        *,
        B,
        Hq,
        Hkv,
        D,
        T,
        lengths,
        page_size,
        dtype=torch.bfloat16,
        counts=None,
        table_dtype=torch.int32,
        spare=2,
    ):
        self.B, self.Hq, self.Hkv, self.D, self.T, self.dtype = B, Hq, Hkv, D, T, dtype
        self.counts = counts or [T] * B
        self.lengths = torch.tensor(lengths, dtype=torch.int64)
        need = [-(-(L + n) // page_size) for L, n in zip(lengths, self.counts)]
        num_pages = sum(need) + spare
        max_len = max(lengths) + T + page_size
        cache = KVCache.paged(layer_config(Hq, Hkv, D), B, num_pages, page_size, max_len, torch.float64, "cpu")
        perm = torch.randperm(num_pages, generator=gen)
        cache.block_table = cache.block_table.to(table_dtype)
        i = 0
        for b in range(B):
            for j in range(need[b]):
                cache.block_table[b, j] = int(perm[i])
                i += 1
        # K rows padded to D + 8 (strides that are not the shape's); V one layer of two
        kp = torch.full((num_pages + 1, Hkv, page_size, D + 8), float("nan"), dtype=dtype)[..., :D]
        vp = torch.full((2, num_pages + 1, Hkv, page_size, D), float("nan"), dtype=dtype)[1]
        for b, L in enumerate(lengths):
            slots = torch.arange(L + T)[None]
            pages, offsets = self._physical(cache, b, slots)
            k = torch.randn(L + T, Hkv, D, generator=gen).to(dtype)
            v = torch.randn(L + T, Hkv, D, generator=gen).to(dtype)
            kp[pages[0], :, offsets[0]] = k
            vp[pages[0], :, offsets[0]] = v
        self.kp, self.vp, self.table = kp, vp, cache.block_table
        cache.k[0] = kp.double().nan_to_num(0.0)
        cache.v[0] = vp.double().nan_to_num(0.0)
        cache.lengths.copy_(self.lengths)
        self.cache = cache
        self.q = (torch.randn(B, T, Hq, D, generator=gen) * 1.5).to(dtype).transpose(1, 2)  # [B, Hq, T, D] view
        self.positions = self.lengths[:, None] + torch.arange(T)[None, :]

    @staticmethod
    def _physical(cache, b, slots):
        """KVCache.physical for row b alone (its table row; past its pages: the trash page)."""
        return cache.select([b]).physical(slots)

    def hide_context(self, b: int) -> None:
        """Row b finished (live 0): its context slots hold NaN for the kernel (a read shows)."""
        L = int(self.lengths[b])
        pages, offsets = self._physical(self.cache, b, torch.arange(L)[None])
        self.kp[pages[0], :, offsets[0]] = float("nan")
        self.vp[pages[0], :, offsets[0]] = float("nan")

    def reference(self, live=None, sliding_window=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, P|V|) [B, T, Hq, D] float64 through reference.read_kv + reference.attention."""
        meta = reference.AttentionMetadata(
            lengths=self.cache.lengths,
            num_new=self.T,
            live=live,
            q_positions=self.positions,
            sliding_window=sliding_window,
        )
        k, v, mask = reference.read_kv(self.cache, 0, meta)
        q = self.q.double()
        out = reference.attention(q, k, v, mask).transpose(1, 2)
        absv = reference.attention(q, k, v.abs(), mask).transpose(1, 2)
        return out, absv

    def kernel(self, live=None, sliding_window=None, config=None, dense=False) -> torch.Tensor:
        """The kernel on DEVICE → [B, T, Hq, D] on the CPU; the output poisoned before the call."""
        dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
        out = torch.full((self.B, self.T, self.Hq, self.D), float("nan"), dtype=self.dtype, device=DEVICE)
        if dense:  # the dense layout [B, Hkv, capacity, D]: rows of the same values, no table
            cap = int(self.lengths.max()) + self.T + 3
            k = torch.full((self.B, self.Hkv, cap, self.D), float("nan"), dtype=self.dtype)
            v = k.clone()
            for b in range(self.B):
                n = int(self.lengths[b]) + self.T
                pages, offsets = self._physical(self.cache, b, torch.arange(n)[None])
                k[b, :, :n] = self.kp[pages[0], :, offsets[0]].transpose(0, 1)
                v[b, :, :n] = self.vp[pages[0], :, offsets[0]].transpose(0, 1)
            kc, vc, table = k, v, None
        else:
            kc, vc, table = self.kp, self.vp, self.table
        got = tp.prefill_attention(
            dev(self.q),
            dev(kc),
            dev(vc),
            dev(self.lengths),
            dev(table),
            q_positions=dev(self.positions) if sliding_window else None,
            sliding_window=sliding_window,
            live=dev(live),
            config=config,
            out=out,
        )
        assert got.data_ptr() == out.data_ptr()
        return out.cpu()

    def check(self, got: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Every element written and finite; real tokens within the bounds (module docstring) → the
        relative norm error over the real tokens."""
        assert got.shape == (self.B, self.T, self.Hq, self.D) and got.dtype == self.dtype
        assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
        out, absv = ref
        real = (torch.arange(self.T)[None, :] < torch.tensor(self.counts)[:, None])[:, :, None, None]
        err = (got.double() - out).abs()
        bound = ULPS[self.dtype] * UNIT[self.dtype] * (out.abs() + absv)
        bad = (err > bound) & real
        assert not bad.any(), (
            f"{int(bad.sum())} elements past {ULPS[self.dtype]} u (|ref| + P|V|); worst "
            f"{float((err / bound)[real.expand_as(err)].max()):.1f}×"
        )
        rel = float((err * real).norm() / (out * real).norm())
        assert rel <= TOL[self.dtype], f"relative error {rel:.2e} > {TOL[self.dtype]:.0e}"
        return rel


def run_case(gen, config=None, live=None, sliding_window=None, dense=False, **kw) -> torch.Tensor:
    case = Case(gen, **kw)
    if live is not None:
        for b in range(case.B):
            if not live[b]:
                case.hide_context(b)
    got = case.kernel(live=live, sliding_window=sliding_window, config=config, dense=dense)
    case.check(got, case.reference(live=live, sliding_window=sliding_window))
    return got


# ----------------------------------------------------------------------------------------------------
# Kernel cases (DEVICE: CUDA in this process, or the CPU in the interpreter child run)

# (Hq, Hkv, D, page_size, dtype, lengths, T): G = 1, 2, 6; D 64, 128; pages 64, 128; L 0 and odd; T·G
# not a multiple of the query tile (128 rows for 16-bit, 64 for fp32)
CAUSAL = [
    (4, 4, 64, 64, torch.bfloat16, [0, 77], 45),
    (4, 4, 128, 128, torch.float32, [130, 0], 37),
    (8, 4, 64, 128, torch.bfloat16, [37, 0, 130], 70),
    (8, 4, 128, 64, torch.float32, [0, 65], 50),
    (12, 2, 64, 64, torch.float32, [0, 100], 43),
    (12, 2, 128, 128, torch.bfloat16, [0, 150], 41),
    (12, 2, 128, 64, torch.bfloat16, [64, 3], 29),
    (12, 2, 64, 128, torch.float16, [77], 53),
]


@needs_kernel
@pytest.mark.parametrize("Hq,Hkv,D,page_size,dtype,lengths,T", CAUSAL)
def test_causal_prefill(Hq, Hkv, D, page_size, dtype, lengths, T):
    gen = torch.Generator().manual_seed(hash((Hq, Hkv, D, page_size, T)) % 2**31)
    run_case(gen, B=len(lengths), Hq=Hq, Hkv=Hkv, D=D, T=T, lengths=lengths, page_size=page_size, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("dtype,page_size", [(torch.bfloat16, 64), (torch.float32, 128)])
def test_ragged_rows_as_prefill_rows_pads_them(dtype, page_size):
    """prefill_rows right-pads shorter chunks to T: row b's padding tokens are queries like any other (their
    outputs are discarded, but must be finite) and their K/V sit past the row's chunk — in its own last
    page or on the trash page that every row's padding shares. Real tokens get the reference's result."""
    gen = torch.Generator().manual_seed(page_size + (dtype == torch.float32))
    run_case(
        gen,
        B=4,
        Hq=12,
        Hkv=2,
        D=64,
        T=70,
        lengths=[0, 130, 77, 64],
        counts=[70, 53, 5, 1],
        page_size=page_size,
        dtype=dtype,
    )


@needs_kernel
@pytest.mark.parametrize("window,dtype", [(3, torch.bfloat16), (40, torch.float32), (100, torch.bfloat16)])
def test_sliding_window(window, dtype):
    """Mistral's window: query t sees slots s with q_position − s < window (leading tiles skipped, the
    window's edge masked); windows inside one key tile, a few tiles, longer than some rows."""
    gen = torch.Generator().manual_seed(window)
    run_case(
        gen,
        B=3,
        Hq=8,
        Hkv=2,
        D=64,
        T=60,
        lengths=[0, 150, 77],
        page_size=64,
        dtype=dtype,
        sliding_window=window,
        config=SMALL_TILES,
    )


@needs_kernel
@pytest.mark.parametrize("window", [None, 30])
def test_finished_rows_read_none_of_their_context(window):
    """live[b] = 0: row b sees only its new tokens; its context holds NaN here, so a read shows."""
    gen = torch.Generator().manual_seed(5)
    run_case(
        gen,
        B=3,
        Hq=12,
        Hkv=2,
        D=64,
        T=40,
        lengths=[100, 130, 0],
        page_size=64,
        live=torch.tensor([1, 0, 0]),
        sliding_window=window,
        config=SMALL_TILES,
    )


@needs_kernel
@pytest.mark.parametrize("page_size,dense", [(16, False), (48, False), (64, True)])
def test_per_key_page_lookups(page_size, dense):
    """Page sizes that are no multiple of the key tile (16 and 48 for 64-key tiles) and the dense layout
    (no table: page_size = capacity, an arbitrary integer) look up each key's page."""
    gen = torch.Generator().manual_seed(page_size + dense)
    run_case(gen, B=3, Hq=12, Hkv=2, D=64, T=45, lengths=[0, 100, 37], page_size=page_size, dense=dense)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tile_configs_agree(dtype):
    """Query tiles of 16-128 rows and key tiles of 16-64 (what prefill_bench sweeps): every one within the
    bounds, on the same inputs."""
    gen = torch.Generator().manual_seed(11)
    case = Case(gen, B=2, Hq=12, Hkv=2, D=64, T=30, lengths=[0, 90], page_size=64, dtype=dtype)
    ref = case.reference()
    configs = [
        None,
        dict(BLOCK_M=16, BLOCK_N=32),
        dict(BLOCK_M=64, BLOCK_N=16),
        dict(BLOCK_M=128, BLOCK_N=64),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    ]
    for config in configs:
        case.check(case.kernel(config=config), ref)


@needs_kernel
def test_int64_table_and_fp16():
    gen = torch.Generator().manual_seed(3)
    run_case(
        gen, B=2, Hq=8, Hkv=2, D=128, T=33, lengths=[70, 0], page_size=64, dtype=torch.float16, table_dtype=torch.int64
    )


@cuda_only
@pytest.mark.parametrize("lengths,T,window", [([3000, 0, 1500], 1100, None), ([5000], 700, 4096), ([0], 2100, None)])
def test_long_prefill_on_cuda(lengths, T, window):
    """The 1.5B's shapes (G = 6, D = 128, bf16, 128-slot pages) at thousands of keys: many unmasked
    tiles between the diagonal and the window edge."""
    gen = torch.Generator().manual_seed(T)
    run_case(gen, B=len(lengths), Hq=12, Hkv=2, D=128, T=T, lengths=lengths, page_size=128, sliding_window=window)


# ----------------------------------------------------------------------------------------------------
# Through the model: Transformer._backend and engine.prefill.prefill_rows


def tiny_model(seed: int = 0, **overrides):
    from redwood.models.transformer import Transformer

    cfg = dict(
        arch="qwen2",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=2048,
        qkv_bias=True,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**cfg)).eval()


def paged_cache(model, B: int, page_size: int, max_len: int, gen) -> KVCache:
    """A paged cache whose rows own shuffled pages covering max_len slots each (live 1)."""
    width = -(-max_len // page_size)
    cache = KVCache.paged(model.config, B, B * width, page_size, max_len, model.dtype, model.device)
    cache.block_table.copy_(torch.randperm(B * width, generator=gen).view(B, width).to(torch.int32))
    cache.live.fill_(1)
    return cache


@pytest.mark.skipif(DEVICE is None, reason="no CUDA device (the interpreter runs this in test_interpreter_suite)")
def test_prefill_rows_through_the_kernel_equal_the_reference(monkeypatch):
    """A tiny model's batched prefill (prefill_rows: two ragged chunks of > 256 tokens over contexts the
    first one left; shorter rows padded) with the prefill kernel on (the default) gives the reference attention's
    logits and K/V (float32; in the interpreter the kernel is made 'available' on the CPU)."""
    from redwood.config import ExecutionConfig
    from redwood.engine.prefill import prefill_rows

    if INTERPRET:
        monkeypatch.setattr(tp, "available", lambda device, dtype, head_dim: True)
    model = tiny_model().to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (520, 257, 280)]
    chunks = [([0, 0, 0], [260, 257, 20]), ([260, 257, 20], [520, 257, 280])]  # row 1: nothing new, row 2: 260
    results = {}
    for backend in ("auto", "reference"):
        model.set_execution(ExecutionConfig(attention=backend))
        cache = paged_cache(model, 3, 32, 544, torch.Generator().manual_seed(1))
        seen, forward = [], model.forward

        def counted(*args, **kwargs):
            seen.append(args[0].shape[1])
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)
        logits = []
        with torch.inference_mode():
            for starts, stops in chunks:
                rows = [i for i in range(3) if stops[i] > starts[i]]
                logits.append(
                    prefill_rows(
                        model,
                        cache,
                        rows,
                        [prompts[i] for i in rows],
                        [starts[i] for i in rows],
                        [stops[i] for i in rows],
                    )
                )
        monkeypatch.setattr(model, "forward", forward)
        results[backend] = logits, cache, seen
        assert model.prefill_kernel() == (backend == "auto")
    (got, got_cache, got_seen), (want, want_cache, _) = results["auto"], results["reference"]
    assert got_seen == [260, 260]  # one forward per chunk: the kernel drops the score budget
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_cache.lengths, want_cache.lengths)
    assert torch.equal(got_cache.block_table, want_cache.block_table)
    for b, n in enumerate(got_cache.lengths.tolist()):  # every real slot's K/V (layer 1's: after attention)
        gp, go = got_cache.select([b]).physical(torch.arange(n, device=DEVICE)[None])
        for buf_got, buf_want in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
            torch.testing.assert_close(buf_got[:, gp[0], :, go[0]], buf_want[:, gp[0], :, go[0]], rtol=1e-4, atol=1e-4)


def test_backend_choice(monkeypatch):
    """ "triton_prefill" only for > FAST_ATTENTION_MAX_NEW new tokens, with the switch on, where the kernel
    is available, for plain forwards (no view, observer, pending tokens or new-token mask); with the
    switch off (ExecutionConfig(prefill_kernel=False)), on the CPU, or a model pinned to the reference:
    unchanged; on by default."""
    from redwood.config import ExecutionConfig
    from redwood.models.backends import FAST_ATTENTION_MAX_NEW, attention_kernel

    model = tiny_model()
    ids = torch.zeros(1, 1, dtype=torch.long)
    long = FAST_ATTENTION_MAX_NEW + 1
    assert attention_kernel(model, ids, long, None) == "reference"  # the CPU: not available
    monkeypatch.setattr(tp, "available", lambda device, dtype, head_dim: True)
    assert attention_kernel(model, ids, long, None) == "triton_prefill"  # on by default where available
    assert attention_kernel(model, ids, FAST_ATTENTION_MAX_NEW, None) == "reference"  # (the CPU: no decode kernel)
    view = lambda layer: None  # noqa: E731
    assert attention_kernel(model, ids, long, lambda *a: None) == "reference"  # an observer needs the scores
    assert attention_kernel(model, ids, long, None, view=view) == "reference"
    assert attention_kernel(model, ids, long, None, pending=2) == "reference"
    assert attention_kernel(model, ids, long, None, new_mask=torch.ones(long, long, dtype=torch.bool)) == "reference"
    model.set_execution(ExecutionConfig(attention="reference"))
    assert attention_kernel(model, ids, long, None) == "reference" and not model.prefill_kernel()
    model.set_execution(ExecutionConfig(prefill_kernel=False))
    assert attention_kernel(model, ids, long, None) == "reference"


def test_forward_tokens_budget(monkeypatch):
    """The score budget applies where the reference path attends; with the kernel only the token cap."""
    from redwood.engine import prefill

    model = tiny_model()
    assert prefill._forward_tokens(model, 8, 24576) == prefill.prefill_chunk(8, 2, 24576)
    monkeypatch.setattr(type(model), "prefill_kernel", lambda self: True)
    assert prefill._forward_tokens(model, 1, 8192) == 8192
    assert prefill._forward_tokens(model, 8, 24576) == prefill.PREFILL_TOKEN_CAP // 8
    assert prefill._forward_tokens(model, 1000, 300) == 256


def test_available_and_import_without_triton(monkeypatch):
    assert not tp.available(torch.device("cpu"), torch.bfloat16, 64)
    mod = import_without_triton(monkeypatch, tp)
    assert mod.triton is None and not mod.available(torch.device("cpu"), torch.bfloat16, 64)


def test_launch_config():
    """16-bit operands at D ≤ 128: 128 × 64 tiles, 8 warps, 3 stages only with big shared memory; fp32 and
    D > 128 smaller tiles (what compiles for sm_90 without spills, or with the fewest)."""
    cfg = tp.launch_config(128, torch.bfloat16, big_smem=True)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"], cfg["num_warps"], cfg["num_stages"]) == (128, 64, 128, 8, 3)
    assert tp.launch_config(128, torch.bfloat16)["num_stages"] == 2
    assert tp.launch_config(80, torch.float16)["BLOCK_D"] == 128
    assert tp.launch_config(256, torch.bfloat16)["BLOCK_M"] == 64
    assert tp.launch_config(64, torch.float32)["BLOCK_N"] == 32
    assert tp.launch_config(128, torch.float32)["BLOCK_N"] == 16


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter child run")
def test_interpreter_suite():
    """Run this file's kernel cases on the CPU through Triton's interpreter, in a child pytest."""
    run_in_triton_interpreter(__file__)
