"""The one-token megakernel (redwood.kernels.megakernel) against the skinny-kernel path, side by side in one
process: random bf16 weights of Qwen2.5-1.5B / 0.5B shape (or their int8 copies, quantize_skinny: a draft level), batch 1, CUDA-graphed forwards (StepRunner),
a cache holding `context` random keys; dense and paged (pages of 64) caches.

Usage: PYTHONPATH=src:benchmarks python benchmarks/megakernel_bench.py [--shapes 1.5b 0.5b] [--contexts 512 4096]
       [--caches dense paged] [--weights bf16 int8] [--variants "" "NSLOT=4" …] [--timeline]
Prints, per case, the agreement of the two paths' logits and new K/V (max |Δ| over max |logit|, argmax), the
megakernel's error flag, and the median ms per graphed forward of each path; a short table last. --variants builds
the megakernel once per --variants string of experiment #defines (megakernel.parse_defines) and times each side by side with the skinny path.
"""

from __future__ import annotations

import argparse
import time

import torch
from decode_step import SHAPES, random_model, time_step

from redwood.bench.ar import copy_bandwidth, weight_bytes
from redwood.config import ExecutionConfig
from redwood.engine.runner import StepRunner
from redwood.kernels import megakernel
from redwood.kv.cache import KVCache


def make_cache(model, context: int, paged: bool) -> KVCache:
    cfg = model.config
    if paged:
        cap = context + 512
        pages = -(-cap // 64)
        cache = KVCache.paged(cfg, 1, pages, 64, cap, torch.bfloat16, "cuda")
        perm = torch.randperm(pages, device="cuda").to(torch.int32)  # pages out of order: the table matters
        cache.block_table[0, :pages] = perm
        cache.live.fill_(1)
    else:
        cache = KVCache(cfg, 1, context + 512, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, device="cuda", dtype=torch.bfloat16))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, device="cuda", dtype=torch.bfloat16))
    cache.lengths.fill_(context)
    return cache


def new_kv(model, cache) -> torch.Tensor:
    """The K/V the last forward wrote at slot lengths[0] (every layer) → [2, L, Hkv, D]."""
    slot = int(cache.lengths[0])
    page = int(cache.block_table[0, slot // cache.k.shape[3]])
    return torch.stack([cache.k[:, page, :, slot % cache.k.shape[3]], cache.v[:, page, :, slot % cache.k.shape[3]]])


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1.5b", "0.5b"], choices=sorted(SHAPES))
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--caches", nargs="+", default=["dense", "paged"], choices=["dense", "paged"])
    ap.add_argument(
        "--weights",
        nargs="+",
        default=["bf16"],
        choices=["bf16", "int8"],
        help="int8: quantize_skinny's copies (the megakernel's W8 build vs the skinny int8 kernels)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=[""],
        help='experiment #defines strings ("NAME=VALUE …", megakernel.parse_defines), one megakernel '
        "build each (default: the computed defines only)",
    )
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="also print each case's stage timeline (a profiling build: globaltimer stamps per block)",
    )
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    rows = []
    for shape, weights in ((s, w) for s in args.shapes for w in args.weights):
        model = random_model(True, SHAPES[shape])
        if weights == "int8":
            model.quantize_skinny()
        floor_ms = weight_bytes(model) / bw * 1e3
        for context in args.contexts:
            for paged in (c == "paged" for c in args.caches):
                cache = make_cache(model, context, paged)
                ids = torch.randint(0, 1000, (1, 1), device="cuda")
                pos = cache.lengths[:, None].clone()
                model.set_execution(ExecutionConfig(megakernel="off"))
                ref = model(ids, pos, cache).clone()
                kv_ref = new_kv(model, cache).clone()
                runner = StepRunner(model, cache, use_graphs=True)
                t_skinny = time_step(lambda: runner.forward(ids, pos), repeats=args.repeats)  # noqa: F821 (ruff misreads the loop's del)
                for variant in args.variants:
                    model.set_execution(ExecutionConfig(megakernel="on"))  # (a ConfigError where it does not fit)
                    defines = megakernel.parse_defines(variant)
                    model.backend.set_megakernel(megakernel.MegaForward(model, int8=model.skinny_int8, defines=defines))
                    t0 = time.perf_counter()
                    out = model(ids, pos, cache)  # (the first forward of a new build compiles it with NVRTC)
                    torch.cuda.synchronize()
                    build_s = time.perf_counter() - t0
                    kv = new_kv(model, cache)
                    err = model.backend.megakernel.error()
                    rel = ((out - ref).abs().max() / ref.abs().max()).item()
                    kv_rel = ((kv.float() - kv_ref.float()).abs().max() / kv_ref.float().abs().max()).item()
                    same = bool(out.argmax() == ref.argmax())
                    runner = StepRunner(model, cache, use_graphs=True)
                    t_mega = time_step(lambda: runner.forward(ids, pos), repeats=args.repeats)  # noqa: F821
                    err = max(err, model.backend.megakernel.error())
                    name = f"{shape}{' int8' if weights == 'int8' else ''} {context} {'paged' if paged else 'dense'}{' ' + variant if variant else ''}"
                    if args.timeline:
                        model.backend.set_megakernel(
                            megakernel.MegaForward(model, profile=True, int8=model.skinny_int8, defines=defines)
                        )
                        for _ in range(5):
                            model(ids, pos, cache)
                        torch.cuda.synchronize()
                        print(f"{name} timeline (µs per stage, mean over layers):")
                        for kind, row in model.backend.megakernel.timeline().items():
                            print(
                                f"  {kind:<10} wait {row['wait']:7.2f}  work {row['work']:7.2f}  span {row['span']:8.2f}"
                                f"  max {row['max']:7.2f}  starve {row['starve']:7.2f}  stall {row['stall']:7.2f}"
                            )
                        phases = model.backend.megakernel.attention_phases()
                        print(
                            "  attention's slowest key block (µs): "
                            + "  ".join(f"{k} {v:.2f}" for k, v in phases.items())
                        )
                    model.set_execution(ExecutionConfig(megakernel="off"))
                    rows.append((name, t_skinny, t_mega, floor_ms, rel, kv_rel, same, err, build_s))
                    print(rows[-1], flush=True)
                del cache, runner
        del model
        torch.cuda.empty_cache()
    print(f"\nfloor = weight bytes / {bw / 1e12:.2f} TB/s (in-run copy bandwidth)")
    print(
        f"{'case':<36}{'skinny ms':>10}{'mega ms':>9}{'speedup':>8}{'floor':>7}{'mega/floor':>11}"
        f"{'logit rel':>11}{'kv rel':>9}{'argmax':>7}{'err':>5}{'1st s':>7}"
    )
    for name, t0, t1, fl, rel, kv_rel, same, err, build_s in rows:
        print(
            f"{name:<36}{t0:>10.3f}{t1:>9.3f}{t0 / t1:>8.2f}{fl:>7.3f}{fl / t1:>11.2f}{rel:>11.2e}{kv_rel:>9.2e}"
            f"{str(same):>7}{err:>5}{build_s:>7.1f}"
        )
    print("1st s: the megakernel's first forward (an NVRTC compile where the build is new)")


if __name__ == "__main__":
    main()
