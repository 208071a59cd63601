"""Decode-step latency of a Qwen2.5-Coder-1.5B-shaped model (random bf16 weights) on the GPU: the P1
ablation without staging real weights (time per step does not depend on the weights' values).

Usage: PYTHONPATH=src python benchmarks/decode_step.py [--shape 1.5b|0.5b] [--context 128] [--batch 1]
    [--tokens 1 5] [--quick] [--skinny-rows 8] [--tile-rows 9 64] [--pdl] [--int8] [--kernels]
    [--l2-prefetch 16 32]
Prints, per variant (eager / graphs, reference / Triton attention, fused kernels on / off, skinny-matmul
kernels on / off), the median time of one decode step, its tokens/s and its fraction of the weight-read
floor, short table last. --quick: only the graphed variants with the Triton attention kernel. --pdl: each
graphed variant also with programmatic dependent launch (`pdl.request`, redwood.kernels.pdl), side by side.
--l2-prefetch MB…: the graphed skinny variants again with each layer's o and first MB of gate/up prefetched
into L2 (`l2_prefetch.set_megabytes`, redwood.kernels.l2_prefetch), 0 off; with --pdl also each with PDL.
--int8: the skinny path reads int8 weight copies (as `--draft-weights int8` does for a CUDA draft). --kernels: per
variant and token count, the kernels of one forward (profiled eagerly: each kernel's GPU time is the same
in a graph) — count, their summed time, and the largest — so the graphed step's time splits into kernel
work and the gaps between kernels.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from redwood.bench.ar import copy_bandwidth, weight_bytes
from redwood.config import ExecutionConfig, ModelConfig
from redwood.engine.runner import StepRunner
from redwood.kernels import l2_prefetch, pdl
from redwood.models.transformer import build_model

QWEN_1_5B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
    "eos_token_id": 151645,
}
QWEN_0_5B = {
    **QWEN_1_5B,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
}
SHAPES = {"1.5b": QWEN_1_5B, "0.5b": QWEN_0_5B}


def random_model(fuse: bool, shape: dict = QWEN_1_5B):
    cfg = ModelConfig.from_hf_dict(shape)
    with torch.device("meta"):
        from redwood.models.transformer import Transformer

        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {k: (torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02) for k, s in shapes.items()}
    model = build_model(cfg, state, torch.bfloat16, "cuda")
    if fuse:
        model.set_execution()  # the CUDA backend (fused projections, the kernels); else the plain layers
    return model


def kernel_table(forward) -> list[tuple[str, int, float]]:
    """[(kernel name, calls, total µs)] of one eager forward(), largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sorted(((e.key, e.count, e.device_time_total) for e in events), key=lambda r: -r[2])


def print_kernels(label: str, table: list[tuple[str, int, float]], step_ms: float) -> None:
    calls, total = sum(r[1] for r in table), sum(r[2] for r in table) / 1e3
    print(
        f"{label}: {calls} kernels, {total:.3f} ms of kernel time; graphed step {step_ms:.3f} ms "
        f"→ {1e3 * (step_ms - total) / max(calls, 1):.2f} µs of gap per kernel"
    )
    for name, n, us in table[:10]:
        print(f"  {us:9.1f} µs {n:5d}x {us / n:7.2f} µs each  {name[:80]}")


