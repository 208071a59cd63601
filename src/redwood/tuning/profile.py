"""Latency profiles for hardware-aware tree selection (`redwood profile` → ``redwood.profile/1``).

Measured on the current device, in milliseconds, median of `repeats` timed runs after `warmup` untimed
ones (CUDA is synchronised before and after every run):

- **target** t_target(n): one target forward over n new tokens shaped as a tree (a complete binary tree
  in breadth-first order: its ancestor mask through the tree-attention path; n = 1 is a plain decode
  step), for `batch` rows, after a prefill of `context` tokens. The new tokens go to scratch slots and
  are never committed, so every run sees the same cache. Forwards run as the engine runs them (a
  `StepRunner`: CUDA graphs on CUDA; eagerly for a target whose layers are offloaded to host memory,
  `redwood profile --offload`, whose forwards stream every layer's weights over the host link).
- **draft** t_draft(w): one draft forward over w new sibling nodes (each sees the committed context and
  itself) after a prefill of `context` tokens: one level of tree drafting. Without a draft model the
  target itself is timed; with a draft KV policy (`draft_policy`, `redwood profile --draft-kv`) the draft
  reads the context through that compressed view, as MagicDec's drafts run (else the whole cache).
- **overhead** (optional) per step with an n-node tree: `probabilities` of the target's n and the draft's
  n distributions, then the verifier's walk (`verify_tree_paths`, device-side random numbers), on random
  logits of the target's vocabulary — the sampling / verification work outside the forwards. On CUDA it
  is timed as a captured graph, as the engine runs it inside each step's graph.

`redwood tree-search --profile FILE` reads the result (`redwood.tuning.tree_search.load_profile`).
"""

from __future__ import annotations

import platform
from typing import Sequence

import torch

from redwood.engine.runner import CapturedStep, StepRunner, time_ms
from redwood.errors import ConfigError
from redwood.sample.random import RowRandom
from redwood.sample.sampler import probabilities
from redwood.sample.tree_verify import VERIFIERS, verify_tree_paths
from redwood.speculation.trees import Tree
from redwood.tuning.tree_search import LatencyProfile

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def parse_sizes(text: str, flag: str) -> tuple[int, ...]:
    """ "1,2,4" → (1, 2, 4): positive, sorted, deduplicated, and including 1."""
    parts = [s.strip() for s in str(text).split(",") if s.strip()]
    try:
        sizes = sorted({int(s) for s in parts})
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated positive integers, got {text!r}") from None
    if not sizes:
        raise ConfigError(f"{flag} is empty: give sizes such as 1,2,4,8")
    if sizes[0] < 1:
        raise ConfigError(f"{flag} sizes must be positive, got {sizes[0]}")
    if sizes[0] != 1:
        raise ConfigError(f"{flag} must include 1 (the single-token baseline tree search divides by)")
    return tuple(sizes)


def profile_tree(n: int) -> Tree:
    """A complete binary tree of n nodes (breadth-first: node i's parent is (i − 1) // 2)."""
    return Tree((-1,) + tuple((i - 1) // 2 for i in range(1, n)))


def _prefilled_cache(model, batch: int, context: int, extra: int, generator: torch.Generator, policy=None):
    """A cache holding `context` random tokens per row; with a draft KV `policy`, started for them and
    shown the prefill (SnapKV selects its positions there)."""
    from redwood.engine.prefill import prefill_batch

    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, context), generator=generator).tolist()
    cache = model.new_cache(batch, context + extra)
    observer = None
    if policy is not None:
        policy.start(torch.full((batch,), context, device=model.device), model.config.num_layers)
        observer = policy.prefill_observer()
    prefill_batch(model, cache, prompts, observer=observer)
    return cache


def _check_fits(model, what: str, context: int, extra: int) -> None:
    limit = model.config.max_position_embeddings
    if context + extra > limit:
        raise ConfigError(
            f"{what}: context {context} + {extra} new tokens exceeds its {limit}-token context; "
            f"lower --context or the largest size"
        )


