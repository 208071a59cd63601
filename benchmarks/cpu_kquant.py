"""The kquant CPU kernel (redwood.cpu_kernels, issue 20) against its floor, variants side by side in one process.

Every Q4_K / Q6_K matrix of the 1.5B target's decoder layers (140 matrices, 0.79 GB in the kernel's layout:
more than the caches, so each pass streams from DRAM as a decode step does), multiplied by M activation rows
(M = 1: a decode step; 4: a γ 3 verify; 8), one pass per (variant, M) in turn, interleaved over --rounds
rounds; the median pass per (variant, M). Variants are the same source compiled with other macros
(`KQ_PREFETCH`: bytes prefetched ahead; each under its own operator namespace `KQ_NS`), so they run in one
process on the same data. The floor: one thread summing the same bytes as int64 (`torch.sum`), the rate one
core streams them at.

Usage: PYTHONPATH=src python benchmarks/cpu_kquant.py [--threads 1] [--rows 1 4 8] [--rounds 7] [--isa avx2]
    [--variant NAME=-DMACRO=VALUE,... ...]
Short table last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from redwood.cpu_kernels import kquant
from redwood.loading import gguf
from redwood.models.registry import model_path

DEFAULT_VARIANTS = [
    "pf0=-DKQ_PREFETCH=0",
    "pf1k=-DKQ_PREFETCH=1024",
    "pf2k=-DKQ_PREFETCH=2048",
    "pf4k=-DKQ_PREFETCH=4096",
]


def build(name: str, macros: list[str], source: str | None = None, isa: str = "avx512"):
    """The kernel (the package's kquant.cpp, layer.cpp and ops.cpp; or `source`, an older one-file kquant.cpp with
    its own operators) compiled with variant `isa`'s flags (kquant.VARIANTS) and `macros` under the operator
    namespace kq_<name>: its linear op."""
    from torch.utils import cpp_extension

    ns = f"kq_{name}"
    here = Path(kquant.__file__).parent
    sources = [source] if source else [str(here / s) for s in kquant.SOURCES]
    cpp_extension.load(
        name=f"redwood_kquant_bench_{name}",
        sources=sources,
        extra_cflags=kquant._COMMON_FLAGS + kquant.VARIANTS[isa][1] + [f"-DKQ_NS={ns}"] + macros,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return getattr(torch.ops, ns).kquant_linear


def matrices(name: str) -> list[tuple[torch.Tensor, int, int]]:
    """(packed rows, ggml type id, K) of every Q4_K / Q6_K decoder-layer matrix of a pulled GGUF model."""
    out = []
    with gguf._MappedFile(Path(model_path(name))) as f:
        for t in f.header.tensors.values():
            if t.name.startswith("blk.") and t.type_name in kquant.TYPES and len(t.shape) == 2:
                rows = gguf._as_bytes(f.raw(t)).view(t.shape[0], -1)
                out.append((kquant.pack(rows, t.type_name), kquant.TYPES[t.type_name][0], t.shape[1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isa", default="avx512", choices=list(kquant.VARIANTS), help="the variants' ISA (compiler flags)")
    ap.add_argument(
        "--variant",
        nargs="+",
        default=DEFAULT_VARIANTS,
        help="NAME[@SOURCE.cpp]=-DMACRO=VALUE[,-DMACRO2=VALUE] (comma-separated compiler flags; "
        "SOURCE: another version of kquant.cpp, e.g. `git show REV:src/redwood/cpu_kernels/kquant.cpp`)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = {}
    for v in args.variant:
        name, _, flags = v.partition("=")
        name, _, source = name.partition("@")
        variants[name] = build(name, [f for f in flags.split(",") if f], source or None, args.isa)
    mats = matrices(args.model)
    total = sum(m[0].numel() for m in mats)
    g = torch.Generator().manual_seed(0)
    xs = {(M, K): torch.randn(M, K, generator=g) for M in args.rows for K in {m[2] for m in mats}}
    flat = torch.cat([m[0].view(-1) for m in mats]).view(torch.int64)
    print(
        f"{len(mats)} matrices, {total / 1e9:.3f} GB; threads {args.threads}; variants "
        + ", ".join(f"{k}: {v}" for k, v in zip(variants, args.variant)),
        flush=True,
    )
    # hot: 384 rows of one Q4_K and one Q6_K matrix (~0.3 MB each, held in L2), many times over — the
    # kernel's compute rate without DRAM
    hot = []
    for typ in (12, 14):
        w, _, K = next(m for m in mats if m[1] == typ and m[2] == 1536)
        hot.append((w[:384].contiguous(), typ, K))
    hot_bytes = sum(h[0].numel() for h in hot) * 50
    times = {(v, M): [] for v in variants for M in args.rows}
    hot_times = {(v, M): [] for v in variants for M in args.rows}
    floor = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        flat.sum()
        floor.append(time.perf_counter() - t)
        for M in args.rows:
            for v, op in variants.items():
                t = time.perf_counter()
                for w, typ, K in mats:
                    op(xs[(M, K)], w, typ)
                times[(v, M)].append(time.perf_counter() - t)
                t = time.perf_counter()
                for _ in range(50):
                    for w, typ, K in hot:
                        op(xs[(M, K)], w, typ)
                hot_times[(v, M)].append(time.perf_counter() - t)
    fl = statistics.median(floor)
    print(f"\nfloor: int64 sum of the same bytes {fl * 1e3:.1f} ms = {total / fl / 1e9:.1f} GB/s")
    print("| variant | rows | ms a pass (median) | GB/s | × floor | × its 1 row | hot (L2) GB/s |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        one = statistics.median(times[(v, args.rows[0])])
        for M in args.rows:
            t = statistics.median(times[(v, M)])
            h = statistics.median(hot_times[(v, M)])
            print(
                f"| {v} | {M} | {t * 1e3:.1f} | {total / t / 1e9:.1f} | {t / fl:.2f} | {t / one:.2f} | "
                f"{hot_bytes / h / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
