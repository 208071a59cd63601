"""Prefill attention on one GPU: the reference path vs the flash prefill kernel (attention.triton_prefill),
per layer and for a whole 1.5B-shaped prefill chunk through the model.

Run on the GPU machine from the repo root (fails with a message elsewhere):
    PYTHONPATH=src python3 benchmarks/prefill_bench.py --output prefill_bench.json
    PYTHONPATH=src python3 benchmarks/prefill_bench.py --sweep        # + tile configurations per case
    PYTHONPATH=src python3 benchmarks/prefill_bench.py --sdpa         # + torch SDPA's cuDNN / flash backends

Shapes: Qwen2.5-Coder-1.5B (Hq = 12, Hkv = 2, D = 128, 28 layers, bf16), a paged cache of 128-slot pages
(the Engine's default block size) at a random permutation of physical pages. Cases B rows × T new tokens
over L context tokens per row: 1 × 8192 over 0, 1 × 2048 over 22528 (the Engine's default 2048-token
chunk at 24K), 8 × 1024 over 23552, 1 × 8192 over 24576.

Layer (one attention call over one layer; CUDA events, median; calls rotate over enough layers that
their K/V exceed the 60 MB L2):
    reference: `reference.read_kv` (gathers the layer's K/V through the page table) + `reference.attention`
               (SDPA with the dense boolean mask, enable_gqa) — one forward of all T tokens; the mask is
               built once per forward for all layers (`mask ms`, shown apart);
    decode:    `triton_decode.decode_attention` at the same T (the kernel T ≤ 256 forwards take);
    prefill:   `triton_prefill.prefill_attention` (default tiles; `--sweep`: others).
    FLOP floor: 4 · B · T · (L + T/2) · Hq · D per layer (QK^T and PV over the causal keys) at 790 TFLOP/s
    (dense bf16 matrix products measured on this workplace's H200).
    Check: the kernel's output (poisoned with NaN first: every element written, finite) against float64
    SDPA over upcast inputs for 256 of the T query tokens (the first and last 128), and the reference
    path's bf16 output against the same.
Chunk (`engine.prefill.prefill_rows` on a random-weight 1.5B-shaped model, fused projections, 28 layers,
what the Engine runs for B requests' plain prefill chunks): ExecutionConfig(prefill_kernel=False) (the score
budget splits the chunk into forwards of 256-768 tokens; those of ≤ 256 take the decode kernel) vs =1
(one forward through the prefill kernel) vs =1 with the budget kept (the same forwards as today, isolating
the kernel from the larger forwards). Floor: attention FLOPs + 2 · 1.31e9 non-embedding parameters per
token (+ the LM head at each row's last token) at 790 TFLOP/s. Check: the last-token logits of each
variant against the reference variant's.

A short table comes last on stdout; --output writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HQ, HKV, D, LAYERS, PAGE = 12, 2, 128, 28, 128
HIDDEN, INTERMEDIATE, VOCAB = 1536, 8960, 151936  # Qwen2.5(-Coder)-1.5B
DEVICE = "cuda"
PEAK_FLOPS = 790e12  # dense bf16 matrix products, H200 (the device library's KINDS.md: 769-798 measured)
L2_DEFEAT_BYTES = 512 * 2**20
CASES = [(1, 8192, 0), (1, 2048, 22528), (8, 1024, 23552), (1, 8192, 24576)]
SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
]


def need_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit(
            "prefill_bench.py needs a CUDA GPU: torch.cuda.is_available() is False here. Run it on the GPU "
            "machine: PYTHONPATH=src python3 benchmarks/prefill_bench.py"
        )
    from redwood.attention import triton_prefill

    if not triton_prefill.available(torch.device("cuda"), torch.bfloat16, D):
        sys.exit(
            "prefill_bench.py: the Triton prefill kernel is not available on this GPU (needs triton, compute "
            "capability ≥ 8.0, TRITON_INTERPRET unset)"
        )


def attn_flops(B: int, T: int, L: int) -> float:
    """One layer's attention FLOPs: QK^T and PV over each query's causal keys (L + t + 1, ~L + T/2)."""
    return 4.0 * B * T * (L + T / 2) * HQ * D


def time_ms(fn, n_sets: int, budget_s: float = 2.0, max_reps: int = 30) -> float:
    """Median ms of fn(i) (i rotating over n_sets input sets), each call timed with CUDA events, after
    warm-up calls; as many repeats as fit `budget_s` (3 to max_reps)."""
    fn(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(1 % n_sets)
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    reps = max(3, min(max_reps, int(budget_s / max(one, 1e-6))))
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def shuffled_table(B: int, L_plus_T: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block table [B, W] over a random permutation of B · W physical pages (each row owns W pages)."""
    width = -(-L_plus_T // PAGE)
    perm = torch.randperm(B * width, generator=gen).view(B, width).to(torch.int32)
    return perm, B * width


# ----------------------------------------------------------------------------------------------------
# One layer


class LayerCase:
    """A paged cache of `sets` layers (KVCache.paged: what the Engine holds), random K/V, and per layer
    random rotated queries q [B, Hq, T, D] (a transposed view, as fused.rope_and_write returns)."""

    def __init__(self, B: int, T: int, L: int, gen: torch.Generator):
        from redwood.attention.reference import AttentionMetadata
        from redwood.config import ModelConfig
        from redwood.kv.cache import KVCache

        self.B, self.T, self.L = B, T, L
        kv_bytes = 2 * B * HKV * (L + T) * D * 2
        self.sets = max(2, min(16, math.ceil(L2_DEFEAT_BYTES / kv_bytes)))
        cfg = ModelConfig(
            arch="qwen2",
            vocab_size=16,
            hidden_size=HQ * D,
            intermediate_size=16,
            num_layers=self.sets,
            num_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
        )
        table, pages = shuffled_table(B, L + T, gen)
        cache = KVCache.paged(cfg, B, pages, PAGE, table.shape[1] * PAGE, torch.bfloat16, DEVICE)
        for layer in range(self.sets):
            cache.k[layer].normal_()
            cache.v[layer].normal_()
        cache.block_table.copy_(table)
        cache.lengths.fill_(L)
        cache.live.fill_(1)
        self.cache = cache
        self.q = [
            torch.randn(B, T, HQ, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2) for _ in range(self.sets)
        ]
        self.positions = cache.lengths[:, None] + torch.arange(T, device=DEVICE)[None, :]
        self.meta = lambda: AttentionMetadata(
            lengths=cache.lengths, num_new=T, live=cache.live, q_positions=self.positions
        )
        self._meta = self.meta()  # one forward's metadata: its mask is built once, for every layer
        self.flops = attn_flops(B, T, L)

    def prefill(self, i: int, config: dict | None = None, out=None) -> torch.Tensor:
        from redwood.attention.triton_prefill import prefill_attention

        c = self.cache
        return prefill_attention(
            self.q[i], c.k[i], c.v[i], c.lengths, c.block_table, live=c.live, config=config, out=out
        )

    def decode(self, i: int) -> torch.Tensor:
        from redwood.attention.triton_decode import decode_attention

        c = self.cache
        return decode_attention(self.q[i], c.k[i], c.v[i], c.lengths, live=c.live, block_table=c.block_table)

    def reference(self, i: int) -> torch.Tensor:
        from redwood.attention import reference

        k, v, mask = reference.read_kv(self.cache, i, self._meta)
        return reference.attention(self.q[i], k, v, mask).transpose(1, 2)

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every set's K/V gathered once into contiguous [B, Hkv, L + T, D] (what a backend without a page
        table would need; the gather is not timed)."""
        from redwood.attention import reference

        if not hasattr(self, "_dense"):
            self._dense = []
            for i in range(self.sets):
                k, v, _ = reference.read_kv(self.cache, i, self._meta)
                self._dense.append((k.contiguous(), v.contiguous()))
        return self._dense

    def sdpa(self, i: int, backend) -> torch.Tensor:
        """torch SDPA on the contiguous K/V with one backend pinned (`SDPA_BACKENDS`), causal aligned to the
        bottom right (query t sees keys ≤ L + t), GQA by `enable_gqa` → [B, Hq, T, D]."""
        from torch.nn.attention import sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        k, v = self.dense_kv()[i]
        with sdpa_kernel([backend]):
            if self.L == 0:
                return F.scaled_dot_product_attention(self.q[i], k, v, is_causal=True, enable_gqa=True)
            mask = causal_lower_right(self.T, self.L + self.T)
            return F.scaled_dot_product_attention(self.q[i], k, v, attn_mask=mask, enable_gqa=True)

    def build_mask(self, i: int) -> torch.Tensor:
        return self.meta().full_mask()

    def float64_rows(self, i: int, rows: torch.Tensor) -> torch.Tensor:
        """float64 SDPA for query tokens `rows` → [B, len(rows), Hq, D]."""
        from redwood.attention import reference

        k, v, mask = reference.read_kv(self.cache, i, self._meta)
        q = self.q[i][:, :, rows].double()
        out = F.scaled_dot_product_attention(q, k.double(), v.double(), attn_mask=mask[:, :, rows], enable_gqa=True)
        return out.transpose(1, 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_layer(case: LayerCase, config: dict | None = None) -> dict:
    """The kernel's output, poisoned first, against float64 for 256 query tokens (and the reference path's
    bf16 output against the same, for scale)."""
    out = torch.full((case.B, case.T, HQ, D), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    case.prefill(0, config, out=out)
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(out).all())
    n = min(128, case.T)
    rows = torch.unique(torch.cat([torch.arange(n), torch.arange(case.T - n, case.T)])).to(DEVICE)
    want = case.float64_rows(0, rows)
    res = dict(finite=finite, err_vs_f64=rel(out[:, rows], want))
    try:
        res["ref_err_vs_f64"] = rel(case.reference(0)[:, rows], want)
    except torch.OutOfMemoryError:
        res["ref_err_vs_f64"] = None
    return res


def sdpa_backends() -> list[tuple[str, object]]:
    """(name, torch.nn.attention.SDPBackend) for the fused backends compared with the kernel (--sdpa)."""
    from torch.nn.attention import SDPBackend

    return [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]


def measure_layer(B: int, T: int, L: int, gen, sweep: bool, skip_decode: bool, sdpa: bool = False) -> dict:
    case = LayerCase(B, T, L, gen)
    row = dict(B=B, T=T, L=L, flops=case.flops, floor_ms=case.flops / PEAK_FLOPS * 1e3, sets=case.sets)
    row.update(check_layer(case))
    row["prefill_ms"] = time_ms(case.prefill, case.sets)
    row["prefill_tflops"] = case.flops / row["prefill_ms"] / 1e9
    if not skip_decode:
        try:
            row["decode_ms"] = time_ms(case.decode, case.sets)
            row["decode_err_vs_prefill"] = rel(case.decode(0), case.prefill(0))
        except Exception as e:  # noqa: BLE001 — report, keep going
            row["decode_ms"], row["decode_error"] = None, repr(e)[:200]
    try:
        row["mask_ms"] = time_ms(case.build_mask, 1, budget_s=1.0)
        row["reference_ms"] = time_ms(case.reference, case.sets, budget_s=4.0)
    except torch.OutOfMemoryError as e:
        row["reference_ms"], row["reference_error"] = None, repr(e)[:200]
    if sdpa:
        # torch's own fused attention backends on the same shape (contiguous K/V): what prefill would gain
        # from one of them (the kernel's rows are ragged and paged; these are not)
        n = min(128, case.T)
        rows = torch.unique(torch.cat([torch.arange(n), torch.arange(case.T - n, case.T)])).to(DEVICE)
        want = case.float64_rows(0, rows)
        for name, backend in sdpa_backends():
            try:
                ms = time_ms(lambda i, b=backend: case.sdpa(i, b), case.sets)
                err = rel(case.sdpa(0, backend).transpose(1, 2)[:, rows], want)
                row[f"sdpa_{name}_ms"], row[f"sdpa_{name}_err"] = ms, err
            except Exception as e:  # noqa: BLE001 — a backend that rejects the shape is reported
                row[f"sdpa_{name}_ms"], row[f"sdpa_{name}_error"] = None, repr(e)[:200]
        if hasattr(case, "_dense"):
            del case._dense
    torch.cuda.empty_cache()
    if sweep:
        row["sweep"] = []
        for cfg in SWEEP:
            try:
                entry = dict(cfg, **check_layer(case, cfg))
                entry["ms"] = time_ms(lambda i: case.prefill(i, cfg), case.sets)
                entry["tflops"] = case.flops / entry["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 — a config that does not compile (shared memory) is reported
                entry = dict(cfg, error=repr(e)[:200])
            row["sweep"].append(entry)
            print("  sweep", B, T, L, entry, flush=True)
    return row  # (the case's tensors go with it: main empties the allocator's cache between cases)


# ----------------------------------------------------------------------------------------------------
# A whole prefill chunk through the model


def qwen_1_5b():
    """A random-weight model of Qwen2.5-Coder-1.5B's shape, bf16 on the GPU, projections fused (as
    loading does for a GPU)."""
    from redwood.config import ModelConfig
    from redwood.models.transformer import Transformer

    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_layers=LAYERS,
        num_heads=HQ,
        num_kv_heads=HKV,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qkv_bias=True,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Transformer(cfg)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    model.set_execution()  # the CUDA backend (fused projections, the kernels)
    return model


def measure_chunk(model, B: int, T: int, L: int, gen) -> dict:
    from redwood.config import ExecutionConfig
    from redwood.engine import prefill
    from redwood.kv.cache import KVCache

    table, pages = shuffled_table(B, L + T, gen)
    cache = KVCache.paged(model.config, B, pages, PAGE, table.shape[1] * PAGE, torch.bfloat16, DEVICE)
    for layer in range(LAYERS):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    cache.block_table.copy_(table)
    cache.live.fill_(1)
    ids = [torch.randint(0, model.config.vocab_size, (L + T,), generator=gen).tolist() for _ in range(B)]
    rows, starts, stops = list(range(B)), [L] * B, [L + T] * B
    original = prefill._forward_tokens

    def run(_i=0):
        return prefill.prefill_rows(model, cache, rows, ids, starts, stops)

    params = LAYERS * (HIDDEN * (HQ + 2 * HKV) * D + HQ * D * HIDDEN + 3 * HIDDEN * INTERMEDIATE)  # 1.31e9
    flops = LAYERS * attn_flops(B, T, L) + 2.0 * params * B * T + 2.0 * HIDDEN * VOCAB * B
    res = dict(B=B, T=T, L=L, flops=flops, attn_flops=LAYERS * attn_flops(B, T, L), floor_ms=flops / PEAK_FLOPS * 1e3)
    logits = {}
    variants = (
        ("reference", "0", None),
        ("kernel", "1", None),
        ("kernel_budgeted", "1", lambda m, b, t: prefill.prefill_chunk(b, m.config.num_heads, t)),
    )
    with torch.inference_mode():
        for name, env, forward_tokens in variants:
            model.set_execution(ExecutionConfig(prefill_kernel=env == "1"))
            prefill._forward_tokens = forward_tokens or original
            try:
                step = prefill._forward_tokens(model, B, L + T)
                res[f"{name}_forward_tokens"] = min(step, T)
                res[f"{name}_ms"] = time_ms(run, 1, budget_s=6.0, max_reps=10)
                logits[name] = run()
            except torch.OutOfMemoryError as e:
                res[f"{name}_ms"], res[f"{name}_error"] = None, repr(e)[:200]
            finally:
                prefill._forward_tokens = original
                model.set_execution(ExecutionConfig())
            torch.cuda.empty_cache()
    if "reference" in logits:
        for name in ("kernel", "kernel_budgeted"):
            if name in logits:
                res[f"{name}_logits_err"] = rel(logits[name], logits["reference"])
                res[f"{name}_argmax_agree"] = float(
                    (logits[name].argmax(-1) == logits["reference"].argmax(-1)).float().mean()
                )
    for name in ("reference", "kernel", "kernel_budgeted"):
        if res.get(f"{name}_ms"):
            res[f"{name}_tflops"] = flops / res[f"{name}_ms"] / 1e9
    return res


# ----------------------------------------------------------------------------------------------------


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=None, help="B:T:L triples (default: the four above)")
    ap.add_argument("--sweep", action="store_true", help="time several tile configurations per case")
    ap.add_argument("--skip-model", action="store_true", help="only the per-layer attention")
    ap.add_argument("--skip-decode", action="store_true", help="no decode-kernel column")
    ap.add_argument("--sdpa", action="store_true", help="also torch SDPA's cuDNN and flash backends (contiguous K/V)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    need_cuda()
    import triton

    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases] if args.cases else CASES
    gen = torch.Generator().manual_seed(0)
    info = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        sms=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    print(info, flush=True)
    layers, chunks = [], []
    for B, T, L in cases:
        row = measure_layer(B, T, L, gen, args.sweep, args.skip_decode, args.sdpa)
        torch.cuda.empty_cache()
        print("layer", row, flush=True)
        layers.append(row)
    if not args.skip_model:
        model = qwen_1_5b()
        for B, T, L in cases:
            row = measure_chunk(model, B, T, L, gen)
            torch.cuda.empty_cache()
            print("chunk", row, flush=True)
            chunks.append(row)
        del model
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(info=info, layers=layers, chunks=chunks), f, indent=1)

    print(
        f"\n{info['gpu']}, triton {info['triton']}, torch {info['torch']}; bf16 Hq={HQ} Hkv={HKV} D={D}, "
        f"{PAGE}-slot pages; floor at {PEAK_FLOPS / 1e12:.0f} TFLOP/s"
    )
    print("one layer's attention (ms; TFLOP/s of the prefill kernel; err: vs float64 on 256 query rows)")
    print(
        f"{'B x T over L':>20} {'floor':>7} {'prefill':>8} {'TFLOP/s':>7} {'decode':>8} {'ref':>8} {'mask':>7} "
        f"{'ref/pre':>7} {'err':>8} {'ref err':>8} ok"
    )
    for r in layers:
        ratio = r["reference_ms"] / r["prefill_ms"] if r.get("reference_ms") else None
        print(
            f"{r['B']:>4} x {r['T']:>5} over {r['L']:>5} {r['floor_ms']:>7.2f} {r['prefill_ms']:>8.2f} "
            f"{r['prefill_tflops']:>7.0f} {fmt(r.get('decode_ms')):>8} {fmt(r.get('reference_ms')):>8} "
            f"{fmt(r.get('mask_ms')):>7} {fmt(ratio, '.1f'):>7} {r['err_vs_f64']:>8.1e} "
            f"{fmt(r.get('ref_err_vs_f64'), '.1e'):>8} {r['finite']}"
        )
        for name, _ in sdpa_backends() if args.sdpa else []:
            ms = r.get(f"sdpa_{name}_ms")
            print(
                f"{'':>20}   sdpa {name}: "
                + (
                    f"{ms:.2f} ms {r['flops'] / ms / 1e9:.0f} TFLOP/s err {r[f'sdpa_{name}_err']:.1e}"
                    if ms
                    else r.get(f"sdpa_{name}_error", "?")
                )
            )
        for e in r.get("sweep", []):
            print(
                f"{'':>20}   tiles {e['BLOCK_M']}x{e['BLOCK_N']} w{e['num_warps']} s{e['num_stages']}: "
                + (
                    f"{e['ms']:.2f} ms {e['tflops']:.0f} TFLOP/s err {e['err_vs_f64']:.1e} ok {e['finite']}"
                    if "ms" in e
                    else e.get("error", "?")
                )
            )
    if chunks:
        print(
            "whole prefill chunk through the 1.5B (prefill_rows, 28 layers; ms; forward tokens; TFLOP/s incl. matmuls)"
        )
        print(
            f"{'B x T over L':>20} {'floor':>7} {'ref':>8} {'fwd':>5} {'kernel':>8} {'fwd':>5} {'TFLOP/s':>7} "
            f"{'ref/ker':>7} {'budgeted':>8} {'logit err':>9}"
        )
        for r in chunks:
            ratio = (r["reference_ms"] / r["kernel_ms"]) if r.get("reference_ms") and r.get("kernel_ms") else None
            print(
                f"{r['B']:>4} x {r['T']:>5} over {r['L']:>5} {r['floor_ms']:>7.1f} {fmt(r.get('reference_ms'), '.1f'):>8} "
                f"{r.get('reference_forward_tokens', '-'):>5} {fmt(r.get('kernel_ms'), '.1f'):>8} "
                f"{r.get('kernel_forward_tokens', '-'):>5} {fmt(r.get('kernel_tflops'), '.0f'):>7} "
                f"{fmt(ratio, '.2f'):>7} {fmt(r.get('kernel_budgeted_ms'), '.1f'):>8} "
                f"{fmt(r.get('kernel_logits_err'), '.1e'):>9}"
            )


if __name__ == "__main__":
    main()
