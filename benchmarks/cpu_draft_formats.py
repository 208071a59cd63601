"""A draft model's CPU weight formats side by side in one process (issue 38, session 29): the one-token decode step
and how near each format's logits are to the float32 model's.

Usage: PYTHONPATH=src python benchmarks/cpu_draft_formats.py [--model qwen2.5-coder-0.5b-instruct]
    [--formats q4k kquant kquant+q4k-head] [--threads 1] [--rounds 5] [--steps 16] [--prompt 128]
Formats: any `--weights` value (`load_model(weights=)`), and "kquant+q4k-head": kquant (the file's own blocks:
the 0.5B's Q5_0 / Q8_0 / Q4_K / Q6_K) with the LM head re-quantized to Q4_K (an experiment: the 0.5B's untied head
is Q8_0, 151,936 × 896, ~38% of kquant's bytes a step). Each format loads once; a --prompt-token prefill (random
token ids, a fixed seed), then --rounds rounds of --steps one-token decode forwards, the formats in turn within each
round (so a load from elsewhere lands on all alike); the median round's ms a step. The logits of the prefill
against the float32 model's: relative L2 error and top-1 agreement over its positions. Short table last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from redwood.loading import load_model
from redwood.models.cpu_weights import PackedLinear


def load(model: str, fmt: str, f32):
    if fmt != "kquant+q4k-head":
        return load_model(model, weights=fmt).model
    m = load_model(model, weights="kquant").model
    if m.lm_head is None:
        raise SystemExit(f"{model} ties its head to the embedding: kquant+q4k-head needs an untied head")
    head = PackedLinear(f32.lm_head.weight.detach().float(), None, "q4k")
    m.lm_head = m.packed_head = head
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--formats", nargs="+", default=["q4k", "kquant", "kquant+q4k-head"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from redwood.cpu_kernels import kquant

    print(f"model {args.model}; threads {args.threads}; {kquant.describe()}")
    f32 = load_model(args.model, weights="float32").model
    models = {fmt: load(args.model, fmt, f32) for fmt in args.formats}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 30000, (1, args.prompt), generator=g)
    pos = torch.arange(args.prompt)[None]
    capacity = args.prompt + args.rounds * args.steps + 8
    rows = {}
    with torch.inference_mode():
        ref = f32(ids, pos, f32.new_cache(1, capacity))
        del f32
        caches = {}
        for fmt, m in models.items():
            cache = m.new_cache(1, capacity)
            y = m(ids, pos, cache)
            cache.commit(args.prompt)
            caches[fmt] = cache
            err = ((y - ref).norm() / ref.norm()).item()
            top1 = (y.argmax(-1) == ref.argmax(-1)).float().mean().item()
            rows[fmt] = {"err": err, "top1": top1, "ms": []}
        step_ids = torch.randint(100, 30000, (args.rounds * args.steps,), generator=g)
        for r in range(args.rounds):
            for fmt, m in models.items():
                t0 = time.perf_counter()
                for s in range(args.steps):
                    p = args.prompt + r * args.steps + s
                    m(step_ids[p - args.prompt].view(1, 1), torch.tensor([[p]]), caches[fmt])
                    caches[fmt].commit(1)
                rows[fmt]["ms"].append((time.perf_counter() - t0) / args.steps * 1e3)
    print()
    print("| format | decode step ms (median round) | rounds | logits rel. error vs float32 | top-1 = float32 |")
    print("|---|---|---|---|---|")
    for fmt, row in rows.items():
        ms = " ".join(f"{t:.1f}" for t in row["ms"])
        print(f"| {fmt} | {statistics.median(row['ms']):.2f} | {ms} | {row['err']:.4f} | {row['top1']:.3f} |")


if __name__ == "__main__":
    main()
