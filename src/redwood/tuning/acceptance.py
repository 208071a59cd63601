"""Acceptance vectors: the versioned JSON record that tree search reads (schema and file I/O only).

An acceptance vector describes how often the draft's k-th ranked child of an accepted node is the one
the verifier accepts. Under Sequoia's positional-acceptance model these probabilities are
*unconditional*: p_k is the probability that rank k is accepted (not "given that ranks < k were
rejected"), so Σ_k p_k ≤ 1 and the rest is the probability that no child is accepted.

File format (``redwood.acceptance/1``)::

    {
      "format": "redwood.acceptance/1",
      "models": {"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct"},
      "method": "dynamic",            # dynamic | static | manual (hand-written or synthetic)
      "width": 8,                     # W: number of ranks measured
      "temperature": 0.6,
      "top_p": 1.0,
      "dataset": "c4-val",            # or null
      "samples": 2000,                # decoding steps (dynamic) or positions (static) counted
      "values": [p_1, ..., p_W],      # per-rank acceptance, depth-aggregated
      "p_none": 0.12,                 # probability that no child is accepted; null for static vectors
      "per_depth": [[p_11, ...], ...],# optional: row d-1 holds the ranks of children at depth d
      "notes": {...}                  # optional free-form metadata (prompt file, command line, ...)
    }

Unlike the original, the two measurement methods share one layout: ``values`` always has exactly W
entries (no leading 0, no trailing p_none), and ``p_none`` is a separate field, so no consumer has to
guess whether the last entry is p_W or p_none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from redwood.errors import ConfigError
from redwood.jsonfile import check_format, read_json, write_json
from redwood.speculation.trees import SUM_TOLERANCE, prob_row

FORMAT = "redwood.acceptance/1"
METHODS = ("dynamic", "static", "manual")


@dataclass(frozen=True)
class AcceptanceVector:
    """A measured (or hand-written) per-rank acceptance vector; see the module docstring for the fields."""

    values: tuple[float, ...]
    method: str = "manual"
    models: Mapping[str, Any] = field(default_factory=dict, compare=False)
    temperature: float | None = None
    top_p: float | None = None
    dataset: str | None = None
    samples: int | None = None
    p_none: float | None = None
    per_depth: tuple[tuple[float, ...], ...] | None = None
    notes: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "values", prob_row(self.values, "values"))
        if self.method not in METHODS:
            raise ConfigError(f"acceptance method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.p_none is not None:
            if (
                isinstance(self.p_none, bool)
                or not isinstance(self.p_none, (int, float))
                or not math.isfinite(self.p_none)
                or not 0 <= self.p_none <= 1 + SUM_TOLERANCE
            ):
                raise ConfigError(f"p_none must be a probability in [0, 1], got {self.p_none!r}")
            total = sum(self.values) + float(self.p_none)
            if total > 1 + SUM_TOLERANCE:
                raise ConfigError(f"values plus p_none sum to {total:.6f} > 1")
            object.__setattr__(self, "p_none", float(self.p_none))
        if self.per_depth is not None:
            if (
                isinstance(self.per_depth, (str, bytes))
                or not isinstance(self.per_depth, Sequence)
                or len(self.per_depth) == 0
            ):
                raise ConfigError("per_depth must be a non-empty list of rows (row d-1: children at depth d)")
            rows = tuple(prob_row(r, f"per_depth[depth {d}]") for d, r in enumerate(self.per_depth, start=1))
            for d, r in enumerate(rows, start=1):
                if len(r) != len(self.values):
                    raise ConfigError(f"per_depth[depth {d}] has {len(r)} ranks but values has {len(self.values)}")
            object.__setattr__(self, "per_depth", rows)
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ConfigError(f"{name} must be a non-negative number, got {v!r}")
        if self.samples is not None and (
            isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 0
        ):
            raise ConfigError(f"samples must be a non-negative integer, got {self.samples!r}")
        for name in ("models", "notes"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, Mapping):
                raise ConfigError(f"{name} must be an object, got {type(v).__name__}")
            object.__setattr__(self, name, dict(v or {}))
        if self.dataset is not None and not isinstance(self.dataset, str):
            raise ConfigError(f"dataset must be a string or null, got {self.dataset!r}")

    @property
    def width(self) -> int:
        return len(self.values)

    def row(self, depth: int) -> tuple[float, ...]:
        """Per-rank acceptance for children at `depth` (1 = the root's children).

        Uses `per_depth` when present (depths past its last row reuse the last row), else `values`."""
        if depth < 1:
            raise ConfigError(f"depth must be >= 1 (the root's children are at depth 1), got {depth}")
        if self.per_depth is None:
            return self.values
        return self.per_depth[min(depth, len(self.per_depth)) - 1]

    @classmethod
    def from_values(cls, values: Sequence[float], **kw) -> "AcceptanceVector":
        """A vector from inline values (method 'manual' unless given)."""
        return cls(values=tuple(values), **kw)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "models": dict(self.models),
            "method": self.method,
            "width": self.width,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "dataset": self.dataset,
            "samples": self.samples,
            "values": list(self.values),
            "p_none": self.p_none,
            **({"per_depth": [list(r) for r in self.per_depth]} if self.per_depth is not None else {}),
            **({"notes": dict(self.notes)} if self.notes else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "acceptance record") -> "AcceptanceVector":
        check_format(d, FORMAT, source)
        if "values" not in d:
            raise ConfigError(f"{source}: missing 'values' (the per-rank acceptance p_1..p_W)")
        known = {
            "format",
            "models",
            "method",
            "width",
            "temperature",
            "top_p",
            "dataset",
            "samples",
            "values",
            "p_none",
            "per_depth",
            "notes",
        }
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}")
        try:
            vec = cls(
                values=d["values"],
                method=d.get("method", "manual"),
                models=d.get("models") or {},
                temperature=d.get("temperature"),
                top_p=d.get("top_p"),
                dataset=d.get("dataset"),
                samples=d.get("samples"),
                p_none=d.get("p_none"),
                per_depth=d.get("per_depth"),
                notes=d.get("notes") or {},
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        if "width" in d and d["width"] != vec.width:
            raise ConfigError(f"{source}: width is {d['width']!r} but values has {vec.width} entries")
        return vec


def acceptance_from_legacy(entries: Sequence[float], layout: str, **kw) -> AcceptanceVector:
    """Convert one of the original's flat vectors (leading 0, then p_1..p_W, then p_none for 'dynamic')
    into a record. The layout must be named explicitly: guessing it is the original's bug."""
    entries = [float(x) for x in entries]
    if layout == "dynamic":  # [0, p_1..p_W, p_none]: W + 2 entries
        if len(entries) < 3:
            raise ConfigError("a dynamic legacy vector has W+2 entries: [0, p_1..p_W, p_none]")
        return AcceptanceVector(values=tuple(entries[1:-1]), p_none=entries[-1], method="dynamic", **kw)
    if layout == "static":  # [0, p_1..p_W]: W + 1 entries
        if len(entries) < 2:
            raise ConfigError("a static legacy vector has W+1 entries: [0, p_1..p_W]")
        return AcceptanceVector(values=tuple(entries[1:]), method="static", **kw)
    raise ConfigError(f"legacy layout must be 'dynamic' (W+2 entries) or 'static' (W+1), got {layout!r}")


def load_acceptance(path: str | Path) -> AcceptanceVector:
    """Read and validate a ``redwood.acceptance/1`` JSON file."""
    return AcceptanceVector.from_dict(read_json(path, "acceptance"), source=str(path))


def save_acceptance(vec: AcceptanceVector, path: str | Path) -> Path:
    """Write `vec` as pretty-printed JSON (parent folders are created)."""
    return write_json(path, vec.to_dict())
