"""The self-draft's draft level against its floor, without staging real weights: a Qwen2.5-1.5B-shaped model with
random bf16 weights (a level's time does not depend on their values) over a paged cache of B rows × L committed
tokens, pages scattered through the pool as the engine's allocator leaves them. One-token graphed forwards:

    ar        the whole context (an AR decode step: the verify's KV read)
    span      a StreamingLLM view (sinks + window) passed as its two slot ranges (reference.SpanView → the
              kernel's ctx_span): what the engine passes since session 33
    gathered  the same view passed as slot indices (ctx_idx / ctx_valid): the kernel gathers each key through the
              block table — what the engine passed before

Floors: the weights (every parameter read once, `bench.ar.weight_bytes`) plus the KV the forward reads (B × its
keys × the model's bytes a slot), over this GPU's measured copy bandwidth. --kernels: each forward's kernels,
profiled eagerly (count, summed time, the largest). The table is last.

    PYTHONPATH=src python3 benchmarks/draft_level.py --batch 64 --context 30720 [--kernels]
    PYTHONPATH=src python3 benchmarks/draft_level.py --device cpu --shape tiny --batch 2 --context 300   (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from decode_step import SHAPES, kernel_table, print_kernels, time_step

from redwood.attention.reference import SpanView
from redwood.bench.ar import copy_bandwidth, weight_bytes
from redwood.config import ModelConfig
from redwood.engine.runner import StepRunner
from redwood.kv.cache import KVCache
from redwood.kv.policies import StreamingPolicy
from redwood.models.transformer import Transformer, build_model

TINY = {
    **SHAPES["0.5b"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


class GatheredStreaming(StreamingPolicy):
    """StreamingLLM's view passed as slot indices (the kernel gathers each key): the path before SpanView."""

    def view(self, lengths: torch.Tensor):
        span = SpanView(lengths, self.sinks, self.window)
        return lambda layer: span(layer)  # (a plain callable: the model passes its indices, not the ranges)


def build(shape: dict, device: str) -> Transformer:
    cfg = ModelConfig.from_hf_dict(shape)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    state = {k: torch.randn(s, device=device, generator=g, dtype=dtype) * 0.02 for k, s in shapes.items()}
    model = build_model(cfg, state, dtype, device)
    model.set_execution()  # the device's backend, as the engine runs it
    return model


def scattered_cache(model: Transformer, batch: int, context: int, page: int, seed: int = 0) -> KVCache:
    """B rows of `context` committed slots (+ a page of scratch) in pages of `page` slots, placed at a random
    permutation of the pool (the allocator's order after requests come and go)."""
    per_row = -(-(context + page) // page)
    cache = KVCache.paged(model.kv_config, batch, batch * per_row, page, per_row * page, model.dtype, model.device)
    perm = torch.randperm(batch * per_row, generator=torch.Generator().manual_seed(seed))
    cache.block_table.copy_(perm.view(batch, per_row).to(cache.block_table))
    cache.lengths.fill_(context)
    cache.live.fill_(1)
    return cache


def timed(fn, device: str, repeats: int) -> float:
    if device == "cuda":
        return time_step(fn, repeats=repeats)
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1e3 / repeats


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=30720)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=508)
    ap.add_argument("--page", type=int, default=128, help="KV page size (the engine's default block size)")
    ap.add_argument("--shape", choices=[*sorted(SHAPES), "tiny"], default="1.5b")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--kernels", action="store_true", help="each forward's kernels (profiled eagerly)")
    ap.add_argument("--device", default="cuda", help="(cpu: a smoke run of the script, --shape tiny)")
    ap.add_argument("--output", help="write the table as JSON here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --device cpu --shape tiny for a smoke run)")
    model = build(TINY if args.shape == "tiny" else SHAPES[args.shape], args.device)
    cache = scattered_cache(model, args.batch, args.context, args.page)
    graphs = args.device == "cuda"
    runner = StepRunner(model, cache, use_graphs=graphs)
    ids = torch.randint(0, 500, (args.batch, 1), device=args.device)
    pos = cache.lengths[:, None].clone()
    bw = copy_bandwidth(torch.device(args.device)) if graphs else float("nan")
    weights = weight_bytes(model)
    view_keys = min(args.context, args.sinks + args.window)
    forwards = {
        "ar": (None, args.context),
        "span": (StreamingPolicy(args.sinks, args.window), view_keys),
        "gathered": (GatheredStreaming(args.sinks, args.window), view_keys),
    }
    outs, rows = {}, []
    for name, (policy, keys) in forwards.items():
        ms = timed(lambda policy=policy: runner.forward(ids, pos, policy=policy), args.device, args.repeats)
        outs[name] = runner.forward(ids, pos, policy=policy).float().clone()
        kv = args.batch * (keys + 1) * model.kv_slot_bytes
        floor_ms = (weights + kv) / bw * 1e3
        rows.append(dict(forward=name, ms=ms, floor_ms=floor_ms, kv_mb=kv / 1e6, times_floor=ms / floor_ms))
        print(rows[-1], flush=True)
        if args.kernels and graphs:
            eager = StepRunner(model, cache, use_graphs=False)
            print_kernels(name, kernel_table(lambda policy=policy: eager.forward(ids, pos, policy=policy)), ms)
    # the two views read the same keys: their logits agree up to summation order
    diff = (outs["span"] - outs["gathered"]).abs().max().item()
    info = dict(
        device=torch.cuda.get_device_name() if graphs else "cpu",
        torch=torch.__version__,
        shape=args.shape,
        batch=args.batch,
        context=args.context,
        sinks=args.sinks,
        window=args.window,
        page=args.page,
        bandwidth_tb_s=bw / 1e12,
        weights_mb=weights / 1e6,
        span_vs_gathered_max_abs_logit_diff=diff,
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)
    print(
        f"\n{info['device']}, torch {info['torch']}; {args.shape} random weights, batch {args.batch} × context "
        f"{args.context}, view {args.sinks} + {args.window}, pages of {args.page}; copy bandwidth "
        f"{info['bandwidth_tb_s']:.2f} TB/s; span vs gathered logits: max |diff| {diff:.2e}"
    )
    print(f"{'forward':<10}{'ms':>9}{'floor ms':>10}{'KV MB':>9}{'× floor':>9}")
    for r in rows:
        print(f"{r['forward']:<10}{r['ms']:>9.3f}{r['floor_ms']:>10.3f}{r['kv_mb']:>9.1f}{r['times_floor']:>9.2f}")


if __name__ == "__main__":
    main()
