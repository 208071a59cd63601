"""Suffix drafting: a token tree of the continuations a request's own tokens (and, opt-in, recent requests')
make likely — draftless, like prompt lookup (`speculation.draftless`), but proposing a tree, not one chain.

Before a step, each generating row's history (prompt + output, ending with the root `last`) extends its
`SuffixIndex` (`speculation.suffix_index`: continuation counts of every n-gram of min_n … max_n tokens).
The engine's tree (fixed per engine: CUDA graphs are keyed by it) is then filled breadth-first: a node's
children, in rank order, are the most frequent next tokens after the node's context — the history plus
the path from the root to the node — for that context's longest suffix seen before, ties to the most
recent (then shorter suffixes' continuations fill the siblings left; `ranked_children`). A path through
the tree is thus a continuation the text has made at least once, and periodic text continues its period.
With `shared`, a `SharedIndex` over recent requests' tokens (added as each leaves its slot, bounded to its
capacity, oldest out) fills the children a row's own index leaves empty.

Padding. A node the index cannot fill (fewer continuations than the node has children) gets its parent's
token (a repetition, the guess prompt lookup makes without a match). That is harmless for every verifier
this drafter allows: greedy accepts a child only if it is the target's argmax, topk and match only if it is
the token y ~ p drawn at its parent — a padded child is accepted exactly when the target would emit its token
anyway, and the token emitted is y (or the argmax) whatever the children are. A padded token equal to a
sibling is never reached (the walk takes the first equal child) and its subtree is dead compute only.

Verifiers. Children are a function of the context, not draws: no draft distribution q exists that a
node's several children were drawn from, so Sequoia's and SpecInfer's walks (which need that q) do not
apply; greedy (temperature 0), topk and match (any temperature: lossless for any children fixed before
their draws; match keys its draws by position, so a seeded request's tokens are its AR tokens) do, and "auto"
picks them (`engine.decode.resolve_verifier`, `deterministic_children`). On a chain the one-hot q makes
rejection sampling exact too, as for prompt lookup. Under the automatic policy (`speculation.policy`) the
drafter proposes chains of its best path (`shadow_propose` scores them).

A step in which no row's root matched anything runs plainly (no verification over guesses).
"""

from __future__ import annotations

from redwood.speculation.draftless import DEFAULT_MAX_N, DEFAULT_MIN_N, DraftlessDrafter
from redwood.speculation.suffix_index import DEFAULT_SHARED_CAPACITY, SharedIndex, SuffixIndex, ranked_children
from redwood.speculation.trees import Tree

# The tree `--draft suffix` drafts without --tree: 8 nodes, 7 levels — the best continuation as a chain of 6
# drafts and the runner-up continuation at the root (where an n-gram most often forks: a renamed identifier, the
# line after a repeated one). Lean because depth is what copy-heavy text rewards and siblings rarely are: a
# 12-node tree with 3 root candidates and 2 below the first emitted no more tokens per step than its 6-deep spine
# alone, a shallow [3, 2, 1, 1, 1] fewer than a 4-token chain; and on the 2-core CPU every verified node costs
# about half an AR step (benchmarks/results/2026-12-05-cpu-suffix/).
DEFAULT_BRANCHING = (2, 1, 0, 1, 1, 1, 1)  # children per node, breadth-first
DEFAULT_TREE = Tree.from_branching(DEFAULT_BRANCHING)


def fill_tree(tree: Tree, history: list[int], children, keep: int) -> tuple[list[int], list[bool]]:
    """Node tokens for `tree` after `history` (node 0 = history[-1]) → (tokens [n], found [n]: whether
    each node's token came from the index rather than padding; the root's is True). children(tail, k) → up
    to k ranked next tokens after a context ending in `tail`, its last `keep` (max_n) tokens; a node's tail
    is its parent's plus its own token, so no lookup copies the history."""
    n = tree.size
    tokens, found = [0] * n, [False] * n
    tokens[0], found[0] = history[-1], True
    tails: list[tuple[int, ...]] = [()] * n
    tails[0] = tuple(history[-keep:])
    for v in range(n):  # breadth-first: a node's tail is known before its children's lookups
        kids = tree.children(v)
        if not kids:
            continue
        ranked = children(tails[v], len(kids))
        for j, c in enumerate(kids):
            found[c] = j < len(ranked)
            tokens[c] = ranked[j] if found[c] else tokens[v]  # (padding: see the module docstring)
            tails[c] = (tails[v] + (tokens[c],))[-keep:]
    return tokens, found


class SuffixDrafter(DraftlessDrafter):
    """A tree of continuations from each row's own n-gram counts (and, with `shared`, recent requests')."""

    family = "suffix"

    def __init__(
        self,
        vocab_size: int,
        min_n: int = DEFAULT_MIN_N,
        max_n: int = DEFAULT_MAX_N,
        shared: bool = False,
        shared_capacity: int = DEFAULT_SHARED_CAPACITY,
    ):
        super().__init__(vocab_size, min_n, max_n)
        self.shared = SharedIndex(min_n, max_n, shared_capacity) if shared else None
        self.filled = 0  # draft nodes filled from an index, and padded (stats for reports)
        self.padded = 0

    def describe(self) -> str:
        return f"suffix {self.min_n}-{self.max_n}{' shared' if self.shared is not None else ''}"

    def _new_index(self) -> SuffixIndex:
        return SuffixIndex(self.min_n, self.max_n)

    def _retire(self, index: SuffixIndex) -> None:
        if self.shared is not None:
            self.shared.add(index.tokens)

    def _fill(self, index: SuffixIndex, tree: Tree) -> tuple[list[int], list[bool]]:
        sources = (index,) if self.shared is None else (index, self.shared)  # (the row's own counts first)

        def children(tail: tuple[int, ...], k: int) -> list[int]:
            return ranked_children(sources, tail, k, self.min_n, self.max_n)

        return fill_tree(tree, index.tokens, children, self.max_n)

    def shadow_propose(self, slot: int, history: list[int], k: int) -> list[int]:
        """The best path of up to k tokens after `history` (what a chain of k would propose, padding cut), for
        the automatic policy's scoring."""
        tokens, found = self._fill(self._index(slot, history), Tree.chain(k))
        return tokens[1 : found.index(False) if False in found else k + 1]

    def _draft_row(self, index: SuffixIndex, tree: Tree) -> tuple[list[int], bool]:
        tokens, found = self._fill(index, tree)
        filled = sum(found[1:])
        self.filled += filled
        self.padded += tree.size - 1 - filled
        return tokens[1:], any(found[c] for c in tree.children(0))  # (the root matched: worth a verify)
