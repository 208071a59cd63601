"""Drafters: propose a token tree per row (a chain is a tree with one child per node).

The tree's node 0 (the root) is `last`, the newest token, not yet in any cache. Drafting goes level by
level: one draft forward over the level's nodes that have children (attending to the committed context,
to the nodes fed earlier in this step through the tree's ancestor mask, and to themselves) gives their
draft distributions, from which their children are drawn by the verifier's rule (without replacement
for Sequoia, with replacement for SpecInfer, the draft's top-k for greedy / top-k verification, and for
`match` "coupled": the first child by inverse CDF with the uniform the target will draw its own token at
that position with — the row seed's number at the children's absolute position — the others top-k).

- `SelfDrafter`: the target drafts for itself, reading its own cache through a compressed view
  (StreamingLLM / SnapKV). Its draft nodes' KV goes to the target cache's scratch slots, which the
  verification forward then overwrites with the target's exact KV — no second cache, no catch-up.
- `ModelDrafter`: a small standalone model with its own cache, read through the same policies. Each step
  it rewinds its cache to the target's committed length − 1 and re-feeds the newest committed token with
  the root: that covers the one accepted token it may never have fed (a leaf of the accepted path) with
  a batch shape that is the same for every row. After verification the accepted path's nodes are moved
  into place in its cache (`commit`). Under tensor parallelism with the draft model on a strict subset of the
  ranks, a rank outside it holds a `ModelDrafter` over a `RemoteDraft`: it runs no draft forward and takes rank
  0's proposal (`ModelDrafter.replicas`).

Draft distributions are the same processed distributions (temperature / top-k / top-p) the verifier
compares against; for greedy verification children are the draft's top tokens by raw probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from redwood.errors import ConfigError
from redwood.kv.policies import DraftKVPolicy, FullPolicy
from redwood.models.transformer import Transformer
from redwood.sample.sampler import Sampler
from redwood.sample.tree_verify import draw_children
from redwood.speculation.trees import Tree


@dataclass(frozen=True)
class DraftPlan:
    """Which nodes each draft forward feeds, and the masks among them (derived from a tree)."""

    steps: tuple[tuple[int, ...], ...]  # per forward: the nodes fed (those with children), by level
    fed_pos: tuple[int, ...]  # per node: its order among all fed nodes (−1: never fed, a leaf)
    masks: tuple[torch.Tensor, ...]  # per forward after the first: [T, P + T] over fed-so-far + new nodes
    max_children: tuple[int, ...]  # per forward: the most children of a fed node


@lru_cache(maxsize=64)
def draft_plan(tree: Tree) -> DraftPlan:
    counts = tree.num_children
    steps = tuple(tuple(v for v in level if counts[v] > 0) for level in tree.levels)
    steps = tuple(s for s in steps if s)
    fed = [v for s in steps for v in s]
    fed_pos = [-1] * tree.size
    for i, v in enumerate(fed):
        fed_pos[v] = i
    anc = tree.ancestor_mask("cpu")
    masks, done = [], 1  # the first forward feeds the root alone (causal mask)
    for s in steps[1:]:
        cols = fed[: done + len(s)]
        masks.append(anc[list(s)][:, cols].clone())
        done += len(s)
    return DraftPlan(steps, tuple(fed_pos), tuple(masks), tuple(max(counts[v] for v in s) for s in steps))


@dataclass(frozen=True)
class LevelPlan:
    """One draft forward, as device tensors (built before any CUDA-graph capture, which cannot copy
    host data): the T nodes it feeds, their position offsets, its mask, and where the children go."""

    nodes: torch.Tensor  # [T] node indices fed
    offsets: torch.Tensor  # [m + 1] (first forward: lead tokens and root) or [T] node depths
    mask: torch.Tensor | None  # [T, m + P + T] over lead + pending + new tokens (None: causal)
    k: int  # children drawn per fed node (the most any of them has)
    src: torch.Tensor  # [C] flat indices into the drawn children [T · k]
    dst: torch.Tensor  # [C] the tree nodes they become


@dataclass(frozen=True)
class DevicePlan:
    """`draft_plan(tree)` as device tensors, with m lead tokens re-fed before the root."""

    levels: tuple[LevelPlan, ...]  # one per draft forward
    fed_pos: torch.Tensor  # [n] each node's order among the fed nodes (−1: never fed, a leaf)
    chain: bool  # one node per forward: an accepted path is already in place in the draft cache


def device_plan(tree: Tree, m: int, device: torch.device) -> DevicePlan:
    plan = draft_plan(tree)
    depth = tree.depths_tensor("cpu")
    levels = []
    for step, nodes in enumerate(plan.steps):
        k = plan.max_children[step]
        src, dst = [], []
        for t, v in enumerate(nodes):
            for j, c in enumerate(tree.children(v)):
                src.append(t * k + j)
                dst.append(c)
        if step == 0:
            offsets, mask = torch.arange(m + 1), None
        else:
            offsets = depth[list(nodes)]
            mask = plan.masks[step - 1]
            if m:  # lead tokens are committed context: every node sees them
                mask = torch.cat([torch.ones(len(nodes), m, dtype=torch.bool), mask], dim=1)
        levels.append(
            LevelPlan(
                torch.tensor(nodes, device=device),
                offsets.to(device),
                None if mask is None else mask.to(device),
                k,
                torch.tensor(src, device=device),
                torch.tensor(dst, device=device),
            )
        )
    return DevicePlan(
        tuple(levels), torch.tensor(plan.fed_pos, device=device), all(len(nodes) == 1 for nodes in plan.steps)
    )


class Drafter:
    policy: DraftKVPolicy

    def __init__(self, policy: DraftKVPolicy):
        self.policy = policy
        # (tree, lead tokens, device) → DevicePlan, kept for the drafter's lifetime: a captured step
        # reads these tensors on every replay.
        self._device_plans: dict[tuple, DevicePlan] = {}

    # A runner (`redwood.engine.runner.StepRunner`: .forward(ids, positions, ...) and .cache) runs a model
    # over a batch of rows of its cache; the Engine passes the target's and, for a drafter with its own
    # model, the draft's for the rows a step runs.
    own_model: Transformer | None = None  # a standalone draft model (its own cache) on this rank, else None
    # a standalone draft model at all — on this rank (`own_model`) or, under tensor parallelism with the draft on a
    # subset of the ranks, on others (`elsewhere`): a step's shape and the automatic policy's catch-ups are its
    standalone = False
    needs_history = False  # draftless drafters read each row's tokens on the host (`prepare`)
    # Children fixed by the context, not drawn from a draft distribution (draftless drafters): a tree of
    # them is verified only by the verifiers that need no q (greedy, topk, match; `engine.decode.resolve_verifier`).
    deterministic_children = False

    @property
    def elsewhere(self) -> bool:
        """The draft model runs on other tensor-parallel ranks, not this one: no draft cache, forward or KV-policy
        state here (its proposals arrive from rank 0)."""
        return self.standalone and self.own_model is None

    def reset_row(self, slot: int) -> None:
        """A request leaves the slot (or a new one takes it): drop host state kept for the row."""

    def prepare(self, rows: list[tuple[int, list[int]]], tree: Tree, n: int, device: torch.device) -> bool:
        """Before a step that drafts `tree` over the first n slots: host work on the generating rows' histories
        (slot, prompt + output ids; only for `needs_history` drafters) → False when no row has anything to
        propose (the step then decodes plainly)."""
        return True

    def propose(
        self,
        target,
        draft,
        prev: torch.Tensor,
        last: torch.Tensor,
        tree: Tree,
        sampler: Sampler,
        rule: str,
        need_q: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft a tree after `last` [B] (`prev` [B]: the newest committed token); `target` runs the
        target over its cache, `draft` the draft model over its own (None for self-speculation).

        Returns node tokens [B, n] (column 0 = last) and, when `need_q`, the draft distribution at every
        node [B, n, V_target] (zeros at leaves).
        """
        raise NotImplementedError

    def commit(self, draft, path_src: torch.Tensor, count: torch.Tensor) -> None:
        """The target accepted these paths (node indices [B, A] incl. the root, `count` [B] of them);
        `draft`: the draft runner the step drafted with (None for self-speculation)."""

    def graph_key(self) -> tuple:
        """What a captured step that drafts with this drafter depends on besides the tree and batch."""
        return (id(self), id(self.policy), self.policy.version)

    # ------------------------------------------------------------------ shared tree drafting
    def _plan_for(self, tree: Tree, m: int, device: torch.device) -> DevicePlan:
        key = (tree, m, str(device))
        if key not in self._device_plans:
            self._device_plans[key] = device_plan(tree, m, device)
        return self._device_plans[key]

    def _draft(
        self,
        runner,
        lead: torch.Tensor | None,
        last: torch.Tensor,
        tree: Tree,
        sampler: Sampler,
        rule: str,
        need_q: bool,
        vocab: int,
    ):
        """Level-by-level drafting into the runner's cache after its committed length, reading the
        context through `self.policy`. No host synchronization (graph-capturable).

        lead: [B, m] committed tokens re-fed before the root (their slots come first), or None.
        """
        cache = runner.cache
        policy = None if isinstance(self.policy, FullPolicy) else self.policy
        B, device = last.shape[0], last.device
        m = 0 if lead is None else lead.shape[1]
        levels = self._plan_for(tree, m, device).levels
        tokens = torch.zeros(B, tree.size, dtype=torch.long, device=device)
        tokens[:, 0] = last
        q_all = torch.zeros(B, tree.size, vocab, device=device) if need_q else None
        root_pos = cache.lengths + m  # [B]
        rows_of = torch.arange(B, device=device)
        fed = 0
        for step, lv in enumerate(levels):
            if step == 0:  # the lead tokens and the root, causal
                ids = last[:, None] if lead is None else torch.cat([lead, last[:, None]], dim=1)
                positions = cache.lengths[:, None] + lv.offsets
                logits = runner.forward(ids, positions, policy=policy)[:, m:]
                positions = positions[:, m:]  # [B, 1]: the root's
            else:
                positions = root_pos[:, None] + lv.offsets
                logits = runner.forward(
                    tokens[:, lv.nodes],
                    positions,
                    pending=m + fed,
                    new_mask=lv.mask,
                    mask_key=("draft", tree, step, m),
                    policy=policy,
                )
            T = logits.shape[1]
            fed += T
            logits = logits[..., :vocab].reshape(B * T, -1)  # [B·T, V] — the shared vocabulary only
            rows = rows_of.repeat_interleave(T)
            if rule == "topk":  # the draft's own most likely tokens (raw logits: same order, no softmax)
                kids = draw_children(logits, lv.k, rule, sampler.random, rows)
            if need_q or rule != "topk":
                q = sampler.probs(logits, rows)  # [B·T, V]
                if q_all is not None:
                    q_all[:, lv.nodes] = q.view(B, T, -1)
                if rule == "coupled":  # the uniforms of the children's position (absolute: parent's + 1)
                    u = sampler.position_uniforms((positions + 1).reshape(B * T), rows)
                    kids = draw_children(q, lv.k, rule, sampler.random, rows, u)
                elif rule != "topk":
                    kids = draw_children(q, lv.k, rule, sampler.random, rows)
            tokens[:, lv.dst] = kids.view(B, T * lv.k)[:, lv.src]
        return tokens, q_all


