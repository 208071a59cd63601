"""Loaded models: the target, its tokenizer, the drafter and its tree — what several engines can share.

An Engine owns its KV cache (sized when it is built) but not its weights: tools that compare two engines
over one target (`generate --compare-ar`, `bench speculative`, `bench throughput`) load the models once and
build an engine per configuration, each with its own memory share (`EngineConfig.kv_cache_memory` /
`kv_memory_fraction`).

`LoadedModels.load` reads a model (and a draft model, or sets up self-speculation) from a zoo name, folder
or GGUF file — tokenizers and configs first, so what they refuse is refused before minutes of weight
loading; `LoadedModels.of` wraps models a caller already holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from redwood.config import ExecutionConfig
from redwood.engine.tokenization import check_max_model_len
from redwood.errors import ConfigError
from redwood.loading import ModelInfo, inspect_model, load_draft_model, load_model, parse_device, parse_dtype
from redwood.models.cpu_weights import check_weights, draft_weights_on
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.trees import Tree

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"  # shares the target's tokenizer


@dataclass
class LoadedModels:
    """model: the target `Transformer`; tokenizer (None: token ids only); name / path: where it came from;
    drafter + tree (both or neither: speculation); verifier (`SpeculativeConfig.verifier`); draft_name:
    how reports name the drafter; speculative: the config it was made from (None when built from parts);
    thread_policy: the CPU's per-step thread choice (`engine.threads.AdaptiveThreads`), or None;
    auto_drafters: under the automatic policy (`SpeculativeConfig(policy="auto")`), every drafter it chooses
    from (`drafter` is the one with a KV cache or policy of its own, if any, else the draftless one), else None.
    tp: under tensor parallelism this rank's group (`redwood.parallel.TPGroup`; the models hold its shards), else
    None; such models serve one engine at a time (`engine.tp_worker`: every rank replays rank 0's calls to it;
    `Engine.rebuild` replaces it on every rank)."""

    model: torch.nn.Module
    tokenizer: object | None = None
    name: str = "model"
    path: Path | None = None
    drafter: object | None = None
    tree: Tree | None = None
    verifier: str = "auto"
    draft_name: str | None = None
    speculative: SpeculativeConfig | None = None
    thread_policy: object | None = None
    auto_drafters: list | None = None
    tp: object | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tree, int):
            self.tree = Tree.chain(self.tree)
        if (self.drafter is None) != (self.tree is None):
            raise ConfigError("a drafter needs a tree (Tree.chain(γ) for a chain) and a tree needs a drafter")
        if self.draft_name is None and self.drafter is not None:
            self.draft_name = type(self.drafter).__name__
        if self.drafter is not None and getattr(self.drafter, "deterministic_children", False):
            from redwood.engine.decode import resolve_verifier

            resolve_verifier(self.verifier, self.tree, True, deterministic=True)  # (a walk that needs q: refused now)

    @property
    def config(self):
        return self.model.config

    def without_drafters(self) -> "LoadedModels":
        """The same models for plain decoding: no drafter, tree or automatic policy (they stay loaded here)."""
        return dataclasses.replace(self, drafter=None, tree=None, draft_name=None, auto_drafters=None, speculative=None)

    @classmethod
    def of(
        cls, model, tokenizer=None, *, drafter=None, tree=None, verifier: str = "auto", name: str = "model"
    ) -> "LoadedModels":
        """Models the caller already holds (benchmarks, tests: nothing is loaded again)."""
        return cls(model, tokenizer, name, None, drafter, tree, verifier)

    @classmethod
    def load(
        cls,
        model: str | Path | ModelInfo = DEFAULT_MODEL,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        speculative: SpeculativeConfig | None = None,
        offload: bool = False,
        offload_prefetch: int = 2,
        threads: int | None = None,
        weights: str = "auto",
        max_model_len: int | None = None,
        execution: ExecutionConfig | None = None,
        tp=None,
    ) -> "LoadedModels":
        """Load a target (and its drafter); the arguments as `redwood.LLM`'s (max_model_len: checked against
        the model's context before the weights load; execution: how both models' forwards run). A draft
        model loads in `speculative.draft_weights`. tp: a tensor-parallel rank's group: this rank's shards of
        the target and of a draft model are loaded (no offloading) — the draft placed as
        `speculative.draft_tensor_parallel` says (`draft_group`: over the same ranks, whole, or over ranks 0 … K−1,
        none of it on the others)."""
        from redwood.engine.threads import adaptive_threads, apply_threads, check_threads

        if execution is not None and not isinstance(execution, ExecutionConfig):
            raise ConfigError(f"execution must be an ExecutionConfig, got {type(execution).__name__}")
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
        check_threads(threads)
        if offload:
            from redwood.models.offload import check_prefetch

            check_prefetch(offload_prefetch)
        dev = parse_device(device)  # (bad values: an error before anything loads)
        parse_dtype(dtype)
        check_weights(weights, dev, offload)
        if speculative is not None and speculative.draft_model:
            draft_weights_on(speculative.draft_weights, dev)  # (a CPU format on CUDA: an error now)
        # Tokenizers and configs first: what they can refuse is refused before minutes of weight loading.
        info = inspect_model(model)
        check_max_model_len(max_model_len, info.config.max_position_embeddings)
        if tp is not None:
            check_tensor_parallel(tp.world, info.config, offload)
            device = tp.device  # (on CUDA: this rank's GPU)
        draft_info = None
        if speculative is not None and speculative.draft_model:
            from redwood.speculation.drafters import check_compatible

            draft_info = inspect_model(speculative.draft_model)
            check_compatible(info.tokenizer, draft_info.tokenizer, info.config.vocab_size, draft_info.config.vocab_size)
            if tp is not None:
                check_draft_tensor_parallel(speculative, draft_info, tp.world, tp.device)
        if threads is not None or dev.type == "cpu":
            apply_threads(threads)  # before loading: dequantizing the weights runs on these threads too
        loaded = load_model(
            info,
            dtype=dtype,
            device="cpu" if offload else device,
            weights="float32" if offload else weights,
            execution=execution,
            tp=tp,
        )
        if offload:  # loaded on the host: the layers stay there, the rest moves to the device
            from redwood.models.offload import offload_layers

            offload_layers(loaded.model, device, prefetch=offload_prefetch)
        self = cls(
            loaded.model,
            loaded.tokenizer,
            loaded.source,
            loaded.path,
            verifier="auto" if speculative is None else speculative.verifier,
            speculative=speculative,
            tp=tp,
        )
        draft_tp = tp if draft_info is None or tp is None else draft_group(tp, speculative.draft_tensor_parallel)
        if speculative is not None and speculative.auto:
            self.tree = speculative.make_tree()
            self.auto_drafters = _auto_drafters(
                speculative, loaded.model, dtype, device, draft_info, execution, draft_tp
            )
            self.drafter = self.auto_drafters[0]
            self.draft_name = "auto: " + ", ".join(d.name for d in self.auto_drafters)
        elif speculative is not None:
            self.tree = speculative.make_tree()
            self.drafter, self.draft_name = _make_drafter(
                speculative, loaded.model, dtype, device, draft_info, execution, draft_tp
            )
        if draft_info is not None and tp is not None and speculative.draft_tensor_parallel != "shard":
            for d in self.auto_drafters or [self.drafter]:
                if d.standalone:
                    d.replicas = tp  # (rank 0's proposal on every rank)
        if dev.type == "cpu" and not offload and self.thread_exact_decode():
            # (None where the count is the user's or fixed, or the execution config turns it off)
            self.thread_policy = adaptive_threads(threads, enabled=execution is None or execution.adaptive_threads)
        return self

    def with_speculation(
        self, spec: SpeculativeConfig | None, draft_model=None, draft_source: str | None = None
    ) -> "LoadedModels":
        """These models (target, tokenizer, thread policy) with the drafter(s) `spec` names instead — over a draft
        model already loaded (`draft_model`, the one `spec.draft_model` names): tools comparing configurations
        build each without loading anything again. None: no speculation."""
        out = self._with_speculation(spec, draft_model, draft_source)
        if out.thread_policy is not None and not out.thread_exact_decode():
            out.thread_policy = None  # (a drafter whose steps round differently at another thread count)
        return out

    def _with_speculation(self, spec, draft_model, draft_source) -> "LoadedModels":
        from dataclasses import replace

        if spec is None:
            return replace(
                self, drafter=None, tree=None, verifier="auto", draft_name=None, speculative=None, auto_drafters=None
            )
        if spec.auto:
            drafters = auto_drafters_for(spec, self.model, draft_model, draft_source)
            name = "auto: " + ", ".join(d.name for d in drafters)
            return replace(
                self,
                drafter=drafters[0],
                tree=spec.make_tree(),
                verifier=spec.verifier,
                draft_name=name,
                speculative=spec,
                auto_drafters=drafters,
            )
        drafter, name = drafter_for(spec, self.model, draft_model, draft_source)
        return replace(
            self,
            drafter=drafter,
            tree=spec.make_tree(),
            verifier=spec.verifier,
            draft_name=name,
            speculative=spec,
            auto_drafters=None,
        )

    def thread_exact_decode(self) -> bool:
        """Whether a decode step computes the same bits at any thread count: every forward it runs goes through
        the C++ layers (kquant-kind models; a standalone draft reading its full cache)."""
        from redwood.kv.policies import FullPolicy
        from redwood.models import cpu_fused

        if self.tp is not None:
            return False  # (the C++ layers step aside under tensor parallelism: `backends._tensor_parallel`)
        for d in self.auto_drafters or ([] if self.drafter is None else [self.drafter]):
            if d.needs_history:
                continue  # draftless: no draft forward
            if d.own_model is None or not isinstance(d.policy, FullPolicy) or not cpu_fused.model_takes(d.own_model):
                return False
        return cpu_fused.model_takes(self.model)


def _auto_drafters(spec: SpeculativeConfig, target, dtype, device, draft_info, execution, tp=None) -> list:
    """The automatic policy's drafters, the draft model (if configured) loaded from `draft_info` (this rank's
    shard under `tp`)."""
    draft = _load_draft(spec, dtype, device, draft_info, execution, tp)
    return auto_drafters_for(spec, target, *draft)


def auto_drafters_for(spec: SpeculativeConfig, target, draft_model=None, draft_source: str | None = None) -> list:
    """The automatic policy's drafters over loaded models: the model drafter (if configured) first, then the
    draftless one; each named (`.name`) as reports show it."""
    from dataclasses import replace

    out = []
    if spec.draft_model or spec.self_speculate:
        model_spec = replace(spec, policy="fixed", draftless=None, acceptance_file=None, suffix_shared=False)
        drafter, drafter.name = drafter_for(model_spec, target, draft_model, draft_source)
        out.append(drafter)
    draftless_spec = SpeculativeConfig(
        draftless=spec.draftless or "ngram",
        ngram_min=spec.ngram_min,
        ngram_max=spec.ngram_max,
        suffix_shared=spec.suffix_shared,
    )
    drafter, drafter.name = drafter_for(draftless_spec, target)
    out.append(drafter)
    return out


def _load_draft(spec: SpeculativeConfig, dtype, device, draft_info, execution, tp=None) -> tuple:
    """(the draft model, its source name) when `spec` names one — loaded from `draft_info` (`inspect_model`: its
    tokenizer already checked against the target's) in the format `spec.draft_weights`, this rank's shard under
    `tp`; a `RemoteDraft` on a rank outside the draft's (`tp` a `NotMember`) — else (None, None)."""
    if not spec.draft_model:
        return None, None
    if tp is not None and not tp.member:
        from redwood.speculation.drafters import RemoteDraft

        return RemoteDraft(draft_info.config.vocab_size), draft_info.source
    draft = load_draft_model(
        draft_info, dtype=dtype, device=device, draft_weights=spec.draft_weights, execution=execution, tp=tp
    )
    return draft.model, draft.source


def _make_drafter(
    spec: SpeculativeConfig, target, dtype, device, draft_info, execution: ExecutionConfig | None = None, tp=None
):
    """The drafter `spec` asks for and its name, loading its draft model (this rank's shard under `tp`) if it has
    one."""
    return drafter_for(spec, target, *_load_draft(spec, dtype, device, draft_info, execution, tp))


def draft_group(tp, placement: str | int):
    """This rank's group for a draft model's collectives under tensor parallelism (`SpeculativeConfig.
    draft_tensor_parallel`): `tp` itself ("shard"), None (loaded whole: "replicate", and 1 on rank 0), a sub-group
    of ranks 0 … K−1 (K > 1), or a `NotMember` on a rank outside them. Every rank calls it, in the same order
    (each rank makes every sub-group, its own or not)."""
    from redwood.parallel.group import NotMember

    if placement == "shard":
        return tp
    if placement == "replicate":
        return None
    if placement == 1:
        return None if tp.rank == 0 else NotMember(1)
    return tp.subgroup(placement)


def check_draft_tensor_parallel(spec: SpeculativeConfig, draft_info: ModelInfo, world: int, device) -> None:
    """What placing `spec`'s draft model over `world` tensor-parallel ranks refuses, as a one-line ConfigError
    before any rank starts: a number of ranks that is no strict subset, a draft whose shapes or weight format do
    not split over the ranks it is sharded over."""
    from redwood.loading import check_sharded_format
    from redwood.speculation.config import check_draft_placement

    placement = spec.draft_tensor_parallel
    check_draft_placement(placement, world)
    shards = world if placement == "shard" else 1 if placement == "replicate" else placement
    if shards == 1:
        return  # (whole wherever it loads)
    try:
        check_tensor_parallel(shards, draft_info.config, False)
        check_sharded_format(draft_info, spec.draft_weights, device, shards, draft=True)
    except ConfigError as e:
        if shards == world:
            raise
        raise ConfigError(f"the draft model cannot be sharded over draft_tensor_parallel={shards} ranks: {e}") from None


def check_tensor_parallel(world: int, config, offload: bool) -> None:
    """What tensor parallelism refuses, as a one-line ConfigError before any rank starts: shapes that do not
    split over `world` ranks, offloading. (Weight formats: `loading.check_sharded_format`.)"""
    from redwood.models.shard import check_shardable

    check_shardable(config, world)
    if offload:
        raise ConfigError("offloading streams one process's layers: it does not run under tensor parallelism")


def drafter_for(spec: SpeculativeConfig, target, draft_model=None, draft_source: str | None = None) -> tuple:
    """The drafter `spec` asks for over loaded models (`draft_model`: the draft model `spec.draft_model` names,
    already loaded) and its name."""
    from redwood.speculation.drafters import ModelDrafter, RemoteDraft, SelfDrafter
    from redwood.speculation.draftless import NgramDrafter
    from redwood.speculation.suffix import SuffixDrafter

    policy = spec.make_policy()
    if spec.draftless is not None:
        vocab, sizes = target.config.vocab_size, (spec.ngram_min, spec.ngram_max)
        if spec.draftless == "suffix":
            drafter = SuffixDrafter(vocab, *sizes, shared=spec.suffix_shared)
        else:
            drafter = NgramDrafter(vocab, *sizes)
        return drafter, drafter.describe()
    if spec.self_speculate:
        return SelfDrafter(target, policy), f"self ({policy.describe()})"
    if draft_model is None:
        raise ConfigError(f"the draft model {spec.draft_model!r} is not loaded")
    quant = ""
    if not isinstance(draft_model, RemoteDraft):  # (a draft model on other tensor-parallel ranks has no weights here)
        skinny = "int8" if draft_model.skinny_int8 is not None else None  # (CUDA: int8 one-token forwards)
        packed = draft_model.weights if draft_model.weights != "float32" else None
        quant = "".join(f", {q} weights" for q in (skinny, packed) if q)
    name = f"{draft_source or spec.draft_model} ({policy.describe()}{quant})"
    return ModelDrafter(draft_model, policy, target.config.vocab_size), name
