"""The paper cost model of tensor parallelism (docs/perf/tensor-parallel.md): per-rank bytes, all-reduce bytes, and
the projected P3 speedup (MagicDec self-speculation over a StreamingLLM draft cache, batch × 32K context) of an
8B at TP=1 / 2 / 8 on H200s — to be checked against issue 41's measurements.

Usage: python benchmarks/tp_projection.py [--gamma 4] [--tokens-per-step 3.28] [--allreduce-us 10 15] [--busbw 330]
Prints the model's inputs, then one row per (TP, batch): the per-rank weight and KV bytes (and whether they fit
in one H200's 141 GB), the AR step, a draft level, the verify and the speculative step (ms, with their
collectives' part), tokens/s of AR and of speculation, and the speedup — the short table last.

The model (per rank; every rank runs every layer on 1/N of the heads and of the MLP):
- a forward reads its weight share W/N and, for the target, its KV heads' share of every row's keys
  (B · C · kv_bytes / N), at the copy bandwidth BW (h200-floors.md: 4.29 TB/s), divided by the efficiency the
  1.5B's P3 steps reach at one GPU (AR / verify 0.91 of the floor: 16.1 ms measured vs 14.7 floor);
- a draft level (the target over its 512-token StreamingLLM window) costs its bytes at BW plus a fixed ~56 µs a
  layer (the 1.5B's measured 2.5 ms draft level at batch 64 less its 0.94 ms floor, over 28 layers: kernel
  gaps and small GEMMs at M = 64 — a cost that does not shrink with N, since every rank runs every layer);
- verify of γ + 1 tokens a row: 1.02 × the AR forward (one pass over the KV for all queries; docs/perf/attention.md);
- collectives: 2 L + 1 all-reduces of [B·T, H] (after o_proj and down_proj, and the embedding) — each a
  latency ℓ(N) (NCCL, small messages, in a CUDA graph) plus 2 (N−1)/N of its bytes at the bus bandwidth — and
  the logits' all-gather (float32 [B·T, V/N] a rank);
- a speculative step adds ~0.8 ms of sampling and bookkeeping (1.5B P3); speedup = E[tokens/step] · AR / spec.
"""

from __future__ import annotations

import argparse

# Llama-3.1-8B
V, H, F, L, HQ, HKV, D = 128256, 4096, 14336, 32, 32, 8, 128
BF16 = 2
LAYER = H * HQ * D + 2 * H * HKV * D + HQ * D * H + 3 * H * F  # parameters of one layer
WEIGHTS_READ = (L * LAYER + V * H) * BF16  # a forward reads every layer and the head (the embedding: one row)
WEIGHTS_HELD = (L * LAYER + 2 * V * H) * BF16
KV_TOKEN = 2 * HKV * D * BF16 * L  # K and V of one token, every layer
BW = 4.29e12  # H200 copy bandwidth (bytes/s)
MEMORY = 141e9  # one H200
EFF = 0.91  # AR / verify forwards: fraction of the read floor the 1.5B's P3 reached
DRAFT_FIXED_S = 56e-6  # a draft level's cost beyond its bytes, per layer (1.5B P3)
VERIFY = 1.02
STEP_OVERHEAD_S = 0.8e-3
CONTEXT, BUDGET = 32768, 512


def collectives_s(n: int, rows: int, latency_s: float, busbw: float) -> float:
    """The all-reduces and the logits' gather of one forward over `rows` = B · T tokens."""
    if n == 1:
        return 0.0
    ring = 2 * (n - 1) / n
    reduce = (2 * L + 1) * (latency_s + ring * rows * H * BF16 / busbw)
    gather = latency_s + (n - 1) / n * rows * V * 4 / busbw
    return reduce + gather


