"""How to speculate: `SpeculativeConfig` (a draft model or self-speculation, the draft's KV policy, a chain
or a token tree, the verifier), validated on construction by building what it names."""

from __future__ import annotations

from dataclasses import dataclass

from redwood.errors import ConfigError
from redwood.kv.policies import KV_POLICIES, make_policy
from redwood.models.cpu_weights import WEIGHT_CHOICES
from redwood.speculation.draftless import DEFAULT_MAX_N, DEFAULT_MIN_N, check_ngram_sizes
from redwood.speculation.suffix import DEFAULT_TREE
from redwood.speculation.trees import Tree, resolve_tree

POLICIES = ("fixed", "auto")
VERIFIERS = ("auto", "greedy", "sampling", "sequoia", "specinfer", "topk", "match")

# The most draft tokens one step may accept: γ for a chain, depth − 1 for a tree. Acceptance compounds
# along a path, so even at a per-token acceptance of 0.95 a 64th draft token is accepted in 4% of steps
# (0.95^64) and expected tokens per step are within 4% of their γ → ∞ limit (1 / (1 − α) = 20); the
# papers' chains and trees stay at or under ~16-20 levels. Deeper drafts only cost draft forwards and a
# longer verify (`--gamma 1000` spent 282 s drafting to emit 8 tokens).
# where a draft model lives under tensor parallelism (`draft_tensor_parallel`; or K: sharded over ranks 0 … K−1)
DRAFT_PLACEMENTS = ("shard", "replicate")
DRAFTLESS = ("ngram", "suffix")  # drafters that run no model (`speculation.draftless`, `speculation.suffix`)

MAX_DRAFT_DEPTH = 64


def check_draft_placement(placement, world: int | None = None) -> None:
    """A one-line ConfigError for a `draft_tensor_parallel` that is neither a placement's name nor a number of
    ranks ≥ 1 — and, given the tensor-parallel size `world` (> 1), for a number that is not a strict subset of
    its ranks. (Whether the draft's shapes split over those ranks: `engine.loaded.check_tensor_parallel`.)"""
    if isinstance(placement, str):
        if placement not in DRAFT_PLACEMENTS:
            raise ConfigError(
                f"unknown draft_tensor_parallel {placement!r}; choose one of {', '.join(DRAFT_PLACEMENTS)} "
                "or a number of ranks"
            )
        return
    if not isinstance(placement, int) or isinstance(placement, bool) or placement < 1:
        raise ConfigError(
            f"draft_tensor_parallel must be {' or '.join(repr(p) for p in DRAFT_PLACEMENTS)} or a number of ranks "
            f">= 1, got {placement!r}"
        )
    if world is None or world == 1:
        return
    if placement == world:
        raise ConfigError(
            f"draft_tensor_parallel {placement} is every one of the {world} tensor-parallel ranks: that is "
            "draft_tensor_parallel='shard' (the default)"
        )
    if placement > world:
        raise ConfigError(
            f"draft_tensor_parallel {placement} is more ranks than tensor_parallel_size {world}: a number K shards "
            f"the draft model over the target's ranks 0 … K−1 (K from 1 to {world - 1})"
        )


