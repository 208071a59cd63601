"""The speculative loop: draft → verify → commit, for a batch of independent rows.

State per row between steps: the target cache holds the committed tokens except the newest one, `last`
(sampled but not yet fed), and `prev` is the newest committed token. Each step, for a token tree whose
root is `last` (a chain of γ drafts is the tree with one child per node):
    draft   the drafter fills the tree's other nodes (and their draft distributions q);
    verify  one target forward over all n nodes (slots L…L+n−1, positions L + depth, the tree's ancestor
            mask) gives p at every node; the verifier picks each row's accepted path (a nodes below the
            root) and the next token (the correction, or the bonus after a fully accepted path);
    commit  the accepted path's KV moves into slots L…L+a in the target (and draft) cache and each
            active row keeps a + 1 tokens (last and the path); the rest is scratch. `last` becomes the
            next token.
Rows finish independently (EOS, stop strings, max_new_tokens); a finished row commits nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from redwood.engine.generate import cache_capacity, prefill, sync
from redwood.engine.request import RequestState, SpecStats
from redwood.engine.runner import RunnerPool
from redwood.engine.sampling import Sampler
from redwood.errors import ConfigError
from redwood.models.transformer import Transformer
from redwood.spec.drafters import Drafter
from redwood.spec.tree_verify import CHILD_RULE, verify_tree_paths
from redwood.spec.trees import Tree
from redwood.spec.verifiers import verify_greedy, verify_sampling

# Chain verifiers are vectorized special cases of the tree walks: with one child per node, Sequoia's
# sampling without replacement and SpecInfer are both plain speculative rejection sampling.
STOCHASTIC = ("sampling", "sequoia", "specinfer")


def resolve_verifier(verifier: str, tree: Tree, all_greedy: bool) -> str:
    """The verifier to run: 'auto' → greedy when every request is greedy, else rejection sampling."""
    if verifier == "auto":
        return "greedy" if all_greedy else ("sampling" if tree.is_chain else "sequoia")
    if verifier == "greedy" and not all_greedy:
        raise ConfigError("the greedy verifier is lossless only at temperature 0; use verifier='sampling' "
                          "(or 'sequoia' / 'specinfer' / 'topk' for trees, or 'auto') for sampled requests")
    if verifier == "sampling" and not tree.is_chain:
        return "sequoia"
    return verifier



def _verify(kind: str, tree: Tree, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
            sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ path [B, A] (root then accepted nodes, padded with 0), accepted count a [B], next token [B].

    p: [B, n, V] target probabilities (for the greedy verifier, logits do as well: only argmax matters).
    No host synchronization (graph-capturable).
    """
    B, n = tokens.shape
    if tree.is_chain and n > 1 and kind in ("greedy", *STOCHASTIC):  # (no drafts, chain:0: the tree walk)
        drafts = tokens[:, 1:]
        if kind == "greedy":
            a, nxt = verify_greedy(p, drafts)
        else:
            a, nxt = verify_sampling(p, q[:, :-1], drafts, sampler.random)
        return torch.arange(n, device=tokens.device)[None].expand(B, n), a, nxt
    walk = "sequoia" if kind == "sampling" else kind
    nodes, nxt = verify_tree_paths(walk, list(tree.parents), tokens, p, q, sampler.random)  # [B, depth]
    path = torch.cat([nodes.new_zeros(B, 1), nodes.clamp(min=0)], dim=1)
    return path, (nodes >= 0).sum(1), nxt


