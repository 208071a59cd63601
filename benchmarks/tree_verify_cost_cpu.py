"""What one verification forward costs on the CPU per tree shape: the target over a chain or tree of n nodes after a
fixed context, batch 1, loaded as `LLM` loads it (threads, weight format, C++ layers) — the denominator of a
draftless drafter's speed-up (its drafting is free). `cpu_step_rows.py` times causal rows per thread count; this
times tree shapes with their masks.

For each shape: the median wall time of `--reps` forwards of its n nodes (positions by depth, the tree's ancestor mask;
nothing committed, so every forward sees the same context), next to a one-token (AR) forward. Speculation pays when
tokens per step exceed this time ÷ the AR time.

    PYTHONPATH=src python benchmarks/tree_verify_cost_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--context 600]
        [--shapes chain:4 chain:6 default 3,2,1,1,1] [--reps 7] [--threads N]

Shapes: "default" (the suffix drafter's `DEFAULT_TREE`), a breadth-first branching like 3,2,1,1,1, or a tree spec.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from redwood import LLM
from redwood.engine.prefill import prefill_row
from redwood.speculation.suffix import DEFAULT_TREE
from redwood.speculation.trees import Tree, resolve_tree


def shape_tree(shape: str) -> Tree:
    if shape == "default":
        return DEFAULT_TREE
    if shape.replace(",", "").isdigit():
        return Tree.from_branching([int(c) for c in shape.split(",")])
    return resolve_tree(shape)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--shapes", nargs="+", default=["chain:4", "chain:6", "default", "3,2,1,1,1"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    model = LLM(args.model, threads=args.threads).model
    trees = {s: shape_tree(s) for s in args.shapes}
    cache = model.new_cache(1, args.context + max(t.size for t in trees.values()))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (args.context,), generator=g).tolist()
    prefill_row(model, cache.row(0), prompt, 0, len(prompt))
    cache.lengths[0] = args.context

    def timed(tree: Tree) -> float:  # seconds, median of the reps
        ids = torch.randint(100, 20000, (1, tree.size), generator=g)
        positions = cache.lengths[:, None] + tree.depths_tensor()[None]
        mask = None if tree.is_chain else tree.ancestor_mask()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            model(ids, positions, cache, new_mask=mask)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    ar = timed(Tree.chain(0))
    print(f"{'shape':<24} {'nodes':>5} {'depth':>5} {'ms':>8} {'×AR':>6}")
    print(f"{'AR (one token)':<24} {1:>5} {0:>5} {ar * 1e3:>8.1f} {1:>6.2f}")
    for name, tree in trees.items():
        t = timed(tree)
        print(f"{name:<24} {tree.size:>5} {tree.max_depth - 1:>5} {t * 1e3:>8.1f} {t / ar:>6.2f}")


if __name__ == "__main__":
    main()
