"""The serving ramp's table (issue 40 item 2; `h200_serve.sh ramp`): per concurrency level, output tokens/s of the
AR, fixed-plan and automatic-policy servers, auto over the better of the other two, and p99 per-token ITL.

    python benchmarks/ramp_table.py OUT 1 4 16 32 64
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SIDES = ("ar", "fixed", "auto")


def _run(out: Path, side: str, level: str) -> dict | None:
    path = out / f"ramp-{side}-c{level}" / "report.json"
    if not path.is_file():
        return None
    runs = [r for r in json.loads(path.read_text()).get("runs", []) if "tokens_per_s" in r]
    return runs[0] if runs else None


def main(out: str, levels: list[str]) -> None:
    root = Path(out)
    print("| concurrency | AR tok/s | fixed tok/s | auto tok/s | auto / best other | p99 ITL ms AR / fixed / auto |")
    print("|---|---|---|---|---|---|")
    for level in levels:
        runs = {side: _run(root, side, level) for side in SIDES}
        tps = {s: (r["tokens_per_s"] if r else None) for s, r in runs.items()}
        others = [v for s, v in tps.items() if s != "auto" and v]
        ratio = f"{tps['auto'] / max(others):.2f}×" if tps["auto"] and others else "-"
        itl = " / ".join(
            f"{r['itl_ms_p99']:.1f}" if r and r.get("itl_ms_p99") is not None else "-" for r in runs.values()
        )
        cells = " | ".join(f"{v:.0f}" if v else "-" for v in tps.values())
        print(f"| {level} | {cells} | {ratio} | {itl} |")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python benchmarks/ramp_table.py OUT LEVEL [LEVEL ...]")
    main(sys.argv[1], sys.argv[2:])