def check_draft_tree(tree, what: str = "tree") -> None:
    """A ConfigError for a speculation tree with no draft token (a lone root: plain decoding — vLLM
    likewise rejects num_speculative_tokens 0 with a draft) or deeper than MAX_DRAFT_DEPTH drafts."""
    if tree.size < 2:
        raise ConfigError(
            f"{what} has no draft tokens (a lone root); speculate at least one token per step, "
            f"or drop the speculation settings to decode autoregressively"
        )
    if tree.max_depth - 1 > MAX_DRAFT_DEPTH:
        raise ConfigError(
            f"{what} drafts {tree.max_depth - 1} tokens deep; at most {MAX_DRAFT_DEPTH} (a longer "
            f"path is almost never accepted whole, and every level costs a draft forward)"
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate (MagicDec-style chains).

    draft_model: a zoo name / folder / .gguf of a small model sharing the target's tokenizer; or
    self_speculate=True: the target drafts for itself, reading a compressed view of its own KV cache; or
    draftless="ngram": no draft forward — each step proposes the tokens that followed the latest earlier
    occurrence of the request's last ngram_max … ngram_min tokens (prompt lookup; `speculation.draftless`);
    draftless="suffix": no draft forward — a token tree of the continuations the request's tokens (and, with
    suffix_shared=True, recent requests' tokens) made after its longest matching suffix, ranked by count
    (`speculation.suffix`); its tree is `tree` (default `speculation.suffix.DEFAULT_TREE`; num_draft_tokens
    does not apply: a chain is tree="chain:G"), verified by greedy, match or topk ("auto" picks them).
    draft_kv: which committed tokens the draft reads — "full", "streaming" (sinks + recent window) or
    "snapkv" (prefill-selected positions + recent tokens), within `draft_budget` tokens.
    sinks / window: StreamingLLM's sink count and recent window (window defaults to budget − sinks);
    for snapkv, `window` is the observation window (default 32) and `pool_kernel` its smoothing.
    num_draft_tokens: γ, draft tokens per step of a chain (the target verifies γ + 1 positions).
    tree: a token tree instead of a chain — "chain:G", "chains:KxL", a tree JSON file or a shipped tree
    name (see `redwood tree-search`); the target verifies all its nodes in one forward.
    verifier: "greedy" (accept the target's argmax; temperature 0 only), "sampling" (speculative
    rejection sampling; on a tree, Sequoia's), "sequoia" (children drawn without replacement),
    "specinfer" (children drawn with replacement), "topk" (the draft's top-k children; the target
    samples), "match" (the target samples each position with the seed's number there and drafts are
    accepted while they equal its tokens: a seeded request's tokens are then the same as without
    speculation — `sample.chain_verify.verify_match`), or "auto" (greedy when every request is greedy,
    else sampling / sequoia). All but greedy are lossless at any temperature / top-k / top-p.
    policy: "fixed" (every step speculates as configured) or "auto" (`speculation.policy.AutoPolicy`: each
    step runs plain decoding or a chain of γ = 1..8 from the configured drafter, or of up to 16 from the
    draftless one — draftless=None means "ngram" there — whichever the cost model and live acceptance expect
    to give the most tokens per second; draft_model / self_speculate are optional then; num_draft_tokens and
    tree do not apply).
    acceptance_file: a `redwood acceptance` file (redwood.acceptance/1) measured for the model drafter: the auto
    policy starts from its rates (at its temperature) instead of a flat guess, and learns from there.
    draft_weights: the draft model's weight format on its device (`redwood.models.cpu_weights`). On the
    CPU every CPU format ("auto": q4k — re-quantized to Q4_K — for a GGUF draft where kquant runs, else
    w8a8 on an AVX512-VNNI CPU, else int4; float32 for other checkpoints; "float32" | "bfloat16" | "int8"
    | "int4" | "w8a8" | "q4k" | "gguf" | "kquant"). On CUDA "auto" / "float32" (the model's dtype) or
    "int8": its one-token forwards read int8 copies of its projection weights (per-row scales), half the
    bytes per draft level; another CPU format there is a ConfigError as the models load
    (`cpu_weights.draft_weights_on`). Verification stays exact, so outputs do not change; acceptance may.
    draft_tensor_parallel: where a draft model lives under tensor parallelism — "shard" (over the target's ranks,
    its all-reduces in every draft level), "replicate" (whole on every rank: no collectives in a draft level,
    its whole weights read on every rank) or K, a number of ranks below the tensor-parallel size (sharded over
    ranks 0 … K−1 alone, its all-reduces among them; K = 1: whole on rank 0; the other ranks hold none of it
    and skip the draft levels — MagicDec's `--draft_rank_group`). Placed other than "shard", rank 0's draft
    tokens are broadcast so every rank verifies the same tree (`ModelDrafter.replicas`). Self-speculation always
    drafts on the target's own shards.
    """

    draft_model: str | None = None
    self_speculate: bool = False
    draft_kv: str = "full"
    draft_budget: int | None = None
    sinks: int | None = None
    window: int | None = None
    pool_kernel: int = 5
    num_draft_tokens: int = 4
    tree: str | None = None
    verifier: str = "auto"
    draft_weights: str = "auto"
    draftless: str | None = None
    ngram_min: int = DEFAULT_MIN_N
    ngram_max: int = DEFAULT_MAX_N
    policy: str = "fixed"
    acceptance_file: str | None = None
    suffix_shared: bool = False
    draft_tensor_parallel: str | int = "shard"

    def __post_init__(self) -> None:
        check_draft_placement(self.draft_tensor_parallel)
        if self.draft_tensor_parallel != "shard" and not self.draft_model:
            raise ConfigError(
                "draft_tensor_parallel places a draft model: self-speculation and draftless drafters have none"
            )
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown speculation policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.policy == "auto":
            self._check_auto()
        elif self.acceptance_file is not None:
            raise ConfigError("acceptance_file seeds the auto policy's live acceptance: it needs policy='auto'")
        elif sum((bool(self.draft_model), bool(self.self_speculate), self.draftless is not None)) != 1:
            raise ConfigError(
                "speculation needs exactly one of draft_model=..., self_speculate=True or draftless='ngram' / 'suffix'"
            )
        if self.draftless is not None:
            if self.draftless not in DRAFTLESS:
                raise ConfigError(f"unknown draftless {self.draftless!r}; choose one of {', '.join(DRAFTLESS)}")
            if self.draft_kv != "full" or self.draft_budget is not None:
                raise ConfigError("a draftless drafter reads no KV cache: drop draft_kv / draft_budget")
            if self.draft_weights != "auto":
                raise ConfigError("draft_weights applies to a draft model; a draftless drafter has no weights")
            if self.draftless == "ngram" and self.tree and not resolve_tree(self.tree).is_chain:
                raise ConfigError("the ngram drafter proposes a chain: give num_draft_tokens (γ), not a tree")
        if self.draftless == "suffix":
            self._check_suffix()
        elif self.suffix_shared:
            raise ConfigError("suffix_shared applies to draftless='suffix'")
        check_ngram_sizes(self.ngram_min, self.ngram_max)
        if self.draft_kv not in KV_POLICIES:
            raise ConfigError(f"unknown draft_kv {self.draft_kv!r}; choose one of {', '.join(KV_POLICIES)}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens (gamma) must be an integer >= 1, got {self.num_draft_tokens!r}")
        if self.num_draft_tokens > MAX_DRAFT_DEPTH:
            raise ConfigError(
                f"num_draft_tokens (gamma) must be at most {MAX_DRAFT_DEPTH}, got "
                f"{self.num_draft_tokens} (see redwood.speculation.config.MAX_DRAFT_DEPTH)"
            )
        if self.verifier not in VERIFIERS:
            raise ConfigError(f"unknown verifier {self.verifier!r}; choose one of {', '.join(VERIFIERS)}")
        for name in ("draft_budget", "window"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.sinks is not None and (not isinstance(self.sinks, int) or self.sinks < 0):
            raise ConfigError(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if self.draft_weights not in WEIGHT_CHOICES:
            raise ConfigError(
                f"unknown draft_weights {self.draft_weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}"
            )
        if self.draft_weights != "auto" and self.self_speculate:
            raise ConfigError(
                "draft_weights applies to a draft model; self-speculation drafts with the target's weights"
            )
        self.make_policy()  # validates the policy's own settings
        self.make_tree()

    def _check_auto(self) -> None:
        """policy="auto": at most one model drafter (a draft model or self-speculation) beside a draftless
        one (draftless=None → "ngram"); chains only, γ chosen per step — a tree pins a fixed plan."""
        if self.draft_model and self.self_speculate:
            raise ConfigError("the auto policy takes one model drafter: draft_model=... or self_speculate=True")
        if self.tree:
            raise ConfigError(
                "a tree pins a fixed plan: drop tree=... (the auto policy chooses chains per step) or policy='auto'"
            )
        if self.acceptance_file is not None:
            if not (self.draft_model or self.self_speculate):
                raise ConfigError("acceptance_file describes a model drafter: give draft_model=... or self_speculate")
            self.seed_rates()  # (read now: a bad file is an error before any model loads)

    def seed_rates(self) -> tuple[list[float], float] | None:
        """(α per depth, temperature) from `acceptance_file` for the model drafter, or None."""
        if self.acceptance_file is None:
            return None
        from redwood.speculation.acceptance_live import chain_rates_from_file

        return chain_rates_from_file(self.acceptance_file)

    @property
    def auto(self) -> bool:
        return self.policy == "auto"

    def _check_suffix(self) -> None:
        if not isinstance(self.suffix_shared, bool):
            raise ConfigError(f"suffix_shared must be True or False, got {self.suffix_shared!r}")
        if self.auto:
            return  # (the auto policy drafts chains of its own γ: neither num_draft_tokens nor a tree applies)
        if not self.tree and self.num_draft_tokens != SpeculativeConfig.num_draft_tokens:
            raise ConfigError(
                "the suffix drafter drafts a tree: num_draft_tokens does not apply — give tree (default "
                f"{DEFAULT_TREE.size} nodes), or tree='chain:{self.num_draft_tokens}' for a chain"
            )
        tree = resolve_tree(self.tree) if self.tree else DEFAULT_TREE
        if not tree.is_chain and self.verifier in ("sampling", "sequoia", "specinfer"):
            raise ConfigError(
                f"verifier {self.verifier!r} needs the draft distribution a tree's children were drawn from; the "
                "suffix drafter's are deterministic: use 'match' or 'topk' (any temperature), 'greedy' (temperature 0) or 'auto'"
            )

    def make_tree(self):
        """The token tree each step drafts: `tree` if given, else a chain of num_draft_tokens (the suffix
        drafter: its default tree; under the auto policy: the longest chain it may plan, which sizes the KV
        lookahead)."""
        if self.auto:
            from redwood.speculation.policy import LONGEST_GAMMA

            return Tree.chain(LONGEST_GAMMA)
        if not self.tree and self.draftless == "suffix":
            return DEFAULT_TREE
        if not self.tree:
            return Tree.chain(self.num_draft_tokens)
        tree = resolve_tree(self.tree)
        check_draft_tree(tree, f"tree {self.tree}")
        return tree

    def make_policy(self):
        return make_policy(
            self.draft_kv, budget=self.draft_budget, sinks=self.sinks, window=self.window, kernel=self.pool_kernel
        )
