"""Triton decode/verify/tree attention vs the KV-read floor vs torch SDPA, per layer, on one GPU.

Run on the GPU machine from the repo root:
    PYTHONPATH=src:. python benchmarks/attention_bench.py --output out/attention_bench.json
Configurations (Hq=12, Hkv=2, D=128, bf16, 32K committed tokens per row):
    chains: batch 64, T = 1, 2, 4, 5, 8 new tokens per row (causal); T = 9, 11, 17: verifies of prompt lookup's
            chains of γ 8, 10, 16 (past T = 10 a KV head's 6·T query rows outgrow one 64-row tile: `--only width`);
    trees:  16/32/64/128 nodes (random tree masks) at batch 1, 4, 8;
    short:  a few hundred committed tokens — a batch-1 decode / 7-token verify (P1, P2) and a batch-64
            draft level through a 256- or 512-token compressed cache (P3): latency-bound, few programs;
    view:   the self-draft's draft level as the engine runs it — batch 64 / 16, one new token through a
            512-token StreamingLLM view (4 sinks + 508 recent) of 30K-token rows in a paged cache, the keys
            gathered one by one through ctx_idx and the block table (`--only view --sweep`: splits 1-16).
    span:   the same level with the view passed as its two slot ranges (ctx_span: sinks and window, read as
            contiguous tiles through one table lookup a tile — what the engine passes since session 33).
Each time is one layer's attention: a CUDA graph replays the call over enough distinct layers that
their K/V (more than the 60 MB L2) come from HBM, as in a real forward. The floor is the K and V bytes
read divided by 4.29e12 B/s (the device-to-device copy rate measured on an H200). SDPA gets the
boolean mask of `reference.AttentionMetadata.full_mask` (built outside the timing) and enable_gqa.
Each configuration also checks the kernel against SDPA (relative error). `--sweep` adds a num_splits
and block-size sweep on a few configurations. The table comes last on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.decode_step import time_step
from redwood.attention import triton_decode as td
from redwood.attention.reference import AttentionMetadata

HQ, HKV, D, CTX = 12, 2, 128, 32768
BANDWIDTH = 4.29e12  # B/s, device-to-device copy on an H200 (the device library's KINDS.md)
PEAK_FLOPS = 790e12  # dense bf16 matrix products measured on an H200 (same source)
L2_DEFEAT_BYTES = 512 * 2**20  # K/V bytes a timed graph walks through, so layers miss the L2


def random_tree(T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask [T, T] of a random tree in topological order."""
    anc = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        anc[i] |= anc[int(torch.randint(0, i, (1,), generator=gen))]
    return anc


