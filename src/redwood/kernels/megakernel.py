"""A whole one-token forward as one persistent CUDA kernel (megakernel_cu/): batch 1, bfloat16 or int8 weights.

Why: a batch-1 forward through the skinny kernels is ~150 launches (5 per layer + the head), and each
kernel's launch, ramp-up and drain — plus the latency-bound q/k/v, attention and o stages — leave the HBM
idle for a large part of a step (docs/perf/gpu.md, sessions 4-6, and docs/perf/megakernel.md, session 15;
the share: megakernel.md, "Figures cited from the source"). In the kernel one block per SM streams
its share of every weight tile of the forward into a shared-memory ring with bulk copies, running ahead
across stage and layer boundaries, while its consumer warps run the stages in order and the blocks meet
at device-side counters instead of kernel boundaries.

The source is compiled at first use with NVRTC (`torch.cuda._compile_kernel`, which ships with PyTorch's
CUDA builds: nothing to build at install time) for the model's shapes, and launched with raw pointers:
a table of every weight, cache and scratch pointer lives on the device, built once per (model, cache).
Launches are graph-capturable (the per-call pointers — logits, token id, position — are launch arguments;
the table must exist before capture, which the StepRunner's eager warm-up ensures).

Where it applies (`MegaForward.takes`): CUDA, bfloat16, a Llama/Qwen2-style model with head_dim 64 or 128, no
o / MLP biases, no sliding window, resident (not offloaded) layers, one new token of a one-row cache (with `pending`
earlier draft tokens), no compressed view or observer; model-dtype weights, or `quantize_skinny`'s int8 copies through its int8 build
(W8). On by default where it applies (faster than the skinny kernels for the 1.5B and 0.5B shapes at short and
long contexts: docs/perf/megakernel.md, session 20); `ExecutionConfig(megakernel="off")` turns it
off. The CUDA backend (redwood.models.backends.cuda) takes it first, while its skinny path is on (off: the cuBLAS A/B).

Rounding matches the skinny path (redwood.kernels.gemv, qkv_rope): float32 sums (in another order), the
folded RMSNorm, each projection rounded to bf16, RoPE / residual / SiLU·up rounded as eager PyTorch; the
attention is float32 with a split softmax. Outputs agree with the skinny path within a few bf16 ulps.
"""

from __future__ import annotations

from pathlib import Path

import torch

_PARTS = ("base.cuh", "producer.cuh", "gemv_stage.cuh", "attention.cuh", "forward.cu")  # compiled as one, in order


def source() -> str:
    """megakernel_cu's parts as one CUDA source (each after a #line marker, so errors name its file and line)."""
    folder = Path(__file__).with_name("megakernel_cu")
    return "".join(f'#line 1 "{name}"\n' + (folder / name).read_text() for name in _PARTS)


class Unavailable(RuntimeError):
    """The megakernel could not be built for this model on this GPU (its layout does not fit the shared memory,
    or NVRTC refused the source): Transformer.forward warns and goes on through the skinny kernels."""


_KERNELS: dict[tuple, object] = {}
HEAD_DIMS = (64, 128)
SMAX = 32  # blocks per KV head in attention at most (partials: HKV × SMAX × G × D floats)
T_LAYER0, T_PER_LAYER = 32, 16  # megakernel_cu's table layout


def misfit(model) -> str | None:
    """Why `model` cannot run through the megakernel (None: it can)."""
    if getattr(model, "offloaded", False):
        return "layers offloaded (their weights stream in per layer; the kernel reads resident weights)"
    if model.device.type != "cuda":
        return "not on CUDA"
    if getattr(torch.cuda, "_compile_kernel", None) is None:
        return "this PyTorch has no torch.cuda._compile_kernel (NVRTC)"
    if torch.cuda.get_device_capability(model.device)[0] < 9:
        return "needs sm_90 (bulk copies, transaction barriers)"
    if model.dtype != torch.bfloat16:
        return f"dtype {model.dtype} (bfloat16 only)"
    if model.layers[0].self_attn.qkv is None or model.layers[0].mlp.gate_up is None:
        return "projections not fused (fuse_projections)"
    return config_misfit(model.config)


