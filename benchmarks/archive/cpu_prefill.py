"""Prefill speed per CPU weight format (issue 20: int4 prefill was 4x slower than int8's).

Usage: OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_prefill.py [--formats float32 int8 int4]
    [--lengths 128 256 512] [--repeats 2]
Each format loads the 1.5B target once, then times a one-chunk prefill (one forward over the whole
prompt, KV written, last-position logits) of each length on HumanEval code, best of --repeats. int4 runs
twice: through torch's int4 kernel at every row count ("int4 kernel") and with forwards of
INT4_GEMM_ROWS rows or more unpacked to a bfloat16 gemm ("int4"), and says whether the greedy first token
agrees between the two.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from cpu_weights import held_out_texts
from redwood.loading import load_model
from redwood.models import cpu_weights

TARGET = "qwen2.5-coder-1.5b-instruct"


@torch.inference_mode()
def prefill_s(model, ids: list[int], repeats: int) -> tuple[float, int]:
    best, token = float("inf"), -1
    for _ in range(repeats):
        cache = model.new_cache(1, len(ids) + 1)
        t = time.perf_counter()
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache,
                       logits_at=torch.tensor([[len(ids) - 1]]))
        best = min(best, time.perf_counter() - t)
        token = int(logits[0, -1].argmax())
    return best, token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["float32", "int8", "int4"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 512])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gemm-rows", type=int, default=None, help="int4: INT4_GEMM_ROWS to try instead")
    args = ap.parse_args()
    if args.gemm_rows is not None:
        cpu_weights.INT4_GEMM_ROWS = args.gemm_rows
    rows = []
    for kind in args.formats:
        loaded = load_model(TARGET, weights=kind)
        code = held_out_texts(loaded.tokenizer, max(args.lengths))["code"]
        prefill_s(loaded.model, code[:16], 1)  # warm-up
        runs = [(kind, cpu_weights.INT4_GEMM_ROWS)]
        if kind == "int4":
            runs.insert(0, ("int4 kernel", 10**9))
        first = {}
        for label, gemm_rows in runs:
            saved, cpu_weights.INT4_GEMM_ROWS = cpu_weights.INT4_GEMM_ROWS, gemm_rows
            try:
                for n in args.lengths:
                    s, tok = prefill_s(loaded.model, code[:n], args.repeats)
                    same = "" if label == "int4 kernel" or kind != "int4" else str(tok == first[n])
                    first.setdefault(n, tok)
                    rows.append((label, n, s, same))
                    print(f"{label}: {n} tokens in {s:.2f} s = {n / s:.1f} tokens/s {same}", flush=True)
            finally:
                cpu_weights.INT4_GEMM_ROWS = saved
        del loaded
        gc.collect()
    print("\n| weights | prompt tokens | prefill s | tokens/s | first token == int4 kernel's |")
    print("|---|---|---|---|---|")
    for label, n, s, same in rows:
        print(f"| {label} | {n} | {s:.2f} | {n / s:.1f} | {same} |")


if __name__ == "__main__":
    main()