class Case:
    """One configuration's inputs: `layers` distinct caches [B, Hkv, cap, D], q, lengths, mask."""

    def __init__(self, name: str, B: int, T: int, new_mask: torch.Tensor | None, gen: torch.Generator, ctx: int = CTX):
        self.name, self.B, self.T, self.ctx = name, B, T, ctx
        cap = ctx + T
        self.kv_bytes = 2 * B * HKV * (ctx + T) * D * 2  # K and V of one layer that the call reads
        self.layers = max(1, min(32, math.ceil(L2_DEFEAT_BYTES / self.kv_bytes)))
        dev = "cuda"
        self.k = torch.randn(self.layers, B, HKV, cap, D, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(self.layers, B, HKV, cap, D, device=dev, dtype=torch.bfloat16)
        self.q = torch.randn(B, T, HQ, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        self.lengths = torch.full((B,), ctx, device=dev, dtype=torch.int64)
        self.new_mask = None if new_mask is None else new_mask.to(dev)
        meta = AttentionMetadata(lengths=self.lengths, num_new=T, kv_len=ctx + T, new_mask=self.new_mask)
        self.packed_mask = meta.packed_new_mask()  # as the model passes it: packed once per forward
        self.sdpa_mask = meta.full_mask()  # [B, 1, T, S]
        self.floor_us = self.kv_bytes / BANDWIDTH * 1e6
        # QK^T and PV: 4 * D flops per (query head, new token, key) — big trees are compute-bound
        self.compute_us = 4 * D * B * HQ * T * (ctx + T) / PEAK_FLOPS * 1e6

    def splits(self) -> int:
        return td.num_splits_for(self.q, self.k[0], self.v[0], self.lengths, new_mask=self.packed_mask)

    def ours(self, layer: int, num_splits: int | None = None) -> torch.Tensor:
        return td.decode_attention(
            self.q, self.k[layer], self.v[layer], self.lengths, new_mask=self.packed_mask, num_splits=num_splits
        )  # [B, T, Hq, D]

    def sdpa(self, layer: int) -> torch.Tensor:
        S = self.ctx + self.T
        out = F.scaled_dot_product_attention(
            self.q, self.k[layer, :, :, :S], self.v[layer, :, :, :S], attn_mask=self.sdpa_mask, enable_gqa=True
        )
        return out.transpose(1, 2)


class ViewCase:
    """The self-draft's draft level: T new tokens per row attending through a StreamingLLM view — `sinks` first
    slots + the last `view - sinks` — of a paged cache whose rows hold `ctx` committed tokens, the view's keys
    gathered per key (ctx_idx [B, 1, C] and the block table, as the engine passes them). Only the pages the view
    touches are distinct (the others map to one page never read), so many layers fit and miss the L2."""

    PAGE = 128

    def __init__(
        self,
        name: str,
        B: int,
        T: int,
        gen: torch.Generator,
        ctx: int = CTX - 2048,
        view: int = 512,
        sinks: int = 4,
        device: str = "cuda",
        span: bool = False,
    ):
        self.name, self.B, self.T, self.ctx = name, B, T, ctx
        page, dev = self.PAGE, device
        n_logical = math.ceil((ctx + T) / page)
        idx = torch.cat([torch.arange(sinks), torch.arange(ctx - (view - sinks), ctx)])  # [C] logical slots
        touched = sorted({int(i) // page for i in idx} | set(range(ctx // page, n_logical)))
        self.kv_bytes = 2 * B * HKV * (view + T) * D * 2  # K and V of one layer that the call reads
        self.layers = max(1, min(32, math.ceil(L2_DEFEAT_BYTES / self.kv_bytes)))
        pages = 1 + B * len(touched)  # page 0: the shared never-read page
        self.k = torch.randn(self.layers, pages, HKV, page, D, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(self.layers, pages, HKV, page, D, device=dev, dtype=torch.bfloat16)
        table = torch.zeros(B, n_logical, dtype=torch.int32)
        perm = 1 + torch.randperm(pages - 1, generator=gen)  # rows' pages scattered through the pool
        table[:, touched] = perm.view(B, len(touched)).to(torch.int32)
        self.block_table = table.to(dev)
        self.ctx_idx = idx.view(1, 1, -1).expand(B, 1, -1).contiguous().to(dev)  # [B, 1, C]
        self.ctx_valid = torch.ones(B, 1, idx.numel(), dtype=torch.bool, device=dev)
        # what decode_attention takes besides q, the layer's caches and lengths: the view, as the engine passes it
        self.q = torch.randn(B, T, HQ, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        self.lengths = torch.full((B,), ctx, device=dev, dtype=torch.int64)
        if span:  # the same keys as two slot ranges (reference.SpanView → ctx_span)
            self.view_args = dict(ctx_span=(self.lengths, sinks, view - sinks), block_table=self.block_table)
        else:
            self.view_args = dict(ctx_idx=self.ctx_idx, ctx_valid=self.ctx_valid, block_table=self.block_table)
        self.packed_mask = None  # causal among the new tokens
        self.slots = torch.cat([idx, torch.arange(ctx, ctx + T)]).to(dev)  # what the reference gathers
        self.floor_us = self.kv_bytes / BANDWIDTH * 1e6
        self.compute_us = 4 * D * B * HQ * T * (view + T) / PEAK_FLOPS * 1e6

    def splits(self) -> int:
        return td.num_splits_for(self.q, self.k[0], self.v[0], self.lengths, **self.view_args)

    def ours(self, layer: int, num_splits: int | None = None) -> torch.Tensor:
        return td.decode_attention(
            self.q, self.k[layer], self.v[layer], self.lengths, num_splits=num_splits, **self.view_args
        )

    def _gathered(self, cache: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, C + T, D]: the view's keys then the new tokens', read through the block table."""
        pages = self.block_table[:, self.slots // self.PAGE].long()  # [B, C + T]
        return cache[pages, :, (self.slots % self.PAGE)[None, :]].permute(0, 2, 1, 3)

    def sdpa(self, layer: int) -> torch.Tensor:
        k, v = self._gathered(self.k[layer]), self._gathered(self.v[layer])
        C, T = self.ctx_idx.shape[2], self.T
        mask = torch.ones(T, C + T, dtype=torch.bool, device=k.device)
        mask[:, C:] = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
        out = F.scaled_dot_product_attention(self.q, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)


def time_per_layer(fn, layers: int, reps: int = 10) -> float:
    """Median µs per layer of fn(layer) over all layers, replayed as one CUDA graph (eager fallback)."""
    for layer in range(layers):  # compile / warm up outside the capture
        fn(layer)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer in range(layers):
                fn(layer)
        run = graph.replay
    except Exception:  # noqa: BLE001 — not capturable: time the eager calls
        torch.cuda.synchronize()

        def run():
            for layer in range(layers):
                fn(layer)

    return time_step(run, repeats=reps, warmup=1) * 1e3 / layers


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


SWEPT = ("chain B=64 T=1", "chain B=64 T=8", "tree B=1 n=16", "tree B=1 n=128", "tree B=8 n=16", "tree B=8 n=128")


def cases(gen: torch.Generator):
    """(name, factory) of every configuration: chains at batch 64, small trees at batch 64 (MagicDec
    self-speculation with a tree draft: P3's long-context serving point), then trees at batch 1-8."""
    for T in (1, 2, 4, 5, 8):
        yield f"chain B=64 T={T}", lambda T=T: Case(f"chain B=64 T={T}", 64, T, None, gen)
    for T in (9, 11, 17):  # (the auto policy's draftless chains past γ 8: is their verify width nearly free?)
        name = f"chain B=64 width T={T}"
        yield name, lambda T=T, name=name: Case(name, 64, T, None, gen)
    for n in (4, 8, 16):
        yield f"tree B=64 n={n}", lambda n=n: Case(f"tree B=64 n={n}", 64, n, random_tree(n, gen), gen)
    for B in (1, 4, 8):
        for n in (16, 32, 64, 128):
            yield f"tree B={B} n={n}", lambda B=B, n=n: Case(f"tree B={B} n={n}", B, n, random_tree(n, gen), gen)
    for B, T, ctx in ((1, 1, 384), (1, 7, 384), (64, 1, 256), (64, 1, 512)):
        name = f"short B={B} T={T} S={ctx}"
        yield name, lambda B=B, T=T, ctx=ctx, name=name: Case(name, B, T, None, gen, ctx)
    for B in (64, 16):  # the self-draft's draft level: a 512-token StreamingLLM view of a 30K-token paged row
        name = f"view B={B} T=1 C=512"
        yield name, lambda B=B, name=name: ViewCase(name, B, 1, gen)
    for B in (64, 16):  # … the same view as two slot ranges (the engine's StreamingLLM draft since session 33)
        name = f"span B={B} T=1 C=512"
        yield name, lambda B=B, name=name: ViewCase(name, B, 1, gen, span=True)


def measure(case: Case) -> dict:
    splits = case.splits()
    ours_us = time_per_layer(case.ours, case.layers)
    sdpa_us = time_per_layer(case.sdpa, min(case.layers, 4))
    err = rel_err(case.ours(0), case.sdpa(0))
    return dict(
        name=case.name,
        B=case.B,
        T=case.T,
        num_splits=splits,
        layers=case.layers,
        kv_mb=case.kv_bytes / 1e6,
        floor_us=case.floor_us,
        compute_us=case.compute_us,
        ours_us=ours_us,
        sdpa_us=sdpa_us,
        floor_frac=case.floor_us / ours_us,
        speedup_vs_sdpa=sdpa_us / ours_us,
        rel_err_vs_sdpa=err,
    )


def time_config(case, config: tuple, splits: int | None = None) -> float:
    """µs per layer of our kernel with the launch configuration (BLOCK_N, stages, warps, max BLOCK_M) forced,
    at `splits` splits (None: the rule's); nan where it cannot run (e.g. out of shared memory)."""
    base = td._launch_config
    block_n, stages, warps, max_m = config

    def cfg(M, Dh, dtype, big_smem=False, n_keys=None, view=False):
        c = base(M, Dh, dtype, big_smem, n_keys, view)
        c.update(
            BLOCK_N=block_n,
            num_stages=stages,
            num_warps=warps,
            BLOCK_M=max(16, min(td.triton.next_power_of_2(M), max_m)),
        )
        return c

    td._launch_config = cfg
    try:
        return time_per_layer(lambda layer: case.ours(layer, splits), case.layers, reps=5)
    except Exception as e:  # noqa: BLE001
        print(f"  {case.name}: config {config} x {splits} splits failed: {type(e).__name__}")
        return float("nan")
    finally:
        td._launch_config = base


def sweep(case: Case) -> list[dict]:
    """Our kernel at several num_splits and block configurations (for the heuristics)."""
    rows = []
    short = case.name.startswith(("short", "view", "span"))
    if case.name.startswith(("view", "span")):
        splits = (1, 2, 3, 4, 6, 8, 12, 16)
    elif short:
        splits = (1, 2, 3, 4, 6, 8)
    else:
        splits = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    for s in splits:
        us = time_per_layer(lambda layer: case.ours(layer, s), case.layers, reps=5)
        rows.append(dict(name=case.name, knob="num_splits", value=s, us=us))
    configs = (
        (64, 2, 4, 64),
        (64, 3, 4, 64),
        (64, 4, 4, 64),
        (128, 2, 4, 64),
        (128, 3, 8, 64),
        (32, 3, 4, 64),
        (64, 2, 4, 32),
        (64, 3, 4, 16),
        (64, 2, 8, 128),
        (64, 3, 8, 128),
        (128, 2, 8, 128),
    )
    if short:  # fewer, wider key steps: the few programs each walk the whole context
        configs = (
            (64, 2, 4, 64),
            (64, 3, 4, 64),
            (32, 2, 4, 64),
            (32, 4, 4, 64),
            (128, 1, 4, 64),
            (128, 2, 4, 64),
            (128, 2, 8, 64),
            (256, 1, 8, 64),
            (64, 2, 8, 64),
        )
    for config in configs:
        us = time_config(case, config)
        rows.append(dict(name=case.name, knob="BLOCK_N,stages,warps,max_M", value=list(config), us=us))
    if case.name.startswith(("view", "span")):  # the key tiles at several split counts (session 32: at the
        # rule's 4 splits a 128-key tile beat the 64-key default for the gathered view)
        grid = ((64, 2, 4, 64), (64, 3, 4, 64), (128, 1, 4, 64), (128, 2, 4, 64), (256, 1, 8, 64))
        for config, s in itertools.product(grid, (2, 3, 4, 6, 8)):
            us = time_config(case, config, s)
            rows.append(dict(name=case.name, knob="BLOCK_N,stages,warps,max_M,num_splits", value=[*config, s], us=us))
    for r in rows:
        print(f"  sweep {r['name']}: {r['knob']}={r['value']}: {r['us']:.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also sweep num_splits and block sizes")
    ap.add_argument("--only", help="run only configurations whose name contains this")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    results, sweeps = [], []
    for name, make in cases(gen):
        if args.only and args.only not in name:
            continue
        case = make()
        r = measure(case)
        print(
            f"{r['name']}: ours {r['ours_us']:.1f} us, floor {r['floor_us']:.1f} us, sdpa {r['sdpa_us']:.1f} us, "
            f"rel err {r['rel_err_vs_sdpa']:.1e}",
            flush=True,
        )
        results.append(r)
        if args.sweep and (case.name.startswith(("short", "view", "span")) or case.name in SWEPT):
            sweeps += sweep(case)
        del case
        torch.cuda.empty_cache()
    info = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=td.triton.__version__,
        seconds=time.time() - t0,
        hq=HQ,
        hkv=HKV,
        head_dim=D,
        context=CTX,
        dtype="bfloat16",
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(info=info, results=results, sweeps=sweeps), f, indent=1)
    print(
        f"\n{info['device']}, torch {info['torch']}, triton {info['triton']}; per layer, "
        f"Hq={HQ} Hkv={HKV} D={D} bf16, context {CTX}"
    )
    print("floor: K/V bytes / 4.29e12 B/s; flops: 4*D*Hq*T*S / 790e12 (trees of 64+ nodes are compute-bound)")
    print(
        f"{'config':<22}{'splits':>7}{'KV MB':>8}{'floor us':>10}{'flops us':>10}{'ours us':>10}{'%floor':>8}"
        f"{'SDPA us':>10}{'vs SDPA':>9}{'rel err':>9}"
    )
    for r in results:
        print(
            f"{r['name']:<22}{r['num_splits']:>7}{r['kv_mb']:>8.1f}{r['floor_us']:>10.1f}{r['compute_us']:>10.1f}"
            f"{r['ours_us']:>10.1f}{100 * r['floor_frac']:>7.0f}%{r['sdpa_us']:>10.1f}"
            f"{r['speedup_vs_sdpa']:>8.1f}x{r['rel_err_vs_sdpa']:>9.1e}"
        )


if __name__ == "__main__":
    main()
