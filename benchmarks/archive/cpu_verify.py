"""Cost of a T-token forward (a verify over T tokens) against a 1-token decode step, per CPU weight
format (issue 20 item 2): speculation pays only when a verify over γ + 1 tokens costs about one weight read.

Usage: OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_verify.py [--models NAME ...]
    [--formats float32 bfloat16 int8 int4] [--tokens 1 2 4 8 16] [--context 128] [--repeats 5]
Each forward writes T new tokens after a `--context`-token prompt and is not committed, so every repeat
reads the same cache. Median milliseconds per forward and its ratio to T = 1; short table last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpu_weights import formats
from redwood.bench.ar import copy_bandwidth, weight_bytes
from redwood.loading import load_model
from redwood.models.cpu_weights import WEIGHT_FORMATS


@torch.inference_mode()
def forward_ms(model, context: int, tokens: list[int], repeats: int) -> dict[int, float]:
    cache = model.new_cache(1, context + max(tokens) + 1)
    model(torch.arange(context)[None] + 100, torch.arange(context)[None], cache, logits_at=torch.tensor([[0]]))
    cache.commit(context)
    out = {}
    for T in tokens:
        ids, pos = torch.arange(T)[None] + 1000, torch.arange(context, context + T)[None]
        model(ids, pos, cache)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            model(ids, pos, cache)
            times.append(time.perf_counter() - t)
        out[T] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument("--formats", nargs="+", default=list(WEIGHT_FORMATS), choices=WEIGHT_FORMATS)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cpu"), repeats=5) / 1e9  # GB/s, bytes read + written
    print(f"threads {torch.get_num_threads()}, copy bandwidth {bw:.1f} GB/s", flush=True)
    rows = []
    for name in args.models:
        base = load_model(name, dtype="float32").model
        for kind, model in formats(base, args.formats):
            ms = forward_ms(model, args.context, args.tokens, args.repeats)
            floor = weight_bytes(model) / bw / 1e6
            rows.append((name, kind, floor, ms))
            print(f"{name} {kind}: floor {floor:.0f} ms; " + "  ".join(f"T={T} {v:.0f} ms ({v / ms[args.tokens[0]]:.2f}×)"
                                                               for T, v in ms.items()), flush=True)
            del model
        del base
    print("\n| model | weights | floor ms | " + " | ".join(f"T={T} ms (×T=1)" for T in args.tokens) + " |")
    print("|---|---|---|" + "---|" * len(args.tokens))
    for name, kind, floor, ms in rows:
        one = ms[args.tokens[0]]
        print(f"| {name} | {kind} | {floor:.0f} | " + " | ".join(f"{v:.0f} ({v / one:.2f})" for v in ms.values()) + " |")


if __name__ == "__main__":
    main()
