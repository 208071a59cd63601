"""Where does a batched prefill wait for the GPU? (issue 40, item 3)

`prefill_overlap.py` found `prefill_rows` returning with ~0.5 ms of GPU work left on an H100: something inside it
reads a device value back (a host synchronization), so host work after it (prompt lookup's indexing) cannot
overlap the forwards. This runs one `prefill_rows` chunk of ROWS × CHUNK tokens on a Qwen2.5-1.5B-shaped random
model under `torch.cuda.set_sync_debug_mode("warn")` and prints each synchronizing call's innermost redwood frames,
counted, then the GPU time left when the call returned.

    PYTHONPATH=src:.:benchmarks python benchmarks/sync_points.py [--rows 2] [--chunk 8192] [--context 16384]
"""

from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings

import torch

from redwood.engine.prefill import prefill_rows
from redwood.kv.cache import KVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--context", type=int, default=16384)
    args = ap.parse_args()
    from decode_step import random_model

    model = random_model(True)
    cfg = model.config
    pages = args.rows * (-(-args.context // 128)) + 1
    cache = KVCache.paged(cfg, args.rows, pages, 128, args.context, torch.bfloat16, "cuda")
    width = cache.block_table.shape[1]
    cache.block_table.copy_(torch.arange(args.rows * width, dtype=torch.int32, device="cuda").view(args.rows, width))
    rows = list(range(args.rows))
    ids = [[(7 * i + r) % cfg.vocab_size for i in range(args.context)] for r in rows]
    sites: collections.Counter = collections.Counter()

    prefill_rows(model, cache, rows, ids, [0] * args.rows, [args.chunk] * args.rows)  # (compiles)

    def hook(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack() if "/redwood/" in f.filename]
        where = " <- ".join(f"{f.filename.split('/redwood/')[-1]}:{f.lineno} {f.name}" for f in reversed(stack[-4:]))
        sites[f"{str(message).splitlines()[0][:60]} @ {where}"] += 1

    warnings.showwarning = hook
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    torch.cuda.synchronize()
    prefill_rows(model, cache, rows, ids, [args.chunk] * args.rows, [2 * args.chunk] * args.rows)
    t = time.perf_counter()
    torch.cuda.synchronize()
    left = time.perf_counter() - t
    torch.cuda.set_sync_debug_mode("default")
    print(
        f"\n{args.rows} rows × {args.chunk} tokens after {args.chunk}: GPU time left after prefill_rows {left * 1e3:.2f} ms"
    )
    print("| synchronizing calls | site |")
    print("|---|---|")
    for site, n in sites.most_common(12):
        if n:
            print(f"| {n} | {site} |")


if __name__ == "__main__":
    main()
