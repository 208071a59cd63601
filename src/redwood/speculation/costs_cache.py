"""The calibration cache: a `CostTable` on disk under `<REDWOOD_HOME>/costs/`, one file per key.

The key names everything the forward times depend on (device, model, dtype, weight format, thread count,
backend settings, tensor-parallel size, redwood's version: `engine.calibrate.cost_key`); the file name is a
hash of it and the file repeats the key, so a file copied from another machine, written by another version,
truncated or edited is recognized and rebuilt — with a message saying why — never used.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from redwood.speculation.costs import COSTS_FORMAT, CostTable


def costs_dir() -> Path:
    from redwood.models.registry import models_home

    return models_home() / "costs"


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def costs_path(key: dict, root: Path | None = None) -> Path:
    return (costs_dir() if root is None else Path(root)) / f"{key_digest(key)}.json"


def load_costs(key: dict, root: Path | None = None) -> tuple[CostTable | None, str]:
    """The cached table for `key` → (table, "") or (None, why it must be built: missing / corrupt / stale /
    another key)."""
    path = costs_path(key, root)
    if not path.exists():
        return None, f"no calibration for this setup yet ({path})"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"the calibration file {path} is unreadable ({type(e).__name__}); rebuilding it"
    if not isinstance(doc, dict) or doc.get("format") != COSTS_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        return None, f"the calibration file {path} has format {found!r}, not {COSTS_FORMAT}; rebuilding it"
    if doc.get("key") != json.loads(json.dumps(key, sort_keys=True)):
        return None, f"the calibration file {path} was made for another setup (device, model or version); rebuilding it"
    try:
        table = CostTable.from_dict(doc["table"])
    except (KeyError, TypeError, ValueError) as e:
        return None, f"the calibration file {path} is corrupt ({e}); rebuilding it"
    why = table.implausible()
    if why is not None:
        return None, f"the calibration file {path} is implausible ({why}: measured while busy?); rebuilding it"
    return table, ""


def save_costs(key: dict, table: CostTable, root: Path | None = None) -> Path:
    """Write atomically (a temporary file renamed into place: a reader never sees half a file)."""
    path = costs_path(key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": COSTS_FORMAT, "key": key, "table": table.to_dict()}, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path
