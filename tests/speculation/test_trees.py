"""Token trees: validation, derived structure, masks, constructors, JSON, resolve_tree, shipped trees."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from redwood.errors import ConfigError, RedwoodError
from redwood.speculation.trees import FORMAT, Tree, load_shipped_tree, resolve_tree, shipped_trees
from redwood.tuning.acceptance import AcceptanceVector

# root 0 → 1, 2; 1 → 3, 4; 2 → 5; 3 → 6
HAND = (-1, 0, 0, 1, 1, 2, 3)


@pytest.mark.parametrize(
    "parents, message",
    [
        ([], "at least its root"),
        ([0, 0], r"parents\[0\] must be -1"),
        ([-1, -1], "only the root"),
        ([-1, 0, 3, 1], "must come before its children"),
        ([-1, 0, 1, 2, 2], None),  # valid chain + sibling (control)
        ([-1, 0, 1, 0], "children contiguous"),  # root's children 1 and 3 split by node 2
        ([-1, 0, 0, 2, 1], "breadth-first"),  # node 3 (child of 2) before node 4 (child of 1)
        ([-1, 0.0], "not an integer"),
        ([-1, True], "not an integer"),
        ("abc", "list of integers"),
    ],
)
def test_validation(parents, message):
    if message is None:
        Tree(tuple(parents))
        return
    with pytest.raises(ConfigError, match=message):
        Tree(parents)


def test_errors_are_redwood_errors():
    with pytest.raises(RedwoodError):
        Tree((-1, 2))


def test_hand_tree_structure():
    t = Tree(HAND)
    assert t.size == len(t) == 7
    assert t.depth == (0, 1, 1, 2, 2, 2, 3)
    assert t.max_depth == 4
    assert t.levels == (range(0, 1), range(1, 3), range(3, 6), range(6, 7))
    assert t.level_slices[2] == slice(3, 6)
    assert t.level_widths == (1, 2, 3, 1)
    assert [list(t.children(i)) for i in range(7)] == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert t.num_children == (2, 2, 1, 1, 0, 0, 0)
    assert t.child_rank == (0, 0, 1, 0, 1, 0, 0)
    assert t.leaves == (4, 5, 6)
    assert t.path(6) == (0, 1, 3, 6)
    assert t.path(0) == (0,)


def test_hand_tree_mask_and_depths():
    t = Tree(HAND)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    m = t.ancestor_mask()
    assert m.dtype == torch.bool and m.shape == (7, 7)
    assert torch.equal(m, expected)
    assert t.ancestor_mask("cpu") is m  # cached per device
    d = t.depths_tensor()
    assert d.dtype == torch.long and d.tolist() == [0, 1, 1, 2, 2, 2, 3]


def _mask_by_paths(t: Tree) -> torch.Tensor:
    m = torch.zeros(t.size, t.size, dtype=torch.bool)
    for i in range(t.size):
        for j in t.path(i):
            m[i, j] = True
    return m


@pytest.mark.parametrize(
    "tree",
    [
        Tree.chain(0),
        Tree.chain(5),
        Tree.k_chains(3, 4),
        Tree.k_chains(1, 2),
        Tree(HAND),
        Tree.from_branching([3, 2, 0, 1, 2, 1]),
    ],
)
def test_mask_matches_paths_and_invariants(tree):
    assert torch.equal(tree.ancestor_mask(), _mask_by_paths(tree))
    # siblings share a depth; the mask is lower-triangular with a true diagonal
    m = tree.ancestor_mask()
    assert torch.equal(m, m.tril()) and bool(m.diagonal().all())
    for d, r in enumerate(tree.levels):
        assert all(tree.depth[i] == d for i in r)
    assert sum(tree.level_widths) == tree.size


def test_chain():
    t = Tree.chain(3)
    assert t.parents == (-1, 0, 1, 2)
    assert t.size == 4 and t.max_depth == 4 and t.level_widths == (1, 1, 1, 1)
    assert torch.equal(t.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert Tree.chain(0).parents == (-1,) and Tree.chain(0).max_depth == 1
    with pytest.raises(ConfigError):
        Tree.chain(-1)


def test_k_chains():
    t = Tree.k_chains(3, 2)
    assert t.parents == (-1, 0, 0, 0, 1, 2, 3)
    assert t.size == 7 and t.level_widths == (1, 3, 3)
    assert t.child_rank == (0, 0, 1, 2, 0, 0, 0)
    assert [t.path(i) for i in (4, 5, 6)] == [(0, 1, 4), (0, 2, 5), (0, 3, 6)]
    t = Tree.k_chains(4, 5)
    assert t.size == 21 and t.level_widths == (1, 4, 4, 4, 4, 4)
    assert all(t.num_children[i] == 1 for i in range(1, 17))
    assert Tree.k_chains(2, 0).parents == (-1,)
    with pytest.raises(ConfigError):
        Tree.k_chains(0, 3)


def test_from_branching():
    assert Tree.from_branching([2, 2, 1, 1]) == Tree(HAND)
    assert Tree.from_branching([]) == Tree((-1,))
    assert Tree.from_branching([1, 1, 1, 0, 0]) == Tree.chain(3)
    with pytest.raises(ConfigError, match="does not exist"):
        Tree.from_branching([1, 0, 1])
    with pytest.raises(ConfigError):
        Tree.from_branching([-1])


def test_equality_ignores_meta_and_is_hashable():
    a, b = Tree(HAND, meta={"x": 1}), Tree(list(HAND))
    assert a == b and hash(a) == hash(b)
    assert a.meta == {"x": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.parents = (-1,)


def test_expected_tokens_hand():
    t = Tree(HAND)
    p = [0.5, 0.3]
    # 1 + p1 (node 1) + p2 (node 2) + p1 p1 (3) + p1 p2 (4) + p2 p1 (5) + p1 p1 p1 (6)
    want = 1 + 0.5 + 0.3 + 0.25 + 0.15 + 0.15 + 0.125
    assert t.expected_tokens(p) == pytest.approx(want)
    # ranks past W count 0; per-depth rows
    assert Tree.from_branching([3]).expected_tokens([0.5, 0.3]) == pytest.approx(1.8)
    assert Tree.chain(2).expected_tokens([[0.5], [0.2]]) == pytest.approx(1 + 0.5 + 0.1)


def test_json_round_trip(tmp_path):
    t = Tree(HAND, meta={"budget": 7, "acceptance": {"values": [0.5, 0.3]}, "note": "é"})
    d = json.loads(t.to_json())
    assert d["format"] == FORMAT and d["parents"] == list(HAND)
    back = Tree.from_json(t.to_json())
    assert back == t and back.meta == t.meta
    path = t.save(tmp_path / "sub" / "t.json")
    loaded = Tree.load(path)
    assert loaded == t and loaded.meta == t.meta
    assert json.loads(path.read_text())["parents"] == list(HAND)


def test_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="format"):
        Tree.from_dict({"format": "redwood.tree/0", "parents": [-1]})
    with pytest.raises(ConfigError, match="missing 'parents'"):
        Tree.from_dict({"format": FORMAT})
    with pytest.raises(ConfigError, match="not valid JSON"):
        Tree.from_json("{nope")
    with pytest.raises(ConfigError, match="bad.json: .*parents\\[0\\]"):
        p = tmp_path / "bad.json"
        p.write_text(json.dumps({"format": FORMAT, "parents": [1, 0]}))
        Tree.load(p)
    with pytest.raises(ConfigError, match="not found"):
        Tree.load(tmp_path / "missing.json")


def test_resolve_tree_forms(tmp_path):
    assert resolve_tree("chain:4") == Tree.chain(4)
    assert resolve_tree("CHAIN:0") == Tree.chain(0)
    assert resolve_tree("chains:3x2") == Tree.k_chains(3, 2)
    assert resolve_tree(" chains:2X5 ") == Tree.k_chains(2, 5)
    p = Tree(HAND).save(tmp_path / "mine.json")
    assert resolve_tree(str(p)) == Tree(HAND)
    t = Tree(HAND)
    assert resolve_tree(t) is t
    name = shipped_trees()[0]
    assert resolve_tree(name) == load_shipped_tree(name)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("chain:x", "chain:G"),
        ("chain:-1", "chain:G"),
        ("chains:3", "chains:KxL"),
        ("chains:0x3", "chains:KxL"),
        ("no-such-tree", "unknown tree"),
        ("missing/tree.json", "not found"),
        ("", "non-empty"),
    ],
)
def test_resolve_tree_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve_tree(spec)


def test_shipped_trees_load_and_carry_vectors():
    from redwood.tuning.tree_search import optimal_tree

    names = shipped_trees()
    assert names, "at least one shipped tree"
    for name in names:
        t = load_shipped_tree(name)
        assert t.meta.get("acceptance"), f"{name} ships without its acceptance vector"
        vec = AcceptanceVector.from_dict(t.meta["acceptance"], source=name)
        budget, depth = t.meta["budget"], t.meta["max_depth"]
        assert t.size <= budget and t.max_depth <= depth
        # the tree is what the DP gives for its recorded inputs, and its recorded expectation is right
        again, expected = optimal_tree(vec, budget, depth)
        assert again.parents == t.parents
        assert t.expected_tokens(vec) == pytest.approx(expected, abs=1e-9)
        assert t.meta["expected_tokens"] == pytest.approx(expected, abs=1e-5)
