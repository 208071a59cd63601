"""Batch-1 matrix-vector products of the Qwen2.5 1.5B / 0.5B projections: cuBLAS (`F.linear`) vs
redwood's Triton kernel (`redwood.kernels.gemv`, with the op each projection fuses: norm, bias, residual
add, SiLU·up), against the weight-read floor; optionally a sweep of tile configs whose winners are
written as this GPU's tuned table (`--write`, read by redwood.kernels.gemv).

Each timing replays one CUDA graph of `--calls` products cycling through enough weight copies that the
weights come from HBM, not L2 (≥ 256 MB per shape) — launch gaps inside a graph included, as in a
decode step. Usage:
    PYTHONPATH=src:. python benchmarks/gemv_bench.py [--sweep] [--int8] [--write src/redwood/kernels/gemv_configs]
--int8 also times every matrix with int8 weights (per-row scales; `--draft-weights int8` on CUDA), vs bf16 cuBLAS;
--rows 1 2 4 8 times 2-8 activation rows too (the CUDA-core rows kernel and the tensor-core tile kernel,
whichever config wins); --rows 16 32 64 the tile kernel at batched-decoding sizes (P3's batch-64 draft
levels), where the cuBLAS+ops column adds the small kernels the fused op replaces on that path (the norm
before, SiLU·up after; the residual add is folded into the next norm there, so it adds nothing).
--write merges into the existing table; its max_rows (how many tokens the model's skinny path takes) is
set with --max-rows, its tile_rows with --tile-rows, from what `decode_step.py --skinny-rows / --tile-rows`
measures.
Prints, per matrix: floor, cuBLAS, ours (table or heuristic config), best of the sweep (µs per
product), ours in GB/s and the best config; short table last.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.decode_step import time_step
from redwood.bench.ar import copy_bandwidth
from redwood.kernels import fused, gemv, qkv_rope, skinny_configs
from redwood.kernels.triton_import import triton

# (name, N, K, fused op): one layer's projections and the LM head, as the model's skinny path calls them;
# "rope": the q/k/v projection with RoPE and the cache write (qkv_rope.qkv_rope_write; heads in ROPE_HEADS)
MATRICES = [
    ("1.5b qkv", 2048, 1536, "norm+bias+rope"),
    ("1.5b o", 1536, 1536, "residual"),
    ("1.5b gate_up", 8960, 1536, "norm+silu"),
    ("1.5b down", 1536, 8960, "residual"),
    ("1.5b lm_head", 151936, 1536, "norm"),
    ("0.5b qkv", 1152, 896, "norm+bias+rope"),
    ("0.5b o", 896, 896, "residual"),
    ("0.5b gate_up", 4864, 896, "norm+silu"),
    ("0.5b down", 896, 4864, "residual"),
    ("0.5b lm_head", 151936, 896, "norm"),
]
ROPE_HEADS = {"1.5b": (12, 2, 128), "0.5b": (14, 2, 64)}  # (Hq, Hkv, D)
# BLOCK_K up to 16384 and 16 warps: one K step per program for the down projections (K 4864 / 8960), so
# each program's loads are all in flight at once (these small matrices are latency-bound)
SWEEP = dict(block_n=(1, 2, 4, 8, 16), block_k=(512, 1024, 2048, 4096, 8192, 16384), warps=(4, 8, 16), stages=(1, 2))
# 2-8 rows: GEMV-shaped configs (BLOCK_N < 16: the CUDA-core rows kernel) and a few tensor-core tiles
# (BLOCK_N ≥ 16: the tile kernel, which lost to cuBLAS everywhere but o_proj in session 5's full sweep)
SWEEP_ROWS_GEMV = dict(block_n=(2, 4, 8), block_k=(512, 1024, 2048), warps=(4, 8), stages=(1, 2))
SWEEP_ROWS = dict(block_n=(16, 64), block_k=(64, 128), warps=(4,), stages=(3,))
# 9-64 rows: tensor-core tiles only (a tile's weight elements ≤ 16K: registers and shared memory)
SWEEP_TILE = dict(block_n=(16, 32, 64), block_k=(64, 128), warps=(4, 8), stages=(3,))


def graph_time_us(fn, copies: int, calls: int) -> float:
    """µs per call of fn(i) (i cycling over copies), replayed as one CUDA graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(copies, 3)):
            fn(i)  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    ms = time_step(graph.replay, repeats=20, warmup=3)
    return ms * 1e3 / calls


def cublas_path(x, w, b, kw):
    """x @ wᵀ (+ b) as the model's non-skinny path computes it: the fused RMSNorm kernel before the cuBLAS
    product where the skinny kernel folds a norm in, the SiLU·up kernel after it where it fuses SiLU."""
    if kw["norm"] is not None:
        x = fused.rms_norm(x, *kw["norm"])
    y = F.linear(x, w, b)
    return fused.silu_mul(y) if kw["silu_mul"] else y


