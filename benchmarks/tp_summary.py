"""The short table of a tensor-parallel run (`benchmarks/tp_bench.sh` on GPUs, or the CPU runs of
`benchmarks/tp_step.py`): TP=1 next to TP=N for each measurement found in OUT.

Usage: python benchmarks/tp_summary.py OUT
Reads p1-tp<N>.json (`redwood bench ar --json`) and step-<shape>-b<batch>-tp<N>.json (`tp_step.py --json`), prints
one line a measurement: the TP=1 and TP=N figures and their ratio (speedup of TP=N), and for the steps the share
of the TP=N step its collectives take when run by themselves.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main(out: Path) -> None:
    lines = []
    p1 = {
        int(m.group(1)): json.loads(f.read_text())
        for f in out.glob("p1-tp*.json")
        if (m := re.search(r"tp(\d+)", f.name))
    }
    if 1 in p1 and len(p1) > 1:
        n = max(p1)
        a, b = (p1[k]["redwood"]["decode_tokens_per_s"] for k in (1, n))
        lines.append(f"{'p1 decode tok/s (batch 1)':<40}{a:>10.1f}{b:>10.1f}{b / a:>8.2f}x")
    steps: dict[tuple, dict[int, list]] = {}
    for f in sorted(out.glob("step-*-tp*.json")):
        m = re.match(r"step-(.+)-b(\d+)-tp(\d+)\.json", f.name)
        if m:
            steps.setdefault((m.group(1), int(m.group(2))), {})[int(m.group(3))] = json.loads(f.read_text())
    for (shape, batch), by_world in sorted(steps.items()):
        if 1 not in by_world or len(by_world) < 2:
            continue
        n = max(by_world)
        for one, many in zip(by_world[1], by_world[n]):
            label = f"{shape} b{batch} ctx{one['context']} {one['tokens']} tok step ms"
            a, b = one["step_ms"], many["step_ms"]
            share = many["collectives_ms"] / b if b else 0.0
            lines.append(f"{label:<40}{a:>10.2f}{b:>10.2f}{a / b:>8.2f}x  (collectives {share:.0%} of TP={n})")
    if (out / "equal.txt").exists():
        lines.append((out / "equal.txt").read_text().strip())
    n = max([max(d) for d in steps.values()] + list(p1) + [1])
    print(f"{'measurement':<40}{'TP=1':>10}{f'TP={n}':>10}{'TP=N/1':>9}")
    print("\n".join(lines) if lines else "(no results found)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
