"""Large-sample end-to-end lossless test: every verifier × drafter against the exact target distribution.

Usage (from the repo root):
    PYTHONPATH=src python3 benchmarks/lossless_bench.py --device cuda --samples 1000000 --workers 12 \\
        --batch 4096 --time-limit 450 --output lossless.json
    PYTHONPATH=src python3 benchmarks/lossless_bench.py --device cpu --quick --samples 20000

See `redwood.bench.lossless` for the model, the exact distribution and the tests. The matrix: every
method (`--methods`, default all) at two sampling settings, and the full T × top-p × top-k grid for the
`--full-grid` methods (none with `--quick`). Prints one line per configuration, then the number of tests,
the least Holm-adjusted p and PASS / FAIL at --alpha; exits 1 on FAIL. --output writes the whole report
(every test, effect sizes) as JSON.

Throughput is bound by the engine's per-row host work (requests, stats, bookkeeping: tens of µs per row),
not by the device, so configurations run in parallel worker processes, each in parts of --part rows;
--time-limit stops starting parts after that many seconds (the cases keep the rows done; the report
lists those not sampled at all). With CUDA graphs each pooled cache holds 1024 slots per row (0.5 MB per
row for this target), so --batch × --workers bounds the GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from redwood.bench import lossless


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--samples", type=int, default=None, help="rows per configuration (default 1,000,000 on cuda, 20,000 on cpu)"
    )
    ap.add_argument("--quick", action="store_true", help="every method at the two small settings only")
    ap.add_argument("--methods", default=None, help=f"comma-separated subset of: {', '.join(lossless.METHODS)}")
    ap.add_argument(
        "--full-grid",
        default=None,
        help=f"methods run at the full grid (default {','.join(lossless.FULL_GRID_METHODS)}; '' none)",
    )
    ap.add_argument("--generated", type=int, default=lossless.GENERATED, help="tokens generated per row (K)")
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="rows per generate call (default 4096 on cuda, 1024 on cpu: smaller runs faster per row there)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes sampling configurations in parallel (default on cuda: min(12, cores − 2), "
        "each holding at most ~1.1 MB of GPU memory per batch row; on cpu 1)",
    )
    ap.add_argument("--part", type=int, default=250_000, help="rows per worker job (a case runs in parts)")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: start no part after this; cases keep the parts done (so the run ends in time)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads per sampling process")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="eager forwards on cuda")
    ap.add_argument("--alpha", type=float, default=lossless.ALPHA)
    ap.add_argument("--output", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if args.samples is None:
        args.samples = 1_000_000 if cuda else 20_000
    if args.batch is None:
        args.batch = 4096 if cuda else 1024
    if args.workers is None:
        args.workers = max(1, min(12, (os.cpu_count() or 1) - 2)) if cuda else 1
    return args


def split(names: str | None) -> list[str] | None:
    return None if names is None else [n for n in names.split(",") if n]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    cases = lossless.default_matrix(args.quick, split(args.methods), split(args.full_grid))
    # (this process scores the exact distributions with every thread; worker processes default to one)
    threads = args.threads or (torch.get_num_threads() if args.workers <= 1 else 1)
    settings = lossless.Settings(
        samples=args.samples,
        generated=args.generated,
        batch=args.batch,
        device=args.device,
        part=args.part,
        workers=args.workers,
        time_limit=args.time_limit,
        threads=threads,
        cuda_graphs=False if args.no_cuda_graphs else None,
        alpha=args.alpha,
    )
    t0 = time.perf_counter()
    report = lossless.run(cases, settings, log=lambda line: print(line, flush=True))
    if torch.cuda.is_available() and args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    print(lossless.format_table(report))
    print(f"wall time {report['wall_s']}s")
    return 0 if report["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