def table_json(
    device_name: str,
    entries: list[dict],
    max_rows: int = 1,
    tile_rows=None,
    made_by: str = "benchmarks/gemv_bench.py --sweep [--int8] [--rows R...] --write",
) -> str:
    """The tuned table's text: a header, then one line per matrix."""
    header = {
        "device": device_name,
        "made_by": made_by,
        "config": "[BLOCK_N, BLOCK_K, num_warps, num_stages]",
        "max_rows": max_rows,
    }
    if tile_rows:
        header["tile_rows"] = list(tile_rows)
    head = json.dumps(header, indent=1)
    body = ",\n  ".join(json.dumps(e) for e in entries)
    return head[:-2] + ',\n "configs": [\n  ' + body + "\n ]\n}\n"


def sweep_configs(silu: bool, rows: int = 1):
    if rows > 8:
        for bn, bk, nw, st in itertools.product(*SWEEP_TILE.values()):
            if bn * bk * (2 if silu else 1) <= 16384:
                yield bn, bk, nw, st
        return
    if rows > 1:
        for bn, bk, nw, st in itertools.product(*SWEEP_ROWS_GEMV.values()):
            if bn * bk * (2 if silu else 1) <= 64 * 32 * nw:
                yield bn, bk, nw, st
        for bn, bk, nw, st in itertools.product(*SWEEP_ROWS.values()):  # tensor-core tiles
            if bn * bk * (2 if silu else 1) <= 16384:
                yield bn, bk, nw, st
        return
    for bn, bk, nw, st in itertools.product(*SWEEP.values()):
        if bn * bk * (2 if silu else 1) <= 64 * 32 * nw:  # ≤ 64 tile elements per thread
            yield bn, bk, nw, st


