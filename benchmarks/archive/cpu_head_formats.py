"""Session 14 (docs/perf/cpu.md): the 1.5B's LM head (151936×1536; int8 under --weights gguf, from the file's
Q6_K) through other kernels at the same weights: the int8 kernel against its exact weight held as two int4 planes
along K (u = w8 + 128 = 16·hi + lo: plane 1 = (hi − 8)·16s, plane 2 = lo·s, summed by the int4 kernel over
[x, x]), and the plain int4 head (min/max re-quantized: +2.5% essay perplexity, session 13) for reference.
Rows 1 (a decode step) and 4 (a γ 3 verify), 1 and 2 threads interleaved, real hidden states from the model.

Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_head_formats.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from redwood.loading import load_model
from redwood.models.cpu_weights import INT4_GROUP, PackedLinear


def int4_planes(p8: PackedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 PackedLinear's weight as the int4 kernel's (packed [N, K], scale_zero [2K / 32, N, 2]) over K' = 2K."""
    N, K = p8.out_features, p8.in_features
    parts = []
    for s in range(0, N, 4096):
        u = p8.w8[s:s + 4096].to(torch.int32) + 128
        parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat([u >> 4, u & 15], 1), 1))
    sc = p8.scale.float()[None].expand(K // INT4_GROUP, N)
    scale = torch.cat([16 * sc, sc]).to(torch.bfloat16)
    zero = torch.cat([torch.zeros_like(sc), 8 * sc]).to(torch.bfloat16)
    return torch.cat(parts), torch.stack([scale, zero], -1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lm = load_model("qwen2.5-coder-1.5b-instruct", weights="gguf")
    m = lm.model
    head = m.packed_head
    assert head.kind == "int8"
    packed, sz = int4_planes(head)
    ids = lm.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +")
    with torch.inference_mode():
        cache = m.new_cache(1, len(ids))
        hidden = {}
        m.norm.register_forward_hook(lambda mod, i, o: hidden.__setitem__("h", o))
        m(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    h = hidden["h"][0, -4:].to(torch.bfloat16)  # [4, K]: the last 4 positions' normed hidden states
    int4 = PackedLinear(head.dequantized(), None, "int4")
    fns = {
        "int8 kernel": lambda x: torch.ops.aten._weight_int8pack_mm(x, head.w8, head.scale),
        "int8 as 2 int4 planes": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat([x, x], 1), packed, 32, sz),
        "int4 (re-quantized)": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4.packed, 32, int4.scale_zero),
    }
    ref = fns["int8 kernel"](h)
    planes = fns["int8 as 2 int4 planes"](h)
    print(f"planes vs int8 kernel: {(planes == ref).float().mean().item() * 100:.3f}% of logits equal, max diff "
          f"{(planes.float() - ref.float()).abs().max().item():.4g} (|logit| ≤ {ref.float().abs().max().item():.1f}); "
          f"argmax equal in {(planes.float().argmax(-1) == ref.float().argmax(-1)).sum().item()}/4 rows")
    times: dict = {}
    for _ in range(args.rounds):
        for th in (1, 2):
            torch.set_num_threads(th)
            for rows in (1, 4):
                for name, f in fns.items():
                    x = h[:rows]
                    f(x)
                    ts = []
                    for _ in range(5):
                        t = time.perf_counter()
                        f(x)
                        ts.append(time.perf_counter() - t)
                    times.setdefault((th, rows, name), []).append(statistics.median(ts) * 1e3)
    print(f"load average {os.getloadavg()[0]:.2f}; ms, best of {args.rounds} rounds (each a median of 5)")
    print("| threads | rows | " + " | ".join(fns) + " |\n|---|---|" + "---|" * len(fns))
    for th in (1, 2):
        for rows in (1, 4):
            print(f"| {th} | {rows} | " + " | ".join(f"{min(times[(th, rows, n)]):.1f}" for n in fns) + " |")


if __name__ == "__main__":
    main()
