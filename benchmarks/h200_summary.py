"""The short P1–P5 table of issue 6 from the JSON that `benchmarks/h200_bench.sh` wrote under OUT.

Usage: python benchmarks/h200_summary.py OUT   (missing parts are listed as not run)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path):
    p = path / "report.json" if path.is_dir() else path
    return json.loads(p.read_text()) if p.is_file() else None


def p1(out: Path) -> list[str]:
    r = load(out / "p1")
    if r is None:
        return ["P1 not run"]
    red = next(x for x in r["runs"] if x["engine"] == "redwood")
    hf = next((x for x in r["runs"] if x["engine"] == "hf"), None)
    floor = r.get("floor", {})
    line = (
        f"P1 batch-1 AR 1.5B bf16: redwood {red['tokens_per_s']:.0f} tok/s = "
        f"{100 * floor.get('fraction_of_floor', 0):.0f}% of the {floor.get('floor_tokens_per_s', 0):.0f} tok/s floor "
        f"(goal ≥ 70%)"
    )
    if hf:
        line += f"; HF generate {hf['tokens_per_s']:.1f} tok/s → {red['tokens_per_s'] / hf['tokens_per_s']:.1f}× (goal ≥ 25×)"
    eager = load(out / "p1-eager")
    if eager:
        line += f"; eager (no graphs) {eager['runs'][0]['tokens_per_s']:.0f} tok/s"
    return [line]


def p2(out: Path) -> list[str]:
    lines = []
    for ds, temp, sfx in ((d, t, s) for d in ("humaneval", "mt-bench") for t in ("0", "0.6") for s in ("", "-int8")):
        r = load(out / "p2" / f"bench-{ds}-t{temp}{sfx}")
        if r is None:
            if not sfx:
                lines.append(f"P2 {ds} T={temp}: not run")
            continue
        summary_path = out / "p2" / f"tree-{ds}-t{temp}{sfx}.summary.json"
        text_ = summary_path.read_text() if summary_path.is_file() else ""
        pred = json.loads(text_[text_.index("{") :]) if "{" in text_ else {}
        runs = r["runs"]
        chains = [x for x in runs if str(x["tree"]).startswith("chain:")]
        trees = [x for x in runs if not str(x["tree"]).startswith("chain:")]
        best_chain = max(chains, key=lambda x: x["speedup"], default=None)
        tree = trees[0] if trees else None
        draft = " int8 draft" if sfx else ""
        text = f"P2 {ds:<9} T={temp:<3}{draft}: AR {runs[0]['ar_tokens_per_s']:.0f} tok/s"
        if best_chain:
            text += f"; best chain γ={best_chain['gamma']} {best_chain['speedup']:.2f}×"
        if tree:
            text += (
                f"; DP tree {tree['tree_size']} nodes {tree['speedup']:.2f}× ({tree['tokens_per_step']:.2f} tok/step"
            )
            if pred:
                text += (
                    f" vs {pred['expected_tokens']:.2f} predicted = "
                    f"{100 * tree['tokens_per_step'] / pred['expected_tokens']:.0f}%; "
                    f"predicted speedup {pred.get('predicted_speedup', 0):.2f}×"
                )
            text += ")"
        if r.get("aggregate", {}).get("greedy_identical_to_ar") is False:
            text += " OUTPUT DIFFERS"
        lines.append(text)
    return lines


def p3(out: Path) -> list[str]:
    lines = []
    for kv in ("streaming", "snapkv"):
        reports = [load(d) for d in sorted(out.glob(f"p3-{kv}*"), key=lambda d: (len(d.name), d.name))]
        reports = [r for r in reports if r is not None]
        if not reports:
            lines.append(f"P3 {kv}: not run")
            continue
        for r in reports:
            for b in r.get("best_gamma", []):
                run = next(
                    (
                        x
                        for x in r["runs"]
                        if x["batch_size"] == b["batch_size"]
                        and x["prefix_len"] == b["prefix_len"]
                        and x["tree"] == b["tree"]
                    ),
                    {},
                )
                mem = run.get("peak_memory_bytes")
                lines.append(
                    f"P3 selfspec {kv:<9} batch {b['batch_size']:>2} context {b['prefix_len']:>5}: "
                    f"best {b['tree']} {b['speedup']:.2f}× over AR ({run.get('ar_tokens_per_s', 0):.0f} → "
                    f"{b['tokens_per_s']:.0f} tok/s, {run.get('tokens_per_step', 0):.2f} tok/step"
                    + (f", peak {mem / 2**30:.1f} GiB" if mem else "")
                    + ")"
                    + _best_steady(r["runs"], b["batch_size"], b["prefix_len"])
                )
    for d in sorted(out.glob("p3tree-*")):  # a Sequoia tree for the self-draft next to chains
        r = load(d / "bench")
        if r is None:
            lines.append(f"P3 tree {d.name}: not run")
            continue
        for run in r["runs"]:
            lines.append(
                f"P3 tree {d.name} {_shape(run['tree'])}: {run['speedup']:.2f}× end-to-end, "
                f"{run.get('steady_speedup') or 0:.2f}× steady ({run['tokens_per_step']:.2f} tok/step, "
                f"{run.get('ms_per_step', 0):.1f} ms/step)"
            )
    return lines


def _shape(tree: str) -> str:
    """A run's draft shape: chain:γ, or a tree file's name."""
    return tree if tree.startswith("chain:") else f"tree {Path(tree).name}"


def _best_steady(runs: list[dict], batch: int, prefix: int) -> str:
    """'; steady best …' over the runs at (batch, prefix): the rate while every row generates (MagicDec's
    per-token measure; a server refilling finished rows sees it)."""
    cell = [x for x in runs if x["batch_size"] == batch and x["prefix_len"] == prefix and x.get("steady_speedup")]
    if not cell:
        return ""
    best = max(cell, key=lambda x: x["steady_speedup"])
    return f"; steady best {_shape(best['tree'])} {best['steady_speedup']:.2f}×"


def p4(out: Path) -> list[str]:
    p = out / "p4.json"
    if not p.is_file():
        return ["P4 not run"]
    data = json.loads(p.read_text())
    lines = []
    for x in data.get("results", []):
        lines.append(
            f"P4 {x['name']:<16}: kernel {x['ours_us']:.0f} µs = {x['ours_us'] / x['floor_us']:.2f}× the KV-read "
            f"floor ({x['floor_us']:.0f} µs; compute bound {x['compute_us']:.0f} µs), "
            f"{x['speedup_vs_sdpa']:.1f}× faster than SDPA"
        )
    return lines or ["P4: no rows"]


def p5(out: Path) -> list[str]:
    r = load(out / "p5" / "bench") or load(out / "p5")  # (results before session 4: p5/report.json)
    if r is None:
        return ["P5 not run"]
    lines = []
    for x in r["runs"]:
        lines.append(
            f"P5 offloaded {x['tree']} ({x['tree_size']} nodes): {x['tokens_per_s']:.1f} tok/s vs offloaded AR "
            f"{x['ar_tokens_per_s']:.1f} → {x['speedup']:.2f}× ({x['tokens_per_step']:.2f} tok/step; goal ≥ 5×)"
        )
    return lines


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
    for part in (p1, p2, p3, p4, p5):
        try:
            lines = part(out)
        except (KeyError, ValueError, StopIteration) as e:
            lines = [f"{part.__name__.upper()}: unreadable ({e!r})"]
        print("\n".join(lines))


if __name__ == "__main__":
    main()
