"""The automatic policy's cells side by side (issue 40 item 2): one row per cell of `h200_bench.sh auto`.

Each cell ran `bench throughput` either once with `--speculative auto --compare-fixed 3` (AR, the fixed plan and
auto interleaved in one process: one AR run) or, before that option, once per plan (`--gamma 3`, `--speculative
auto`), each with its own AR run on the same prompts. Prints, per cell: AR tok/s (one run, or both), the fixed plan's
and auto's tok/s, auto / AR, auto / fixed (each over its own AR when they ran apart, so the machine's drift between the
runs cancels), and auto's most used plans.

    python benchmarks/auto_cells.py OUT/auto
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(folder: Path) -> dict[str, dict] | None:
    """{"fixed": …, "auto": …} of one report (either or both), each {ar, spec, plans} tok/s."""
    path = folder / "report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    runs = {r["method"]: r for r in report["runs"]}
    ar = runs["ar"]
    out = {}
    for method, spec in runs.items():
        if method == "ar":
            continue
        plans = (spec.get("policy") or {}).get("plans") or {}
        top = ", ".join(f"{k} {v}" for k, v in sorted(plans.items(), key=lambda kv: -kv[1])[:3])
        row = {
            "ar": ar["tokens_per_s"],
            "spec": spec["tokens_per_s"],
            "same": spec.get("identical_to_ar"),
            "plans": top,
            "one_time_s": spec.get("capture_s"),
        }
        auto = method == "spec" and bool(spec.get("policy"))
        out["auto" if auto else "fixed"] = row
    return out


def main(root: str) -> None:
    cells: dict[str, dict[str, dict]] = {}
    for folder in sorted(Path(root).iterdir()):
        if not folder.is_dir():
            continue
        cell, _, _ = folder.name.partition("--")  # b1-humaneval-t0--gamma-3 / ctx8192-b16--speculative-auto
        rows = _load(folder)
        if rows:
            cells.setdefault(cell, {}).update(rows)
    print(
        "| cell | AR tok/s (fixed run / auto run, or shared) | fixed γ3 | auto | auto / AR | auto / fixed | auto's plans "
        "| auto's one-time s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cell, runs in cells.items():
        fixed, auto = runs.get("fixed"), runs.get("auto")
        ars = [round(r["ar"]) for r in (fixed, auto) if r]  # (the fixed run's, then auto's: one if they shared it)
        ar = " / ".join(str(a) for a in (ars[:1] if len(set(ars)) == 1 else ars)) or "-"
        fx = f"{fixed['spec']:.0f} ({fixed['spec'] / fixed['ar']:.3f}×)" if fixed else "-"
        au = f"{auto['spec']:.0f}" if auto else "-"
        vs_ar = f"{auto['spec'] / auto['ar']:.3f}×" if auto else "-"
        vs_fixed = f"{(auto['spec'] / auto['ar']) / (fixed['spec'] / fixed['ar']):.3f}×" if auto and fixed else "-"
        once = auto.get("one_time_s") if auto else None
        once = "-" if once is None else f"{once:.2f}"
        print(f"| {cell} | {ar} | {fx} | {au} | {vs_ar} | {vs_fixed} | {auto['plans'] if auto else '-'} | {once} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/auto_cells.py OUT/auto")
    main(sys.argv[1])