class SpecStep:
    """The device work of one speculative step, for a fixed batch, tree and verifier:

        (prev [B], last [B]) → draft the tree → one target forward over it → verify →
        path [B, A], accepted [B], next token [B], new prev [B], host [B, 2 + A] (accepted, next token,
        the path's tokens — what the host reads, in one transfer)

    Nothing in it reads a device value on the host, so on CUDA it is captured whole into one graph.
    """

    def __init__(self, target: Transformer, runner, drafter: Drafter, tree: Tree, kind: str, rule: str,
                 sampler: Sampler):
        self.runner, self.drafter, self.tree = runner, drafter, tree
        self.kind, self.rule, self.sampler = kind, rule, sampler
        self.need_q = kind in STOCHASTIC
        device = target.device
        self.mask = None if tree.is_chain else tree.ancestor_mask(device)
        self.depth = tree.depths_tensor(device)

    def draft(self, prev: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.drafter.propose(self.runner, prev, last, self.tree, self.sampler, self.rule, self.need_q)

    def verify(self, tokens: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        B, n = tokens.shape
        positions = self.runner.cache.lengths[:, None] + self.depth[None]
        logits = self.runner.forward(tokens, positions, new_mask=self.mask, mask_key=("verify", self.tree))
        if self.kind == "greedy":
            p = logits  # [B, n, V]: argmax is all the greedy verifier reads
        else:
            rows = torch.arange(B, device=tokens.device).repeat_interleave(n)
            p = self.sampler.probs(logits.reshape(B * n, -1), rows).view(B, n, -1)
        path, accepted, nxt = _verify(self.kind, self.tree, tokens, p, q, self.sampler)
        path_tokens = tokens.gather(1, path)  # [B, A]
        prev = path_tokens.gather(1, accepted[:, None])[:, 0]
        host = torch.cat([accepted[:, None], nxt[:, None], path_tokens], dim=1)
        return path, accepted, nxt, prev, host

    def __call__(self, prev: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.verify(*self.draft(prev, last))


@torch.inference_mode()
def speculative(target: Transformer, drafter: Drafter, requests: list[RequestState], tree: Tree,
                verifier: str = "auto", pool: RunnerPool | None = None) -> Iterator[list[int]]:
    """Generate for all requests with speculation; after each step yields the rows that got tokens.

    pool: where the caches (and, on CUDA, the captured step graphs) come from; None → fresh caches,
    eager forwards. With graphs each step is one replay of a graph holding the whole `SpecStep`;
    without, the draft and verification are timed separately (`SpecStats.draft_s` / `verify_s`).
    """
    pool = pool or RunnerPool(use_graphs=False)
    device = target.device
    B = len(requests)
    sampler = Sampler([r.params for r in requests], device)
    kind = resolve_verifier(verifier, tree, sampler.all_greedy)
    rule = "topk" if kind == "greedy" else ("swor" if kind == "sampling" else CHILD_RULE[kind])
    n = tree.size
    capacity = cache_capacity(requests, extra=n)
    prompts = [r.prompt_ids for r in requests]
    t0 = time.perf_counter()
    drafter.prefill(prompts, capacity, pool)
    runner = pool.get("target", target, B, capacity)
    cache = runner.cache
    logits = prefill(target, cache, prompts, observer=drafter.target_prefill_observer())
    last = sampler.sample(logits)
    prev = torch.tensor([p[-1] for p in prompts], device=device)
    last_list = last.tolist()
    t1 = time.perf_counter()
    captured_at_t1 = pool.capture_s
    for r in requests:
        r.stats.prefill_s = t1 - t0
        r.stats.spec = SpecStats(gamma=tree.max_depth - 1, drafted_per_step=n - 1)
    for b, r in enumerate(requests):
        r.append(last_list[b])
    yield list(range(B))
    if runner.use_graphs:
        # One graph per (batch, tree, verifier, sampling flags, drafter state); it owns a copy of the
        # sampler's device state, loaded from this generation's sampler before the first replay.
        key = ("spec", B, tree, kind, sampler.all_greedy, sampler.any_greedy, sampler.any_filter,
               drafter.graph_key())
        owned = sampler.copy()
        captured = runner.captured_step(
            key, lambda: SpecStep(target, runner, drafter, tree, kind, rule, owned), (prev, last),
            restore=owned.random.checkpoint)
        captured.fn.sampler.load_state(sampler)
        step_fn, split = captured.replay, None
    else:
        split = SpecStep(target, runner, drafter, tree, kind, rule, sampler)
    # Timings leave out one-time CUDA-graph captures (pool.capture_s grows by each one's seconds): the
    # whole-step graph above, or, on the split path, forward graphs captured inside the first steps.
    while not all(r.finished for r in requests):
        ca = pool.capture_s
        ta = time.perf_counter()
        if split is None:
            path, accepted, nxt, prev, host = step_fn(prev, last)
            host_list = host.tolist()  # the step's one host synchronization
            tb = tc = time.perf_counter()
            cb = cc = pool.capture_s
        else:
            tokens, q = split.draft(prev, last)
            sync(device)
            tb, cb = time.perf_counter(), pool.capture_s
            path, accepted, nxt, prev, host = split.verify(tokens, q)
            host_list = host.tolist()
            tc, cc = time.perf_counter(), pool.capture_s
        last = nxt
        updated = []
        # Slots each row commits: a + 1 (last and the path), fewer when the row finishes within the step
        # (only the tokens it emitted, so its cache holds exactly its output and its length never passes
        # prompt + max_new_tokens), none once finished.
        kept = [0] * B
        for b, r in enumerate(requests):
            if r.finished:
                continue
            updated.append(b)
            a, nxt_b, path_b = host_list[b][0], host_list[b][1], host_list[b][2:]
            spec = r.stats.spec
            spec.record(a)
            spec.draft_s += (tb - ta) - (cb - ca) if split is not None else 0.0
            spec.verify_s += (tc - tb) - (cc - cb)
            for tok in path_b[1: a + 1] + [nxt_b]:
                kept[b] += 1
                if r.append(tok):
                    r.stats.decode_s = time.perf_counter() - t1 - (pool.capture_s - captured_at_t1)
                    cache.live[b] = 0  # later steps read none of this row's KV
                    break
        kept_t = torch.tensor(kept, device=device)
        if not tree.is_chain:
            cache.compact(path, kept_t)
        drafter.commit(path, accepted + 1)
        cache.commit(kept_t)
        # A step's time: the device work through the host's read, plus the host's bookkeeping (emitting
        # tokens, detokenizing for stop strings, queueing the commit) — as an AR step's time includes its own.
        t_end = time.perf_counter()
        for b in updated:
            requests[b].stats.spec.step_s += (t_end - ta) - (pool.capture_s - ca)
        yield updated