def config_misfit(cfg) -> str | None:
    """What in a model's shape the megakernel does not take (None: nothing)."""
    if cfg.head_dim not in HEAD_DIMS:
        return f"head_dim {cfg.head_dim} (64 or 128 only)"
    if cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 8:
        return "query heads per KV head must be a whole number ≤ 8"
    if cfg.sliding_window is not None:
        return "sliding-window attention"
    if cfg.o_bias or cfg.mlp_bias:
        return "o_proj / MLP biases"
    H, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    if H % 8 or F % 32 or V % 8:
        return "hidden / intermediate / vocab sizes must be multiples of 8 / 32 / 8"
    if down_rows(cfg) is None:
        return "no down-projection tile fits"
    return None


def down_rows(cfg, int8: bool = False) -> int | None:
    """Rows per down-projection tile: the most of 8, 4, 2, 1 dividing H whose tile fits the slot the other
    stages need (8 rows of H or Hq·D), and whose K split over 8 / rows warps is whole chunks of 8."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    eb = 1 if int8 else 2  # weight bytes an element
    slot = max(8 * H, 8 * cfg.num_heads * cfg.head_dim, F) * eb
    for rd in (8, 4, 2, 1):
        if H % rd == 0 and rd * F * eb <= slot and (F // 8) % (8 // rd) == 0:
            return rd
    return None


def parse_defines(text: str) -> dict[str, str]:
    """Timing / design experiments of benchmarks/megakernel_bench.py (--variants): "NAME=VALUE …" (a bare NAME
    means 1) → #defines of the megakernel source that override the computed ones (e.g. NSLOT=2, ATTN_CPB=16,
    ATTN_NO_MERGE). Some give wrong outputs by design (megakernel_cu's header says which): only a benchmark passes
    them (`MegaForward(defines=...)`); the library never does."""
    out = {}
    for item in text.split():
        name, _, value = item.partition("=")
        if not name.isidentifier():
            raise ValueError(f"megakernel defines: {item!r} is not NAME or NAME=VALUE")
        out[name] = value or "1"
    return out


def layout(cfg, page_size: int, n_sm: int, smem_optin: int, profile: bool = False,
           int8: bool = False, extra: dict[str, str] | None = None) -> tuple[dict, int]:
    """megakernel_cu's #defines for a model shape on a GPU (n_sm multiprocessors, smem_optin bytes of shared
    memory a block) and weights (bf16, or int8 with row scales), and the dynamic shared memory a block asks
    for: a ring of as many weight-tile slots as fit (2 to 8), after the attention's per-warp accumulators and
    probabilities. A slot holds a weight tile or a chunk of 32 keys' K and V rows. extra: a benchmark's
    experiment #defines (`parse_defines`), overriding the computed ones."""
    HEAD_DIM = cfg.head_dim
    H, F = cfg.hidden_size, cfg.intermediate_size
    G = cfg.num_heads // cfg.num_kv_heads
    rd = down_rows(cfg, int8)
    eb = 1 if int8 else 2
    extra = extra or {}
    slot = -(-max(max(8 * H, 8 * cfg.num_heads * HEAD_DIM, rd * F) * eb, 128 * HEAD_DIM) // 128) * 128
    fixed = 4 * HEAD_DIM + 16 + 8 * G * HEAD_DIM * 4 + 8 * 32 * 8 * 4  # cos / sin, a word; attention's
    # per-warp accumulators and probabilities
    per_slot = slot + 16 + 32 + 4  # tile, two barriers, partial sums, arrival count
    nslot = min(8, (smem_optin - fixed) // per_slot)
    if nslot < 2:
        raise RuntimeError(f"megakernel: shared memory {smem_optin} B holds fewer than two {slot} B weight tiles")
    nslot = int(extra.get("NSLOT", nslot))
    smem = nslot * per_slot + fixed
    defines = {"H": H, "NI": F, "HQ": cfg.num_heads, "HKV": cfg.num_kv_heads, "D": HEAD_DIM,
               "V": cfg.vocab_size, "NL": cfg.num_layers, "PS": page_size, "EPS": f"{float(cfg.rms_norm_eps)!r}f",
               "NB": n_sm, "NSLOT": nslot, "SLOT": slot, "RD": rd, "SMAX": SMAX,
               "HAS_QKV_BIAS": int(cfg.qkv_bias), "PROFILE": int(profile), "W8": int(int8)}
    defines.update(extra)
    return defines, smem


def _kernel(model, page_size: int, profile: bool = False, int8: bool = False, extra: dict | None = None):
    props = torch.cuda.get_device_properties(model.device)
    defines, smem = layout(model.config, page_size, props.multi_processor_count,
                           getattr(props, "shared_memory_per_block_optin", 232448), profile,
                           int8=int8, extra=extra)
    key = tuple(sorted((k, str(v)) for k, v in defines.items()))
    if key not in _KERNELS:
        src = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + source()
        kernel = torch.cuda._compile_kernel(src, "redwood_decode_forward", nvcc_options=["-std=c++17"])
        kernel.set_shared_memory_config(smem)
        _KERNELS[key] = (kernel, smem, defines)
    return _KERNELS[key]


class MegaForward:
    """The megakernel bound to one model: its scratch buffers and one pointer table per cache."""

    def __init__(self, model, profile: bool = False, int8: dict | None = None, defines: dict[str, str] | None = None):
        """profile: stamp every block's start and end of every stage (`timeline`). int8: the skinny path's int8
        copies (the CUDA backend's `quantize_int8`), read through the W8 build, or None (the model-dtype weights).
        defines: a benchmark's experiment #defines (`parse_defines`; never passed by the library)."""
        cfg = model.config
        dev = model.device
        self.model = model
        self.profile = profile
        self.int8 = int8
        self.defines = dict(defines or {})
        HEAD_DIM = cfg.head_dim
        G = cfg.num_heads // cfg.num_kv_heads
        qd = cfg.num_heads * HEAD_DIM
        bf = torch.bfloat16
        self.h = torch.zeros(cfg.hidden_size, dtype=bf, device=dev)
        self.q = torch.zeros(qd, dtype=bf, device=dev)
        n_part = cfg.num_kv_heads * SMAX * G
        self.pm = torch.zeros(n_part, dtype=torch.float32, device=dev)
        self.pl = torch.zeros(n_part, dtype=torch.float32, device=dev)
        self.pacc = torch.zeros(n_part * HEAD_DIM, dtype=torch.float32, device=dev)
        self.attn = torch.zeros(qd, dtype=bf, device=dev)
        self.act = torch.zeros(cfg.intermediate_size, dtype=bf, device=dev)
        # stage counters (6 a layer + the exit count), then per (layer, KV head) the attention splits done
        self.counters = torch.zeros(6 * cfg.num_layers + 1 + cfg.num_layers * cfg.num_kv_heads, dtype=torch.int32,
                                    device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        n_blocks = torch.cuda.get_device_properties(dev).multi_processor_count
        # per stage and block: start, end, consumer slot waits, producer slot waits, attention's four phase stamps
        # (megakernel_cu's PROF_SLOTS)
        self.prof = torch.zeros((6 * cfg.num_layers + 1, n_blocks, 8) if profile else 1, dtype=torch.int64, device=dev)
        self.inv_freq = model.rotary.inv_freq.to(device=dev, dtype=torch.float32).contiguous()
        self._tables: dict[tuple, torch.Tensor] = {}
        self._kernels: dict[int, tuple] = {}  # page size → (kernel, shared memory, defines), looked up once
        self.launches = 0  # forward() calls (a graph replay runs the kernel without one)

    @staticmethod
    def takes(input_ids: torch.Tensor, cache, new_mask, view, observer) -> bool:
        """Whether this forward runs through the megakernel (the model fits: `misfit`; checked once)."""
        if input_ids.shape != (1, 1) or new_mask is not None or view is not None or observer is not None:
            return False
        if cache.lengths.shape != (1,):  # one row of a larger cache: the kernel reads row 0's length and pages
            return False
        return cache.k.dtype == torch.bfloat16

    def _table(self, cache) -> torch.Tensor:
        key = (cache.k.data_ptr(), cache.v.data_ptr(), cache.lengths.data_ptr(), cache.live.data_ptr(),
               cache.block_table.data_ptr(), tuple(cache.k.shape))
        table = self._tables.get(key)
        if table is not None:
            return table
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("megakernel: a new cache's pointer table cannot be built during graph capture "
                               "(run the forward once eagerly first)")
        m = self.model
        ptr = [0] * (T_LAYER0 + T_PER_LAYER * len(m.layers))
        q8 = self.int8  # int8 copies with row scales (quantize_skinny) or None
        ptr[0] = m.embed_tokens.weight.data_ptr()
        ptr[1] = m.norm.weight.data_ptr()
        ptr[2] = (q8["lm_head"][0] if q8 else m.head_weight).data_ptr()
        ptr[4] = q8["lm_head"][1].data_ptr() if q8 else 0
        ptr[3] = self.inv_freq.data_ptr()
        ptr[6], ptr[7] = cache.lengths.data_ptr(), cache.live.data_ptr()
        ptr[8] = cache.block_table.data_ptr()
        ptr[10], ptr[11], ptr[12], ptr[13], ptr[14] = (t.data_ptr() for t in (self.h, self.q, self.pm, self.pl, self.pacc))
        ptr[15], ptr[16], ptr[17], ptr[18] = (t.data_ptr() for t in (self.attn, self.act, self.counters, self.err))
        ptr[19] = self.prof.data_ptr()
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            base = T_LAYER0 + T_PER_LAYER * i
            weights = (attn.qkv[0], attn.o_proj.weight, mlp.gate_up[0], mlp.down_proj.weight)
            if q8:  # (int8 rows, float32 scales) of q/k/v, o, gate/up, down; scales at L_QKV_S … L_DOWN_S
                int8 = [q8["layers"][i][name] for name in ("qkv", "o", "gate_up", "down")]
                weights = tuple(q for q, _ in int8)
                for j, (q, scale) in enumerate(int8):
                    if not (q.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float32):
                        raise RuntimeError("megakernel: int8 weights must be contiguous with float32 row scales")
                    ptr[base + 9 + j] = scale.data_ptr()
            ptr[base + 0] = weights[0].data_ptr()
            ptr[base + 1] = attn.qkv[1].data_ptr() if attn.qkv[1] is not None else 0
            ptr[base + 2] = weights[1].data_ptr()
            ptr[base + 3] = weights[2].data_ptr()
            ptr[base + 4] = weights[3].data_ptr()
            ptr[base + 5] = layer.input_layernorm.weight.data_ptr()
            ptr[base + 6] = layer.post_attention_layernorm.weight.data_ptr()
            ptr[base + 7] = cache.k[i].data_ptr()
            ptr[base + 8] = cache.v[i].data_ptr()
        for name, t in (("embedding", m.embed_tokens.weight), ("head", m.head_weight)):
            if not t.is_contiguous() or t.dtype != torch.bfloat16:
                raise RuntimeError(f"megakernel: the {name} weight must be contiguous bfloat16")
        if q8 and not q8["lm_head"][0].is_contiguous():
            raise RuntimeError("megakernel: the int8 head must be contiguous")
        if cache.block_table.stride(-1) != 1 or not cache.k.is_contiguous():
            raise RuntimeError("megakernel: the cache must be contiguous with a row-major block table")
        table = torch.tensor(ptr, dtype=torch.int64, device=self.model.device)
        if len(self._tables) >= 16:
            self._tables.pop(next(iter(self._tables)))
        self._tables[key] = table
        return table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, pending: int = 0) -> torch.Tensor:
        """One token of one row → logits [1, 1, V] float32 (its K/V written at slot lengths + pending)."""
        page_size = cache.k.shape[3]
        if page_size not in self._kernels:
            try:
                self._kernels[page_size] = _kernel(self.model, page_size, self.profile, self.int8 is not None,
                                                   self.defines)
            except Exception as e:  # (a build failure, never a wrong result: nothing has run yet)
                raise Unavailable(f"{type(e).__name__}: {e}") from e
        kernel, smem, defines = self._kernels[page_size]
        table = self._table(cache)
        logits = torch.empty(1, 1, self.model.config.vocab_size, dtype=torch.float32, device=self.model.device)
        ids = input_ids.reshape(1)
        pos = positions.reshape(1)
        if ids.dtype != torch.int64 or pos.dtype != torch.int64:
            ids, pos = ids.long(), pos.long()
        self.launches += 1
        kernel(grid=(defines["NB"], 1, 1), block=(288, 1, 1), args=[table, logits, ids, pos, int(pending)],
               shared_mem=smem)
        return logits

    def timeline(self) -> dict[str, dict[str, float]]:
        """Of the last launch (profile=True), per stage kind averaged over layers, in µs: `wait` from the
        previous stage's last block finishing to this stage's median block starting; `work` the median block's
        time in the stage, `max` the slowest block's (attention: a block holding key chunks); `span` first start
        to last end; `starve` the median block's consumer time waiting for
        weight tiles (or K/V chunks) to land, `stall` its producer's time waiting for a free slot while
        streaming the stage's tiles."""
        prof = self.prof.cpu().double() / 1e3  # [stage, block, start / end / starve / stall] µs
        names = ["qkv", "attention", None, "o", "gate/up", "down"]  # (counter 2 is unused)
        out: dict[str, dict[str, float]] = {}
        for s in range(prof.shape[0]):
            name = "head" if s == prof.shape[0] - 1 else names[s % 6]
            if name is None:
                continue
            start, end = prof[s, :, 0], prof[s, :, 1]
            prev = s - 2 if s % 6 == 3 else s - 1  # (o waits for attention)
            prev_end = prof[prev, :, 1].max() if s else start.min()
            row = {"wait": float(start.median() - prev_end), "work": float((end - start).median()),
                   "max": float((end - start).max()),
                   "span": float(end.max() - start.min()), "starve": float(prof[s, :, 2].median()),
                   "stall": float(prof[s, :, 3].median())}
            acc = out.setdefault(name, {k: 0.0 for k in row} | {"n": 0})
            for k, v in row.items():
                acc[k] += v
            acc["n"] += 1
        total = float(prof[-1, :, 1].max() - prof[0, :, 0].min())
        for acc in out.values():
            n = acc.pop("n")
            for k in acc:
                acc[k] /= n
        out["total"] = {"wait": 0.0, "work": 0.0, "max": 0.0, "span": total, "starve": 0.0, "stall": 0.0}
        return out

    def attention_phases(self) -> dict[str, float]:
        """Of the last launch (profile=True), where the attention stage's slowest key-holding block spends its time,
        in µs, mean over layers: `chunks` from the stage's start to warp 0's last chunk done (the q load, its slot
        waits, its chunks), `warps` until every warp's partials are in shared memory, `block merge` until the block's
        merged partials are stored (0 with one split), `count` its arrival counted (0 with one split), `merge` to the
        stage's end (the KV head's last block: the splits' merge and the output)."""
        prof = self.prof.cpu().double() / 1e3  # [stage, block, slot] µs; attention is stage 6·layer + 1
        sums = dict.fromkeys(("chunks", "warps", "block merge", "count", "merge"), 0.0)
        layers = 0
        for s in range(1, prof.shape[0] - 1, 6):
            keys = prof[s, :, 4] > 0  # blocks that held key chunks
            if not keys.any():
                continue
            blk = prof[s][keys]
            b = blk[int((blk[:, 1] - blk[:, 0]).argmax())]  # the slowest of them
            start, end, chunks, warps, stored, counted = (float(b[i]) for i in (0, 1, 4, 5, 6, 7))
            split = counted > 0
            sums["chunks"] += chunks - start
            sums["warps"] += warps - chunks
            sums["block merge"] += stored - warps if split else 0.0
            sums["count"] += counted - stored if split else 0.0
            sums["merge"] += end - (counted if split else warps)
            layers += 1
        return {k: v / layers for k, v in sums.items()} if layers else {}

    def error(self) -> int:
        """The last launches' failure code (0: none; 1 + where a wait timed out). Synchronizes."""
        return int(self.err.item())