def time_step(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median ms of fn() over `repeats` runs timed with CUDA events, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--skinny-rows",
        type=int,
        default=None,
        help="tokens per forward the skinny variants take through the skinny kernels (default: the "
        "tuned table's max_rows); compare with --tokens 2 4 8 to choose max_rows",
    )
    ap.add_argument(
        "--tile-rows",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="batch × tokens in [LO, HI] (within 9-64) that the skinny variants take through the tile "
        "kernel (default: the tuned table's tile_rows); compare with --batch 64 to choose tile_rows",
    )
    ap.add_argument("--int8", action="store_true", help="skinny variants read int8 weight copies")
    ap.add_argument("--kernels", action="store_true", help="list each variant's kernels per forward")
    ap.add_argument(
        "--pdl", action="store_true", help="also time each graphed variant with programmatic dependent launch"
    )
    ap.add_argument(
        "--l2-prefetch",
        type=float,
        nargs="+",
        default=[],
        metavar="MB",
        help="also time each graphed skinny variant with an L2 prefetch of MB (each value)",
    )
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    # (fused projections + small-op kernels, attention backend, graphs, skinny-matmul kernels)
    variants = [(f, a, g, False) for f in (False, True) for a in ("reference", "auto") for g in (False, True)]
    variants += [(True, "auto", g, True) for g in (False, True)]
    if args.quick:
        variants = [v for v in variants if v[1] == "auto" and v[2]]
    rows = []
    for fuse in (False, True):
        model = random_model(fuse, SHAPES[args.shape])
        if fuse and args.int8:
            model.quantize_skinny("int8")
        floor_ms = weight_bytes(model) / bw * 1e3
        runs = [(*v, "") for v in variants if v[0] == fuse]
        if args.pdl:
            runs += [(*v, "pdl") for v in variants if v[0] == fuse and v[2]]
        for mb in args.l2_prefetch:
            for pre in ("", "pdl ") if args.pdl else ("",):
                runs += [(*v, f"{pre}l2={mb:g}") for v in variants if v[0] == fuse and v[2] and v[3]]
        for _, backend, graphs, skinny, mode in runs:
            use_pdl = mode.startswith("pdl")
            l2_prefetch.set_megabytes(mode.split("l2=")[1] if "l2=" in mode else 0)
            if fuse:  # (the plain model keeps its reference backend; its attention is the A/B)
                model.set_execution(
                    ExecutionConfig(
                        attention=backend,
                        skinny=skinny,
                        megakernel="auto" if skinny else "off",
                        skinny_rows=args.skinny_rows if skinny else None,
                        skinny_tile_rows=tuple(args.tile_rows) if skinny and args.tile_rows is not None else None,
                    )
                )
            else:
                model.set_execution(ExecutionConfig(attention=backend, kernels="off"))
            pdl.request(use_pdl)  # read when the runner captures its graphs
            cache = model.new_cache(args.batch, args.context + 512)
            cache.lengths.fill_(args.context)
            runner = StepRunner(model, cache, use_graphs=graphs)
            for T in args.tokens:
                ids = torch.randint(0, 1000, (args.batch, T), device="cuda")
                pos = cache.lengths[:, None] + torch.arange(T, device="cuda")
                ms = time_step(lambda: runner.forward(ids, pos))
                rows.append(
                    (
                        f"fused={'yes' if fuse else 'no'} attn={backend} graphs={'yes' if graphs else 'no'}"
                        f"{' skinny' if skinny else ''}{' ' + mode if mode else ''}",
                        T,
                        ms,
                        args.batch * 1e3 / ms,
                        floor_ms / ms,
                    )
                )
                print(rows[-1], flush=True)
                if args.kernels and not mode:
                    eager = StepRunner(model, cache, use_graphs=False)
                    print_kernels(f"{rows[-1][0]} T={T}", kernel_table(lambda: eager.forward(ids, pos)), ms)
        del model
        torch.cuda.empty_cache()
    print(
        f"\nweight-read floor {floor_ms:.3f} ms/step at {bw / 1e12:.2f} TB/s; {args.shape}, batch {args.batch}, "
        f"context {args.context}"
    )
    print(f"{'variant':<51}{'T':>4}{'ms/step':>9}{'tok/s (T=1)':>13}{'floor/time':>11}")
    for name, T, ms, tps, frac in rows:
        print(f"{name:<51}{T:>4}{ms:>9.3f}{tps:>13.0f}{frac:>11.2f}")


if __name__ == "__main__":
    main()