@torch.inference_mode()
def target_latency(
    model,
    sizes: Sequence[int],
    batch: int,
    context: int,
    repeats: int,
    warmup: int,
    seed: int = 0,
    cuda_graphs: bool = True,
) -> list[float]:
    device = model.device
    _check_fits(model, "target", context, max(sizes))
    g = torch.Generator().manual_seed(seed)
    cache = _prefilled_cache(model, batch, context, max(sizes), g)
    # as the engine runs its steps: graphs on CUDA, unless the weights stream from the host (offloading)
    runner = StepRunner(model, cache, use_graphs=cuda_graphs and not _offloaded(model))
    out = []
    for n in sizes:
        tree = profile_tree(n)
        ids = torch.randint(0, model.config.vocab_size, (batch, n), generator=g).to(device)
        positions = cache.lengths[:, None] + tree.depths_tensor(device)[None]
        mask = None if n == 1 else tree.ancestor_mask(device)
        out.append(
            time_ms(
                lambda: runner.forward(ids, positions, new_mask=mask, mask_key=("profile", n)), device, repeats, warmup
            )
        )
    return out


@torch.inference_mode()
def draft_latency(
    model,
    widths: Sequence[int],
    batch: int,
    context: int,
    repeats: int,
    warmup: int,
    seed: int = 1,
    cuda_graphs: bool = True,
    policy=None,
) -> list[float]:
    """Draft forwards of w sibling nodes after a prefill of `context` tokens; `policy`: a draft KV policy
    (redwood.kv.policies) whose view of the context the forwards read, as a compressed draft runs."""
    device = model.device
    _check_fits(model, "draft", context, max(widths) + 1)
    g = torch.Generator().manual_seed(seed)
    cache = _prefilled_cache(model, batch, context, max(widths), g, policy)
    runner = StepRunner(model, cache, use_graphs=cuda_graphs)
    out = []
    for w in widths:
        ids = torch.randint(0, model.config.vocab_size, (batch, w), generator=g).to(device)
        positions = (cache.lengths + 1)[:, None].expand(batch, w)  # siblings share a position
        mask = None if w == 1 else torch.eye(w, dtype=torch.bool, device=device)
        out.append(
            time_ms(
                lambda: runner.forward(ids, positions, new_mask=mask, mask_key=("profile", w), policy=policy),
                device,
                repeats,
                warmup,
            )
        )
    return out


@torch.inference_mode()
def overhead_latency(
    vocab: int,
    sizes: Sequence[int],
    batch: int,
    device: torch.device,
    repeats: int,
    warmup: int,
    temperature: float,
    top_p: float,
    verifier: str,
    seed: int = 2,
    cuda_graphs: bool = True,
) -> list[float]:
    if verifier not in VERIFIERS:
        raise ConfigError(f"unknown verifier {verifier!r}; choose one of {', '.join(VERIFIERS)}")
    g = torch.Generator().manual_seed(seed)
    rand = RowRandom([seed + b for b in range(batch)], device)
    out = []
    for n in sizes:
        N = batch * n
        lt = (torch.randn(N, vocab, generator=g) * 3).to(device)
        ld = (torch.randn(N, vocab, generator=g) * 3).to(device)
        tokens = torch.randint(0, vocab, (batch, n), generator=g).to(device)
        temp = torch.full((N,), float(temperature), device=device)
        tk = torch.zeros(N, dtype=torch.long, device=device)
        tp = torch.full((N,), float(top_p), device=device)
        parents = list(profile_tree(n).parents)
        need_q = verifier in ("sequoia", "specinfer")
        flags = dict(any_filter=top_p < 1, any_greedy=temperature == 0)  # (no host reads inside a capture)

        def step():
            # (the engine's greedy verifier reads the target's argmax straight from the logits)
            p = (lt if verifier == "greedy" else probabilities(lt, temp, tk, tp, **flags)).view(batch, n, vocab)
            q = probabilities(ld, temp, tk, tp, **flags).view(batch, n, vocab) if need_q else None
            return verify_tree_paths(verifier, parents, tokens, p, q, rand)

        if device.type == "cuda" and cuda_graphs:
            graph = CapturedStep(step, (), torch.cuda.graph_pool_handle(), restore=rand.checkpoint)
            out.append(time_ms(graph.replay, device, repeats, warmup))
        else:
            out.append(time_ms(step, device, repeats, warmup))
    return out