class SelfDrafter(Drafter):
    """The target drafts over its own cache through the policy's compressed view."""

    family = "self"

    def __init__(self, model: Transformer, policy: DraftKVPolicy):
        super().__init__(policy)
        self.target = model

    def propose(self, target, draft, prev, last, tree, sampler, rule, need_q):
        return self._draft(target, None, last, tree, sampler, rule, need_q, self.target.config.vocab_size)


@dataclass(frozen=True)
class RemoteDraft:
    """A draft model held by other tensor-parallel ranks (`SpeculativeConfig.draft_tensor_parallel` = K: ranks
    0 … K−1 hold it): what a rank outside them knows of it — its vocabulary size, the width of the proposals
    it receives."""

    vocab_size: int


class ModelDrafter(Drafter):
    """A standalone draft model over its own cache (the Engine keeps it: same rows, same page table as
    the target's, the draft model's own pages) — or, over a `RemoteDraft`, a rank's place in the steps of a
    draft model other ranks run."""

    family = "draft"
    standalone = True

    def __init__(self, model: Transformer | RemoteDraft, policy: DraftKVPolicy, target_vocab: int):
        super().__init__(policy)
        remote = isinstance(model, RemoteDraft)
        self.own_model = None if remote else model
        self.target_vocab = target_vocab
        # Tokens the two models share; the draft never proposes a token outside this range.
        self.shared_vocab = min(target_vocab, model.vocab_size if remote else model.config.vocab_size)
        self._plan: DevicePlan | None = None  # the latest proposal's (for commit)
        # under tensor parallelism with this draft whole on every rank, or on a subset of the ranks: the group whose
        # rank 0's proposal every rank takes (the ranks' drafts would agree bit for bit only where their kernels
        # are deterministic, and ranks outside a subset draft nothing; the target verifies rank 0's tree
        # everywhere, so a rank whose draft differed only drafts worse next step)
        self.replicas = None

    @property
    def model(self) -> Transformer | None:
        return self.own_model

    def propose(self, target, draft, prev, last, tree, sampler, rule, need_q):
        if self.own_model is None:  # (the draft on other ranks: rank 0's proposal arrives below)
            tokens, q = self._await(last, tree, need_q)
        else:
            tokens, q = self._propose_here(target, draft, prev, last, tree, sampler, rule, need_q)
        if self.replicas is not None:
            tokens, q = self._take_rank0(tokens, q, sampler)
        return tokens, None if q is None else self.pad_to_target(q)

    def _propose_here(self, target, draft, prev, last, tree, sampler, rule, need_q):
        # Rewind every generating row by one (re-feed the newest committed token, which may be an
        # accepted leaf the draft never fed); rows that do not generate (live 0: idle, prefilling)
        # keep their length, so this step's scratch writes land past their prefilled tokens.
        draft.cache.lengths.copy_(target.cache.lengths - target.cache.live)
        self._plan = self._plan_for(tree, 1, last.device)  # (one lead token: prev)
        return self._draft(draft, prev[:, None], last, tree, sampler, rule, need_q, self.shared_vocab)

    def _await(self, last: torch.Tensor, tree: Tree, need_q: bool):
        """A rank outside the draft's: buffers for rank 0's proposal — tokens [B, n], distributions [B, n, V_shared]
        (`_draft`'s shapes and dtypes)."""
        B, device = last.shape[0], last.device
        tokens = torch.zeros(B, tree.size, dtype=torch.long, device=device)
        q = torch.zeros(B, tree.size, self.shared_vocab, device=device) if need_q else None
        return tokens, q

    def _take_rank0(self, tokens: torch.Tensor, q: torch.Tensor | None, sampler: Sampler):
        """Rank 0's tokens [B, n] and distributions [B, n, V] on every rank, and its random counters [B] with them:
        drawing children advances a row's counter, and a rank that drafted nothing (outside a subset) must draw
        the verification's numbers where rank 0 does. Tokens and counters go in one broadcast."""
        counter = sampler.random.counter  # [B] (a view of the executor's: written in place)
        both = self.replicas.broadcast(torch.cat([tokens, counter[:, None]], dim=1))
        counter.copy_(both[:, -1])
        q = None if q is None else self.replicas.broadcast(q)
        return both[:, :-1], q

    def pad_to_target(self, q: torch.Tensor) -> torch.Tensor:
        """Draft distributions over the shared vocabulary [..., V_shared] → [..., V_target] (zeros beyond)."""
        if self.shared_vocab == self.target_vocab:
            return q
        return torch.cat([q, q.new_zeros(*q.shape[:-1], self.target_vocab - self.shared_vocab)], dim=-1)

    def commit(self, draft, path_src, count):
        # Draft slots (from the rewound length): 0 = prev, 1 + fed_pos[v] = node v. The accepted path's
        # internal nodes all have children, so all were fed; its last node may be an unfed leaf, but the
        # next step re-feeds it as `prev`, so it need not move. The draft's lengths stay rewound: the
        # next proposal sets them from the target's.
        if self.own_model is None:
            return  # (the draft's cache lives on its ranks)
        assert self._plan is not None
        if self._plan.chain:
            return  # a chain: every accepted node is already in place
        src = torch.cat([torch.zeros_like(path_src[:, :1]), 1 + self._plan.fed_pos[path_src].clamp(min=0)], dim=1)
        draft.cache.compact(src, count)  # entries past count (incl. the path's last node) stay put


def check_compatible(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """A draft must share the target's tokenizer (on the shared id range) — else a clear error."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    shared = min(target_vocab, draft_vocab)
    t_items = {tok: i for tok, i in tv.items() if i < shared}
    d_items = {tok: i for tok, i in dv.items() if i < shared}
    if t_items != d_items:
        differing = sorted(set(t_items.items()) ^ set(d_items.items()), key=lambda x: x[1])[:3]
        raise ConfigError(
            "the draft model's tokenizer differs from the target's (speculation needs the same token ids); "
            f"e.g. {differing}"
        )