def merged(path: Path, entries: list[dict]) -> tuple[list[dict], int, list[int] | None]:
    """The entries of an existing table at `path` with `entries` replacing those of the same key; and
    its max_rows (1 if none) and tile_rows (None if none)."""

    def key(e):
        return e["N"], e["K"], e["silu"], e.get("weight", "float"), e.get("rows", 1)

    old = json.loads(path.read_text()) if path.exists() else {}
    out = {key(e): e for e in old.get("configs", [])}
    out.update({key(e): e for e in entries})
    return list(out.values()), int(old.get("max_rows", 1)), old.get("tile_rows")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=64, help="products per graph (LM heads: 1/8 of it)")
    ap.add_argument("--sweep", action="store_true", help="time every tile config of SWEEP too")
    ap.add_argument("--write", type=Path, help="folder to write this GPU's table of best configs into")
    ap.add_argument("--int8", action="store_true", help="also time int8 weights (per-row scales)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="activation rows to time (1-64; default 1)")
    ap.add_argument("--only", default="", help="matrices whose name contains this (e.g. '0.5b', 'lm_head')")
    ap.add_argument(
        "--weights",
        choices=("all", "float", "int8"),
        default="all",
        help="with --int8: time only these weights (default: bf16 and int8)",
    )
    ap.add_argument("--block-k", type=int, nargs="+", help="with --sweep: only these BLOCK_K values (one row)")
    ap.add_argument(
        "--tile-rows",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="with --write: the table's tile_rows (batch × tokens in [LO, HI] within 9-64 take the tile "
        "kernel; set it from decode_step.py --tile-rows)",
    )
    ap.add_argument(
        "--max-rows",
        type=int,
        default=None,
        help="with --write: the table's max_rows (the model's skinny path takes forwards of up to "
        "this many tokens; set it from decode_step.py --skinny-rows; default: keep the file's)",
    )
    args = ap.parse_args()
    if args.block_k:
        SWEEP["block_k"] = tuple(args.block_k)
    kinds = ("float", "int8") if args.int8 else ("float",)
    kinds = tuple(k for k in kinds if args.weights in ("all", k))
    matrices = [m for m in MATRICES if args.only in m[0]]
    if not matrices or not kinds:
        ap.error(
            f"nothing to time: --only {args.only!r} matches none of {[m[0] for m in MATRICES]}, or "
            "--weights int8 without --int8"
        )
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    table, tuned = [], []
    for (name, N, K, op), kind, M in itertools.product(matrices, kinds, args.rows):
        if M > 1:
            op = op.replace("+rope", "")  # the rope fusion is for one token
        silu = "silu" in op
        rows = 2 * N if silu else N
        nbytes = rows * K * (1 if kind == "int8" else 2)
        copies = max(1, -(-(256 << 20) // nbytes))
        calls = args.calls if nbytes < (64 << 20) else max(4, args.calls // 8)
        ws = [torch.randn(rows, K, device=dev, dtype=torch.bfloat16) * K**-0.5 for _ in range(copies)]
        qs = [gemv.quantize_int8(w) for w in ws] if kind == "int8" else [(w, None) for w in ws]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        g = torch.rand(K, device=dev, dtype=torch.bfloat16) + 0.5
        b = torch.randn(rows, device=dev, dtype=torch.bfloat16) if "bias" in op else None
        r = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        kw = dict(norm=(g, 1e-6) if "norm" in op else None, silu_mul=silu)

        if "rope" in op:
            hq, hkv, d = ROPE_HEADS[name.split()[0]]
            rope = dict(
                cos=torch.rand(1, 1, d, device=dev, dtype=torch.bfloat16),
                sin=torch.rand(1, 1, d, device=dev, dtype=torch.bfloat16),
                k_cache=torch.zeros(1, hkv, 64, d, device=dev, dtype=torch.bfloat16),
                v_cache=torch.zeros(1, hkv, 64, d, device=dev, dtype=torch.bfloat16),
                pages=torch.zeros(1, 1, dtype=torch.long, device=dev),
                offsets=torch.tensor([[5]], device=dev),
                num_heads=hq,
            )

        def ours(i, cfg=None):
            w, scale = qs[i]
            if "rope" in op:
                return qkv_rope.qkv_rope_write(x.view(1, 1, K), w, b, scale=scale, norm=kw["norm"], config=cfg, **rope)
            return gemv.linear(x, w, b, scale=scale, residual=r if op == "residual" else None, config=cfg, **kw)

        cublas = graph_time_us(lambda i: F.linear(x, ws[i], b), copies, calls)
        # the same product as the model's other path runs it: cuBLAS plus the small kernels it needs around
        cublas_ops = graph_time_us(lambda i: cublas_path(x, ws[i], b, kw), copies, calls)
        mine = graph_time_us(ours, copies, calls)
        best, best_cfg = mine, None
        two = silu or "rope" in op  # two weight-row streams per program (gate/up, or a rotation pair)
        key_n = N // 2 if "rope" in op else N  # rope configs are looked up as a two-stream GEMV of N/2 pairs
        if args.sweep:
            for cfg in sweep_configs(two, M):
                try:  # a config may not fit this GPU (shared memory, registers): raised at the warm-up call
                    us = graph_time_us(lambda i: ours(i, cfg), copies, calls)
                except triton.runtime.errors.OutOfResources as e:
                    print(f"  {cfg}: {e}", flush=True)
                    continue
                if us < best:
                    best, best_cfg = us, cfg
        used = skinny_configs.config_for(key_n, K, two, dev, int8=kind == "int8", rows=M)
        entry = {
            "N": key_n,
            "K": K,
            "silu": two,
            "weight": kind,
            "config": list(best_cfg or used),
            "us": round(best, 2),
        }
        if M > 1:
            entry["rows"] = skinny_configs.rows_bucket(M)
        tuned.append(entry)
        label = f"{name}{' int8' if kind == 'int8' else ''}{f' ×{M}' if M > 1 else ''}"
        table.append((label, op, nbytes / bw * 1e6, cublas, cublas_ops, mine, best, nbytes, best_cfg or used))
        print(table[-1], flush=True)
        ws = qs = None  # free this matrix's copies before the next one's
        torch.cuda.empty_cache()
    if args.write:
        name = torch.cuda.get_device_name(dev)
        args.write.mkdir(parents=True, exist_ok=True)
        path = args.write / (skinny_configs._file_stem(name) + ".json")
        entries, max_rows, tile_rows = merged(path, tuned)
        path.write_text(table_json(name, entries, args.max_rows or max_rows, args.tile_rows or tile_rows))
        print(f"wrote {path}")
    print(
        f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; µs per product (CUDA graphs of {args.calls} products, LM "
        "heads fewer); ours = tuned table or heuristic; cuBLAS = F.linear (+ bias) without the fused op"
    )
    print(
        f"{'matrix':<19}{'fused':<15}{'floor':>7}{'cuBLAS':>8}{'+ops':>8}{'ours':>8}{'best':>8}"
        f"{'(cuBLAS+ops)/best':>18}{'ours GB/s':>10}  best config"
    )
    for name, op, floor, cb, cb_ops, mine, best, nbytes, cfg in table:
        print(
            f"{name:<19}{op:<15}{floor:>7.1f}{cb:>8.1f}{cb_ops:>8.1f}{mine:>8.1f}{best:>8.1f}{cb_ops / best:>18.2f}"
            f"{nbytes / mine / 1e3:>10.0f}  {cfg}"
        )


if __name__ == "__main__":
    main()
