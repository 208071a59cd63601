"""Keep the tuned table's tile_rows only where the tile kernel measured faster: reads decode_step.py's
printed table for a batched one-token step (`--quick --batch B`), compares the graphed step with the
skinny path ("... skinny", taking the tile kernel) against the same step without it (cuBLAS + the small
fused kernels), and removes tile_rows from the table when the skinny step is not faster.

Usage: python benchmarks/tile_rows_decide.py DECODE_STEP_OUTPUT TABLE_JSON
Prints one line: both times and the decision.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks.gemv_bench import table_json

ROW = re.compile(r"^fused=yes attn=auto graphs=yes( skinny)?\s+1\s+([0-9.]+)\s")


def step_times(text: str) -> dict[bool, float]:
    """{skinny?: ms per step} from decode_step's final table (its last match of each variant, T = 1)."""
    times = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            times[m.group(1) is not None] = float(m.group(2))
    if set(times) != {False, True}:
        raise SystemExit("tile_rows_decide: the decode_step output lacks the graphed fused and skinny T=1 rows")
    return times


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    times = step_times(Path(sys.argv[1]).read_text())
    path = Path(sys.argv[2])
    table = json.loads(path.read_text())
    keep = times[True] < times[False]
    if not keep and "tile_rows" in table:
        del table["tile_rows"]
        path.write_text(
            table_json(table["device"], table["configs"], table.get("max_rows", 1), made_by=table["made_by"])
        )
    print(
        f"batched step: tile kernel {times[True]:.3f} ms, cuBLAS + small kernels {times[False]:.3f} ms → "
        f"{'keep' if keep else 'drop'} tile_rows {table.get('tile_rows')}"
    )


if __name__ == "__main__":
    main()
