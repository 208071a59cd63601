"""The automatic policy's cells side by side (issue 40 item 2): one row per cell of `h200_bench.sh auto`.

Each cell ran `bench throughput` once per plan (`--gamma 3`, `--speculative auto`), each with its own AR run on the
same prompts. Prints, per cell: AR tok/s (both runs), the fixed plan's and auto's tok/s, auto / AR (its own run's AR),
auto / fixed (each over its own AR, so the machine's drift between the runs cancels), and auto's most used plans.

    python benchmarks/auto_cells.py OUT/auto
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(folder: Path) -> dict | None:
    path = folder / "report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    ar = next(r for r in report["runs"] if r["method"] == "ar")
    spec = next(r for r in report["runs"] if r["method"] == "spec")
    plans = (spec.get("policy") or {}).get("plans") or {}
    top = ", ".join(f"{k} {v}" for k, v in sorted(plans.items(), key=lambda kv: -kv[1])[:3])
    return {"ar": ar["tokens_per_s"], "spec": spec["tokens_per_s"], "same": spec.get("identical_to_ar"), "plans": top}


def main(root: str) -> None:
    cells: dict[str, dict[str, dict]] = {}
    for folder in sorted(Path(root).iterdir()):
        if not folder.is_dir():
            continue
        cell, _, plan = folder.name.partition("--")  # b1-humaneval-t0--gamma-3 / ctx8192-b16--speculative-auto
        row = _load(folder)
        if row is not None:
            cells.setdefault(cell, {})["auto" if plan.startswith("speculative") else "fixed"] = row
    print("| cell | AR tok/s (fixed run / auto run) | fixed γ3 | auto | auto / AR | auto / fixed | auto's plans |")
    print("|---|---|---|---|---|---|---|")
    for cell, runs in cells.items():
        fixed, auto = runs.get("fixed"), runs.get("auto")
        ar = " / ".join(f"{r['ar']:.0f}" if r else "-" for r in (fixed, auto))
        fx = f"{fixed['spec']:.0f} ({fixed['spec'] / fixed['ar']:.2f}×)" if fixed else "-"
        au = f"{auto['spec']:.0f}" if auto else "-"
        vs_ar = f"{auto['spec'] / auto['ar']:.2f}×" if auto else "-"
        vs_fixed = f"{(auto['spec'] / auto['ar']) / (fixed['spec'] / fixed['ar']):.2f}×" if auto and fixed else "-"
        print(f"| {cell} | {ar} | {fx} | {au} | {vs_ar} | {vs_fixed} | {auto['plans'] if auto else '-'} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/auto_cells.py OUT/auto")
    main(sys.argv[1])
