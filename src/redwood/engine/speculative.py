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
from redwood.spec.tree_verify import CHILD_RULE, verify_tree
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
    """→ path [B, A] (root then accepted nodes, padded with 0), accepted count a [B], next token [B]."""
    B, n = tokens.shape
    if tree.is_chain and n > 1 and kind in ("greedy", *STOCHASTIC):  # (no drafts, chain:0: the tree walk)
        drafts = tokens[:, 1:]
        if kind == "greedy":
            a, nxt = verify_greedy(p, drafts)
        else:
            a, nxt = verify_sampling(p, q[:, :-1], drafts, sampler.generators)
        return torch.arange(n, device=tokens.device)[None].expand(B, n), a, nxt
    walk = "sequoia" if kind == "sampling" else kind
    paths, nxt = verify_tree(walk, list(tree.parents), tokens, p, q, sampler.generators)
    A = 1 + max((len(x) for x in paths), default=0)
    path = torch.zeros(B, A, dtype=torch.long, device=tokens.device)
    for b, x in enumerate(paths):
        if x:
            path[b, 1: 1 + len(x)] = torch.tensor(x, device=tokens.device)
    a = torch.tensor([len(x) for x in paths], device=tokens.device)
    return path, a, nxt


@torch.inference_mode()
def speculative(target: Transformer, drafter: Drafter, requests: list[RequestState], tree: Tree,
                verifier: str = "auto", pool: RunnerPool | None = None) -> Iterator[list[int]]:
    """Generate for all requests with speculation; after each step yields the rows that got tokens.

    pool: where the caches (and, on CUDA, the captured step graphs) come from; None → fresh caches,
    eager forwards.
    """
    pool = pool or RunnerPool(use_graphs=False)
    device = target.device
    B = len(requests)
    sampler = Sampler([r.params for r in requests], device)
    kind = resolve_verifier(verifier, tree, sampler.all_greedy)
    rule = "topk" if kind == "greedy" else ("swor" if kind == "sampling" else CHILD_RULE[kind])
    need_q = kind in STOCHASTIC
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
    for r in requests:
        r.stats.prefill_s = t1 - t0
        r.stats.spec = SpecStats(gamma=tree.max_depth - 1, drafted_per_step=n - 1)
    for b, r in enumerate(requests):
        r.append(last_list[b])
    yield list(range(B))
    mask = tree.ancestor_mask(device)
    depth = tree.depths_tensor(device)
    rows = torch.arange(B, device=device).repeat_interleave(n)
    while not all(r.finished for r in requests):
        sync(device)
        ta = time.perf_counter()
        tokens, q = drafter.propose(runner, prev, last, tree, sampler, rule, need_q)  # [B, n], [B, n, V]
        sync(device)
        tb = time.perf_counter()
        positions = cache.lengths[:, None] + depth[None]
        logits = runner.forward(tokens, positions, new_mask=None if tree.is_chain else mask,
                                mask_key=("verify", tree))  # [B, n, V]
        p = sampler.probs(logits.reshape(B * n, -1), rows).view(B, n, -1)
        path, accepted, nxt = _verify(kind, tree, tokens, p, q, sampler)
        path_tokens = tokens.gather(1, path)  # [B, A]
        prev = path_tokens.gather(1, accepted[:, None])[:, 0]
        last = nxt
        acc_list, nxt_list, path_list = accepted.tolist(), nxt.tolist(), path_tokens.tolist()
        tc = time.perf_counter()
        updated = []
        # Slots each row commits: a + 1 (last and the path), fewer when the row finishes within the step
        # (only the tokens it emitted, so its cache holds exactly its output and its length never passes
        # prompt + max_new_tokens), none once finished.
        kept = [0] * B
        for b, r in enumerate(requests):
            if r.finished:
                continue
            updated.append(b)
            spec = r.stats.spec
            spec.record(acc_list[b])
            spec.draft_s += tb - ta
            spec.verify_s += tc - tb
            for tok in path_list[b][1: acc_list[b] + 1] + [nxt_list[b]]:
                kept[b] += 1
                if r.append(tok):
                    r.stats.decode_s = time.perf_counter() - t1
                    break
        kept_t = torch.tensor(kept, device=device)
        if not tree.is_chain:
            cache.compact(path, kept_t)
        drafter.commit(path, accepted + 1)
        cache.commit(kept_t)
        yield updated
