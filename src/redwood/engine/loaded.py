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
    from (`drafter` is the one with a KV cache or policy of its own, if any, else the draftless one), else None."""

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

    def __post_init__(self) -> None:
        if isinstance(self.tree, int):
            self.tree = Tree.chain(self.tree)
        if (self.drafter is None) != (self.tree is None):
            raise ConfigError("a drafter needs a tree (Tree.chain(γ) for a chain) and a tree needs a drafter")
        if self.draft_name is None and self.drafter is not None:
            self.draft_name = type(self.drafter).__name__

    @property
    def config(self):
        return self.model.config

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
    ) -> "LoadedModels":
        """Load a target (and its drafter); the arguments as `redwood.LLM`'s (max_model_len: checked against
        the model's context before the weights load; execution: how both models' forwards run). A draft
        model loads in `speculative.draft_weights`."""
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
        draft_info = None
        if speculative is not None and speculative.draft_model:
            from redwood.speculation.drafters import check_compatible

            draft_info = inspect_model(speculative.draft_model)
            check_compatible(info.tokenizer, draft_info.tokenizer, info.config.vocab_size, draft_info.config.vocab_size)
        if threads is not None or dev.type == "cpu":
            apply_threads(threads)  # before loading: dequantizing the weights runs on these threads too
        loaded = load_model(
            info,
            dtype=dtype,
            device="cpu" if offload else device,
            weights="float32" if offload else weights,
            execution=execution,
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
        )
        if speculative is not None and speculative.auto:
            self.tree = speculative.make_tree()
            self.auto_drafters = _auto_drafters(speculative, loaded.model, dtype, device, draft_info, execution)
            self.drafter = self.auto_drafters[0]
            self.draft_name = "auto: " + ", ".join(_describe(d) for d in self.auto_drafters)
        elif speculative is not None:
            self.tree = speculative.make_tree()
            self.drafter, self.draft_name = _make_drafter(
                speculative, loaded.model, dtype, device, draft_info, execution
            )
        if dev.type == "cpu" and not offload and self.thread_exact_decode():
            # (None where the count is the user's or fixed, or the execution config turns it off)
            self.thread_policy = adaptive_threads(threads, enabled=execution is None or execution.adaptive_threads)
        return self

    def thread_exact_decode(self) -> bool:
        """Whether a decode step computes the same bits at any thread count: every forward it runs goes through
        the C++ layers (kquant-kind models; a standalone draft reading its full cache)."""
        from redwood.kv.policies import FullPolicy
        from redwood.models import cpu_fused

        for d in self.auto_drafters or ([] if self.drafter is None else [self.drafter]):
            if d.needs_history:
                continue  # draftless: no draft forward
            if d.own_model is None or not isinstance(d.policy, FullPolicy) or not cpu_fused.model_takes(d.own_model):
                return False
        return cpu_fused.model_takes(self.model)


def _describe(drafter) -> str:
    return getattr(drafter, "name", None) or drafter.describe()


def _auto_drafters(spec: SpeculativeConfig, target, dtype, device, draft_info, execution) -> list:
    """The automatic policy's drafters: the model drafter (if configured) first, then the draftless one."""
    from dataclasses import replace

    out = []
    if spec.draft_model or spec.self_speculate:
        model_spec = replace(spec, policy="fixed", draftless=None, acceptance_file=None)
        drafter, name = _make_drafter(model_spec, target, dtype, device, draft_info, execution)
        drafter.name = name
        out.append(drafter)
    draftless_spec = SpeculativeConfig(
        draftless=spec.draftless or "ngram", ngram_min=spec.ngram_min, ngram_max=spec.ngram_max
    )
    drafter, name = _make_drafter(draftless_spec, target, dtype, device, None, execution)
    drafter.name = name
    out.append(drafter)
    return out


def _make_drafter(spec: SpeculativeConfig, target, dtype, device, draft_info, execution: ExecutionConfig | None = None):
    """The drafter `spec` asks for and its name; a draft model loads from `draft_info` (`inspect_model`:
    its tokenizer already checked against the target's) in the format `spec.draft_weights`."""
    from redwood.speculation.drafters import ModelDrafter, SelfDrafter
    from redwood.speculation.draftless import NgramDrafter

    policy = spec.make_policy()
    if spec.draftless == "ngram":
        drafter = NgramDrafter(target.config.vocab_size, spec.ngram_min, spec.ngram_max)
        return drafter, drafter.describe()
    if spec.self_speculate:
        return SelfDrafter(target, policy), f"self ({policy.describe()})"
    draft = load_draft_model(
        draft_info, dtype=dtype, device=device, draft_weights=spec.draft_weights, execution=execution
    )
    skinny = "int8" if draft.model.skinny_int8 is not None else None  # (CUDA: int8 one-token forwards)
    packed = draft.model.weights if draft.model.weights != "float32" else None
    quant = "".join(f", {q} weights" for q in (skinny, packed) if q)
    name = f"{draft.source} ({policy.describe()}{quant})"
    return ModelDrafter(draft.model, policy, target.config.vocab_size), name
