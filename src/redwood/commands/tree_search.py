"""`redwood tree-search`: the Sequoia DP for the tree maximising expected tokens per step, and with
`--profile` the (size, depth) minimising predicted time per token on the profiled hardware."""

from __future__ import annotations

import argparse
import json
import time

from redwood.errors import ConfigError
from redwood.progress import Progress
from redwood.speculation.config import MAX_DRAFT_DEPTH

# The largest --budget: the DP holds [budget, budget] arrays (134 MB each at 4096) and its time grows
# with budget² · depth · W — 4096 nodes, 65 levels and 8 ranks take about a minute on a 2-core machine,
# 100,000 nodes would take hours and ~80 GB. SpecExec's largest trees are a few thousand tokens.
MAX_BUDGET = 4096


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tree-search",
        help="find the optimal token tree for an acceptance vector (Sequoia DP)",
        description="Dynamic programming over the positional-acceptance model: the tree of at most BUDGET "
        "nodes and MAX_DEPTH levels (root counted) that maximises expected tokens per step. "
        "With --profile, the size and depth minimising predicted time per token.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--acceptance", metavar="FILE", help="acceptance vector (redwood.acceptance/1 JSON)")
    src.add_argument(
        "--acceptance-values",
        metavar="P1,P2,...",
        help="inline per-rank acceptance p_1,p_2,... (unconditional; sum ≤ 1)",
    )
    p.add_argument("--budget", type=int, required=True, metavar="N", help="most nodes, root included")
    p.add_argument("--max-depth", type=int, required=True, metavar="D", help="most levels, root counted")
    p.add_argument("--profile", metavar="FILE", help="latency profile (redwood.profile/1 JSON)")
    p.add_argument(
        "--sizes",
        choices=("all", "measured"),
        default="all",
        help="with --profile: consider every size (interpolating latencies; default) or only the profiled target sizes",
    )
    p.add_argument("--top", type=int, default=5, metavar="K", help="with --profile: candidates to list (default 5)")
    p.add_argument(
        "--no-per-depth",
        action="store_true",
        help="ignore the vector's per-depth rows and use its depth-aggregated values",
    )
    p.add_argument("--output", "-o", metavar="FILE", help="write the tree (redwood.tree/1 JSON)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.set_defaults(func=_run)


def _parse_values(text: str) -> list[float]:
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts:
        raise ConfigError("--acceptance-values is empty: give p_1,p_2,... e.g. 0.6,0.2,0.1")
    try:
        return [float(s) for s in parts]
    except ValueError:
        raise ConfigError(f"--acceptance-values must be comma-separated numbers, got {text!r}") from None


def _run(args: argparse.Namespace) -> int:
    from redwood.tuning.acceptance import AcceptanceVector, load_acceptance
    from redwood.tuning.tree_search import _provenance, load_profile, select_tree, solve_tree_dp

    if args.budget < 1:
        raise ConfigError(f"--budget must be at least 1, got {args.budget}")
    if args.budget > MAX_BUDGET:
        raise ConfigError(
            f"--budget must be at most {MAX_BUDGET} nodes, got {args.budget} (the DP's work and "
            f"memory grow with the budget squared; a larger tree is a prefill, not a decoding step)"
        )
    if args.max_depth < 1:
        raise ConfigError(f"--max-depth must be at least 1 (the root alone), got {args.max_depth}")
    if args.max_depth > MAX_DRAFT_DEPTH + 1:
        raise ConfigError(
            f"--max-depth must be at most {MAX_DRAFT_DEPTH + 1} levels (the root and "
            f"{MAX_DRAFT_DEPTH} draft tokens: what speculation accepts), got {args.max_depth}"
        )
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    if args.acceptance:
        vec = load_acceptance(args.acceptance)
    else:
        try:
            vec = AcceptanceVector.from_values(_parse_values(args.acceptance_values), notes={"source": "inline"})
        except ConfigError as e:
            raise ConfigError(f"--acceptance-values: {e}") from None
    per_depth = not args.no_per_depth
    profile = load_profile(args.profile) if args.profile else None

    t0 = time.perf_counter()
    bar = Progress(total=args.max_depth, desc=f"tree-search (budget {args.budget})", unit="levels")
    summary: dict = {
        "budget": args.budget,
        "max_depth": args.max_depth,
        "width": vec.width,
        "per_depth": bool(per_depth and vec.per_depth is not None),
    }
    if profile is None:
        with bar:
            dp = solve_tree_dp(vec, args.budget, args.max_depth, use_per_depth=per_depth, progress=bar.update)
        col = dp.results[:, args.max_depth]
        n = max(i for i in range(1, args.budget + 1) if col[i] > float("-inf"))
        expected = float(col[n])
        tree = dp.tree(n, args.max_depth, meta=_provenance(vec, args.budget, args.max_depth, expected))
        elapsed = time.perf_counter() - t0
        by_size = {}
        s = 1
        while s <= n:
            by_size[s] = float(col[s])
            s *= 2
        by_size[n] = expected
        summary.update(
            {
                "size": tree.size,
                "depth": tree.max_depth,
                "widths": list(tree.level_widths),
                "expected_tokens": expected,
                "expected_by_size": by_size,
                "seconds": elapsed,
            }
        )
    else:
        with bar:
            sel = select_tree(
                vec,
                profile,
                args.budget,
                args.max_depth,
                top=args.top,
                use_per_depth=per_depth,
                sizes=args.sizes,
                progress=bar.update,
            )
        elapsed = time.perf_counter() - t0
        tree, best = sel.tree, sel.best
        summary.update(
            {
                "size": tree.size,
                "depth": tree.max_depth,
                "widths": list(tree.level_widths),
                "expected_tokens": best.expected,
                "tau_ms": best.tau_ms,
                "baseline_ms": sel.baseline_ms,
                "predicted_speedup": best.speedup,
                "max_size_considered": sel.max_size,
                "skipped_too_wide": sel.skipped_wide,
                "seconds": elapsed,
                "candidates": [
                    {
                        "size": c.size,
                        "depth": c.depth,
                        "expected_tokens": c.expected,
                        "draft_ms": c.draft_ms,
                        "target_ms": c.target_ms,
                        "overhead_ms": c.overhead_ms,
                        "tau_ms": c.tau_ms,
                        "speedup": c.speedup,
                    }
                    for c in sel.candidates
                ],
            }
        )
    if args.output:
        tree.save(args.output)
        summary["output"] = str(args.output)

    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"acceptance: W={vec.width}, p_1..p_{min(vec.width, 4)} = "
        + ", ".join(f"{p:.4g}" for p in vec.values[:4])
        + (" ..." if vec.width > 4 else "")
        + (" (per depth)" if summary["per_depth"] else "")
    )
    print(f"tree: {tree.size} nodes, {tree.max_depth} levels, widths {' '.join(map(str, tree.level_widths))}")
    print(f"expected tokens per step: {summary['expected_tokens']:.4f}")
    if profile is None:
        print(
            f"by size (≤ {args.max_depth} levels): "
            + "  ".join(f"{k}: {v:.3f}" for k, v in summary["expected_by_size"].items())
        )
        if tree.size < args.budget:
            print(
                f"note: {args.budget} nodes do not fit in {args.max_depth} levels with {vec.width} ranks; "
                f"the largest tree that fits has {tree.size}"
            )
    else:
        print(
            f"selected: size {best.size}, depth {best.depth}; τ = {best.tau_ms:.4g} ms/token "
            f"(draft {best.draft_ms:.4g} + target {best.target_ms:.4g} + overhead {best.overhead_ms:.4g} ms "
            f"per step); baseline {sel.baseline_ms:.4g} ms/token; predicted speedup {best.speedup:.3f}x"
        )
        header = ["size", "depth", "E[tokens]", "draft ms", "target ms", "tau ms", "speedup"]
        rows = [
            [
                str(c.size),
                str(c.depth),
                f"{c.expected:.4f}",
                f"{c.draft_ms:.4g}",
                f"{c.target_ms:.4g}",
                f"{c.tau_ms:.4g}",
                f"{c.speedup:.3f}x",
            ]
            for c in sel.candidates
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for r in [header] + rows:
            print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
        notes = []
        if sel.max_size < args.budget:
            notes.append(f"sizes above {sel.max_size} (the largest profiled target size) were not considered")
        if sel.skipped_wide:
            notes.append(f"{sel.skipped_wide} candidate(s) had a level wider than the profiled draft widths")
        for n in notes:
            print(f"note: {n}")
    print(f"search time: {elapsed:.2f} s" + (f"; wrote {args.output}" if args.output else ""))
    return 0
