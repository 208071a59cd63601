"""Token trees for tree speculation (Sequoia).

A tree of n nodes is stored canonically as `parents` (parents[0] = -1); everything else is derived.

- Node 0 is the **root**: the newest sampled token that is not yet in the target cache. The
  verification forward processes all n nodes (root included); the draft tokens are nodes 1..n-1.
- Nodes are numbered breadth-first and each node's children are contiguous and ordered by rank (the
  order the draft proposed them: rank 0 is the draft's first choice). Equivalently: parents[i] < i and
  `parents` is non-decreasing. Hence the nodes of one depth form a contiguous range (a "level").
- With L committed tokens in the target cache, node i goes to KV slot L + i and has position id
  L + depth[i] (siblings share a position); it attends to the committed prefix plus its own
  ancestors and itself (`ancestor_mask`).

File format (``redwood.tree/1``)::

    {"format": "redwood.tree/1", "parents": [-1, 0, 0, 1, ...],
     "meta": {"acceptance": {...redwood.acceptance/1 record...}, "budget": 64, "max_depth": 8,
              "models": {...}, "temperature": 0.6, "expected_tokens": 3.1, ...}}

`resolve_tree` turns a command-line spec into a tree: ``chain:G``, ``chains:KxL``, a path to a
``.json`` file, or the name of a tree shipped in ``redwood/trees/``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from redwood.errors import ConfigError
from redwood.jsonfile import check_format, parse_json, read_json

FORMAT = "redwood.tree/1"


@dataclass(frozen=True)
class Tree:
    """An immutable token tree; see the module docstring for the numbering conventions.

    `meta` (free-form provenance: the acceptance vector, budget, models, ...) is carried along but takes
    no part in equality or hashing. Cached tensors returned by `ancestor_mask` / `depths_tensor` are
    shared between callers: treat them as read-only.
    """

    parents: tuple[int, ...]
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        ps = self.parents
        if isinstance(ps, (str, bytes)) or not isinstance(ps, Iterable):
            raise ConfigError(f"tree parents must be a list of integers, got {type(ps).__name__}")
        ps = tuple(ps)
        for i, p in enumerate(ps):
            if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
                raise ConfigError(f"tree parents[{i}] is not an integer: {p!r}")
        ps = tuple(int(p) for p in ps)
        if len(ps) == 0:
            raise ConfigError("a tree needs at least its root: parents = [-1]")
        if ps[0] != -1:
            raise ConfigError(f"parents[0] must be -1 (node 0 is the root), got {ps[0]}")
        for i in range(1, len(ps)):
            p = ps[i]
            if p < 0:
                raise ConfigError(f"node {i} has parent {p}: only the root (node 0) has no parent")
            if p >= i:
                raise ConfigError(
                    f"node {i} has parent {p}: a parent must come before its children "
                    f"(parents[i] < i, breadth-first numbering)"
                )
            if p < ps[i - 1]:
                raise ConfigError(
                    f"node {i} has parent {p} but node {i - 1} has parent {ps[i - 1]}: nodes must be numbered "
                    f"breadth-first with each node's children contiguous (parents non-decreasing)"
                )
        if not isinstance(self.meta, Mapping):
            raise ConfigError(f"tree meta must be an object, got {type(self.meta).__name__}")
        object.__setattr__(self, "parents", ps)
        object.__setattr__(self, "meta", dict(self.meta))

    # ------------------------------------------------------------------ derived structure
    @property
    def size(self) -> int:
        return len(self.parents)

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """depth[i]: edges from the root to node i (root 0)."""
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @cached_property
    def max_depth(self) -> int:
        """Number of levels, counting the root (a lone root has 1; chain(γ) has γ + 1)."""
        return self.depth[-1] + 1

    @cached_property
    def levels(self) -> tuple[range, ...]:
        """levels[d]: the contiguous range of node ids at depth d."""
        starts = [0]
        for i in range(1, self.size):
            if self.depth[i] != self.depth[i - 1]:
                starts.append(i)
        starts.append(self.size)
        return tuple(range(a, b) for a, b in zip(starts[:-1], starts[1:]))

    def first_levels(self, depth: int) -> "Tree":
        """The tree cut to its first depth + 1 levels (nodes are numbered breadth-first: a prefix)."""
        return self if depth >= self.max_depth - 1 else Tree(self.parents[: self.levels[depth].stop])

    @cached_property
    def level_slices(self) -> tuple[slice, ...]:
        return tuple(slice(r.start, r.stop) for r in self.levels)

    @cached_property
    def level_widths(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.levels)

    @cached_property
    def _child_ranges(self) -> tuple[range, ...]:
        first = [0] * self.size
        count = [0] * self.size
        for i in range(1, self.size):
            p = self.parents[i]
            if count[p] == 0:
                first[p] = i
            count[p] += 1
        return tuple(range(first[i], first[i] + count[i]) if count[i] else range(0) for i in range(self.size))

    def children(self, i: int) -> range:
        """The (contiguous) ids of node i's children, in rank order."""
        return self._child_ranges[i]

    @cached_property
    def num_children(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self._child_ranges)

    @cached_property
    def child_rank(self) -> tuple[int, ...]:
        """child_rank[i]: 0-based order of node i among its siblings (root: 0)."""
        r = [0] * self.size
        for i in range(2, self.size):
            if self.parents[i] == self.parents[i - 1]:
                r[i] = r[i - 1] + 1
        return tuple(r)

    @cached_property
    def is_chain(self) -> bool:
        """True when every node has at most one child (a chain of size − 1 drafts)."""
        return all(c <= 1 for c in self.num_children)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.num_children) if c == 0)

    def path(self, i: int) -> tuple[int, ...]:
        """Node ids from the root down to node i (inclusive)."""
        out = [i]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return tuple(reversed(out))

    @cached_property
    def _mask_np(self) -> np.ndarray:
        n = self.size
        m = np.zeros((n, n), dtype=bool)
        m[0, 0] = True
        for i in range(1, n):
            m[i] = m[self.parents[i]]
            m[i, i] = True
        m.setflags(write=False)
        return m

    @cached_property
    def _tensor_cache(self) -> dict:
        return {}

    def _cached_tensor(self, key: str, device, build):
        import torch

        dev = torch.device(device if device is not None else "cpu")
        k = (key, str(dev))
        t = self._tensor_cache.get(k)
        if t is None:
            t = build().to(dev)
            self._tensor_cache[k] = t
        return t

    def ancestor_mask(self, device=None):
        """Bool tensor [n, n]: row i is True at i and at each of i's ancestors (shared; read-only)."""
        import torch

        return self._cached_tensor("mask", device, lambda: torch.from_numpy(self._mask_np.copy()))

    def depths_tensor(self, device=None):
        """Int64 tensor [n] of node depths (position offsets from the root; shared; read-only)."""
        import torch

        return self._cached_tensor("depth", device, lambda: torch.tensor(self.depth, dtype=torch.long))

    def expected_tokens(self, acceptance) -> float:
        """Expected tokens per step under the positional-acceptance model: Σ_v Π_{edges to v} p.

        `acceptance`: p_1..p_W (children of rank k get p_k), a per-depth table (row d-1 for children at
        depth d; deeper depths reuse the last row), or an `AcceptanceVector`. Ranks past W get 0."""
        rows = acceptance_rows(acceptance, self.max_depth)
        f = [1.0] * self.size
        for i in range(1, self.size):
            row = rows[self.depth[i] - 1]
            k = self.child_rank[i]
            f[i] = f[self.parents[i]] * (float(row[k]) if k < len(row) else 0.0)
        return float(sum(f))

    def __repr__(self) -> str:
        return f"Tree(size={self.size}, max_depth={self.max_depth}, widths={list(self.level_widths)})"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def chain(cls, gamma: int) -> "Tree":
        """A chain of γ draft tokens (γ + 1 nodes with the root)."""
        _check_int(gamma, "chain length", minimum=0)
        return cls(tuple([-1] + list(range(gamma))), meta={"source": f"chain:{gamma}"})

    @classmethod
    def k_chains(cls, k: int, length: int) -> "Tree":
        """The root with k independent chains of `length` draft tokens each (1 + k·length nodes)."""
        _check_int(k, "number of chains", minimum=1)
        _check_int(length, "chain length", minimum=0)
        parents = [-1]
        for level in range(length):
            for j in range(k):
                parents.append(0 if level == 0 else 1 + (level - 1) * k + j)
        return cls(tuple(parents), meta={"source": f"chains:{k}x{length}"})

    @classmethod
    def from_branching(cls, child_counts: Sequence[int]) -> "Tree":
        """Build a tree from the number of children of each node, in breadth-first order.

        Nodes past the end of `child_counts` have no children."""
        parents = [-1]
        for i, c in enumerate(child_counts):
            _check_int(c, f"child count of node {i}", minimum=0)
            if i >= len(parents):
                if c:
                    raise ConfigError(
                        f"child_counts[{i}] = {c}, but the tree has only {len(parents)} nodes "
                        f"at that point (node {i} does not exist)"
                    )
                continue
            parents.extend([i] * c)
        return cls(tuple(parents))

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "parents": list(self.parents), "meta": dict(self.meta)}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "tree") -> "Tree":
        check_format(d, FORMAT, source)
        if "parents" not in d:
            raise ConfigError(f"{source}: missing 'parents'")
        meta = d.get("meta", {}) or {}
        try:
            return cls(d["parents"], meta=meta)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, text: str, source: str = "tree") -> "Tree":
        return cls.from_dict(parse_json(text, source), source=source)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # parents on one line (long trees stay readable), meta pretty-printed
        meta = json.dumps(dict(self.meta), indent=2).replace("\n", "\n  ")
        path.write_text(
            '{\n  "format": "%s",\n  "parents": %s,\n  "meta": %s\n}\n' % (FORMAT, json.dumps(list(self.parents)), meta)
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Tree":
        return cls.from_dict(read_json(path, "tree"), source=str(path))


# ---------------------------------------------------------------------- the positional-acceptance model
# The value of a tree (`Tree.expected_tokens`, and the tree search in `redwood.tuning.tree_search`): the
# k-th ranked child of an accepted node is the accepted one with probability p_k (unconditional, Σ p_k ≤ 1),
# optionally depending on the child's depth.

# Tolerance for sums of probabilities written with rounding (Σ p_k ≤ 1 + SUM_TOLERANCE).
SUM_TOLERANCE = 1e-4


def prob_row(values: Any, what: str) -> tuple[float, ...]:
    """A validated row of per-rank acceptance probabilities p_1..p_W (`what` names it in errors)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"{what} must be a list of numbers, got {type(values).__name__}")
    if len(values) == 0:
        raise ConfigError(f"{what} is empty: give at least p_1")
    row = []
    for k, v in enumerate(values, start=1):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{what}[rank {k}] is not a number: {v!r}")
        v = float(v)
        if not math.isfinite(v):
            raise ConfigError(f"{what}[rank {k}] is not finite: {v}")
        if v < 0:
            raise ConfigError(f"{what}[rank {k}] is negative: {v}")
        if v > 1 + SUM_TOLERANCE:
            raise ConfigError(f"{what}[rank {k}] is above 1: {v}")
        row.append(v)
    total = sum(row)
    if total > 1 + SUM_TOLERANCE:
        raise ConfigError(
            f"{what} sums to {total:.6f} > 1: the per-rank acceptance probabilities are unconditional "
            f"(rank k accepted, not 'given earlier ranks were rejected'), so they must sum to at most 1"
        )
    return tuple(row)


def acceptance_rows(acceptance, depth: int | None = None, use_per_depth: bool = True) -> list[np.ndarray]:
    """Normalise an acceptance input into per-depth rows (row d-1: children at depth d).

    Accepts an `AcceptanceVector` (`redwood.tuning.acceptance`; any record with `values` and
    `per_depth`: its `per_depth` table when present and `use_per_depth`), a flat sequence p_1..p_W (one
    row for every depth), or a 2-D sequence (one row per depth). All rows are padded with zeros to a
    common width. When `depth` is given, the list is extended to at least `depth` rows by repeating the
    last row."""
    if hasattr(acceptance, "values") and hasattr(acceptance, "per_depth"):  # an AcceptanceVector
        raw = [acceptance.values] if (acceptance.per_depth is None or not use_per_depth) else list(acceptance.per_depth)
    else:
        arr = acceptance
        if isinstance(arr, np.ndarray):
            arr = arr.tolist()
        if isinstance(arr, (str, bytes)) or not isinstance(arr, Sequence) or len(arr) == 0:
            raise ConfigError("acceptance must be an AcceptanceVector, a list p_1..p_W or a per-depth table")
        if all(isinstance(r, Sequence) and not isinstance(r, (str, bytes)) for r in arr):
            raw = [tuple(r) for r in arr]
        else:
            raw = [tuple(arr)]
    rows = [
        prob_row(r, "acceptance" if len(raw) == 1 else f"acceptance[depth {d}]") for d, r in enumerate(raw, start=1)
    ]
    width = max(len(r) for r in rows)
    out = [np.array(list(r) + [0.0] * (width - len(r)), dtype=np.float64) for r in rows]
    if depth is not None:
        while len(out) < depth:
            out.append(out[-1])
    return out


def _check_int(v, what: str, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {v!r}")


# ---------------------------------------------------------------------- shipped trees and specs
def _shipped_dir():
    from importlib.resources import files

    return files("redwood") / "trees"


def shipped_trees() -> list[str]:
    """Names of the trees shipped with redwood (``redwood/trees/NAME.json``)."""
    d = _shipped_dir()
    try:
        return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def load_shipped_tree(name: str) -> Tree:
    res = _shipped_dir() / f"{name}.json"
    if not res.is_file():
        names = ", ".join(shipped_trees()) or "none"
        raise ConfigError(f"no shipped tree named {name!r} (shipped: {names})")
    return Tree.from_json(res.read_text(), source=f"shipped tree {name}")


def resolve_tree(spec: "str | Tree") -> Tree:
    """A tree from a spec: ``chain:G``, ``chains:KxL``, a path to a ``.json`` file, or a shipped name."""
    if isinstance(spec, Tree):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"tree spec must be a non-empty string, got {spec!r}")
    s = spec.strip()
    low = s.lower()
    if low.startswith("chain:"):
        g = s[6:]
        if not g.isdigit():
            raise ConfigError(f"bad tree spec {spec!r}: expected chain:G with G a non-negative integer")
        return Tree.chain(int(g))
    if low.startswith("chains:"):
        body = low[7:]
        parts = body.split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1:
            raise ConfigError(f"bad tree spec {spec!r}: expected chains:KxL (K chains of L draft tokens, K >= 1)")
        return Tree.k_chains(int(parts[0]), int(parts[1]))
    path = Path(s).expanduser()
    if path.suffix == ".json" or path.exists() or "/" in s or "\\" in s:
        if not path.exists():
            raise ConfigError(f"tree file not found: {path}")
        return Tree.load(path)
    if s in shipped_trees():
        return load_shipped_tree(s)
    names = ", ".join(shipped_trees()) or "none"
    raise ConfigError(
        f"unknown tree {spec!r}: use chain:G, chains:KxL, a path to a .json tree file, or a shipped tree ({names})"
    )