def project(
    n: int, batch: int, gamma: int, e_tokens: float, latency_s: float, busbw: float, fixed_s: float = DRAFT_FIXED_S
) -> dict:
    w, kv = WEIGHTS_READ / n, batch * CONTEXT * KV_TOKEN / n
    draft_kv = batch * BUDGET * KV_TOKEN / n
    c1, cv = collectives_s(n, batch, latency_s, busbw), collectives_s(n, batch * (gamma + 1), latency_s, busbw)
    ar = (w + kv) / BW / EFF + c1
    level = (w + draft_kv) / BW + L * fixed_s + c1
    verify = VERIFY * (w + kv) / BW / EFF + cv
    spec = verify + gamma * level + STEP_OVERHEAD_S
    return {
        "tp": n,
        "batch": batch,
        "weights_gb": WEIGHTS_HELD / n / 1e9,
        "kv_gb": kv / 1e9,
        "fits": WEIGHTS_HELD / n + kv < MEMORY * 0.95,
        "ar_ms": ar * 1e3,
        "ar_comm_ms": c1 * 1e3,
        "level_ms": level * 1e3,
        "verify_ms": verify * 1e3,
        "spec_ms": spec * 1e3,
        "spec_comm_ms": (cv + gamma * c1) * 1e3,
        "ar_tok_s": batch / ar,
        "spec_tok_s": e_tokens * batch / spec,
        "speedup": e_tokens * ar / spec,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument(
        "--tokens-per-step",
        type=float,
        default=3.28,
        help="E[tokens a row per speculative step] (default: the 1.5B's P3, 1.95× × 27.1 / 16.1 ms)",
    )
    p.add_argument("--allreduce-us", type=float, nargs=2, default=[10.0, 15.0], metavar=("TP2", "TP8"), help="ℓ(N), µs")
    p.add_argument("--busbw", type=float, default=330.0, help="NCCL bus bandwidth, GB/s (device notes: 329–361)")
    p.add_argument(
        "--draft-fixed-us", type=float, default=DRAFT_FIXED_S * 1e6, help="a draft level's fixed cost a layer, µs"
    )
    args = p.parse_args()
    lat = {1: 0.0, 2: args.allreduce_us[0] * 1e-6, 8: args.allreduce_us[1] * 1e-6}
    print(
        f"8B (Llama-3.1-8B shape): {WEIGHTS_READ / 1e9:.2f} GB read per forward, {KV_TOKEN / 1e3:.0f} KB of KV a token; "
        f"all-reduce {2 * H * BF16 // 1024} KiB a token a layer (2 × [H] bf16), {(2 * L + 1) * H * BF16 / 1e3:.0f} KB "
        f"a token a forward, logits gather {V * 4 / 1e3:.0f} KB a token; γ {args.gamma}, E {args.tokens_per_step}, "
        f"ℓ {args.allreduce_us} µs, bus {args.busbw} GB/s, a draft level's fixed {args.draft_fixed_us:g} µs a layer, "
        f"context {CONTEXT}, draft window {BUDGET}"
    )
    rows = [
        project(n, b, args.gamma, args.tokens_per_step, lat[n], args.busbw * 1e9, args.draft_fixed_us * 1e-6)
        for n, b in ((1, 16), (2, 16), (2, 32), (8, 32), (8, 64))
    ]
    print(
        f"{'TP':>3} {'batch':>5} {'W GB':>6} {'KV GB':>6} {'fits':>5} {'AR ms':>7} {'(comm)':>7} {'level':>6} "
        f"{'verify':>7} {'spec ms':>8} {'(comm)':>7} {'AR tok/s':>9} {'spec tok/s':>10} {'speedup':>8}"
    )
    for r in rows:
        print(
            f"{r['tp']:>3} {r['batch']:>5} {r['weights_gb']:>6.1f} {r['kv_gb']:>6.1f} {'yes' if r['fits'] else 'no':>5} "
            f"{r['ar_ms']:>7.2f} {r['ar_comm_ms']:>7.2f} {r['level_ms']:>6.2f} {r['verify_ms']:>7.2f} "
            f"{r['spec_ms']:>8.2f} {r['spec_comm_ms']:>7.2f} {r['ar_tok_s']:>9.0f} {r['spec_tok_s']:>10.0f} "
            f"{r['speedup']:>7.2f}x"
        )


if __name__ == "__main__":
    main()