def _offloaded(model) -> bool:
    from redwood.models.offload import get_offload

    return get_offload(model) is not None


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.machine()} {platform.processor() or ''}".rstrip() + f", {torch.get_num_threads()} threads"


def measure_profile(
    target,
    draft=None,
    *,
    target_name: str = "",
    draft_name: str | None = None,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    batch: int = 1,
    context: int = 256,
    repeats: int = 5,
    warmup: int = 2,
    overhead: bool = True,
    temperature: float = 0.6,
    top_p: float = 1.0,
    verifier: str | None = None,
    dtype: str | None = None,
    progress=None,
    cuda_graphs: bool = True,
    draft_policy=None,
) -> LatencyProfile:
    """Profile `target` (and `draft`, else the target again) on their device; see the module docstring.
    cuda_graphs=False times eager steps (as `--no-cuda-graphs` runs them). draft_policy: the draft reads
    the context through this KV policy (MagicDec's compressed drafts; None or full: the whole cache)."""
    for name, v, lo in (("batch", batch, 1), ("context", context, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
    tokens = parse_sizes(",".join(map(str, tokens)), "--tokens")
    widths = parse_sizes(",".join(map(str, widths)), "--widths")
    if verifier is None:
        verifier = "greedy" if temperature == 0 else "sequoia"
    if verifier == "greedy" and temperature > 0:
        raise ConfigError("the greedy verifier is exact only at temperature 0")
    device = target.device
    say = progress or (lambda msg: None)
    say(f"target forward over {', '.join(map(str, tokens))} tokens")
    t_ms = target_latency(target, tokens, batch, context, repeats, warmup, cuda_graphs=cuda_graphs)
    d_model = draft if draft is not None else target
    say(f"draft forward over {', '.join(map(str, widths))} nodes")
    d_ms = draft_latency(d_model, widths, batch, context, repeats, warmup, cuda_graphs=cuda_graphs, policy=draft_policy)
    o_ms = None
    if overhead:
        say(f"sampling + {verifier} verification over {', '.join(map(str, tokens))} nodes")
        o_ms = overhead_latency(
            target.config.vocab_size,
            tokens,
            batch,
            device,
            repeats,
            warmup,
            temperature,
            top_p,
            verifier,
            cuda_graphs=cuda_graphs,
        )
    notes = {
        "repeats": repeats,
        "warmup": warmup,
        "statistic": "median",
        "target_tree": "complete binary tree of n nodes (tree-attention mask); n = 1 a decode step",
        "draft_shape": "w sibling nodes, each attending to the context and itself",
        "draft_kv": draft_policy.describe() if draft_policy is not None else "full",
        "draft_is_target": draft is None,
        "draft_weights": "int8"
        if getattr(draft, "skinny_int8", None)
        else (draft.weights if getattr(draft, "weights", "float32") != "float32" else "model dtype"),
        "cuda_graphs": cuda_graphs and device.type == "cuda",
        "target_offloaded": _offloaded(target),
        "torch": torch.__version__,
    }
    if overhead:
        notes["overhead"] = {
            "verifier": verifier,
            "temperature": temperature,
            "top_p": top_p,
            "what": "probabilities of target and draft logits + verify_tree, per step",
        }
    return LatencyProfile(
        target_tokens=tuple(tokens),
        target_ms=tuple(round(x, 6) for x in t_ms),
        draft_width=tuple(widths),
        draft_ms=tuple(round(x, 6) for x in d_ms),
        overhead_tokens=tuple(tokens) if o_ms is not None else None,
        overhead_ms=tuple(round(x, 6) for x in o_ms) if o_ms is not None else None,
        device=describe_device(device),
        dtype=dtype or str(target.dtype).removeprefix("torch."),
        batch=batch,
        context=context,
        models={"target": target_name, "draft": draft_name if draft is not None else target_name},
        notes=notes,
    )
