"""Load a model by zoo name, Hugging Face folder or GGUF file into a `LoadedModel`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from redwood.config import ExecutionConfig, ModelConfig
from redwood.devices import DTYPES, parse_device, parse_dtype  # noqa: F401 (re-exported)
from redwood.errors import ConfigError, ModelLoadError
from redwood.models.cpu_weights import FILE_FORMAT, FILE_FORMATS, auto_formats, draft_weights_on, resolve_weights
from redwood.models.transformer import Transformer, build_model


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any  # a transformers tokenizer, or None for a folder without one
    config: ModelConfig
    source: str  # what the user asked for (zoo name or path)
    path: Path  # the file or folder actually read


def resolve_model_path(model: str | Path) -> Path:
    """A zoo name → its pulled GGUF (pulling on first use); otherwise an existing file or folder."""
    from redwood.models import registry

    name = str(model)
    if name in registry.known_models():
        return registry.resolve(name)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"no such model or path: {name!r}; give a Hugging Face folder, a .gguf file, "
            f"or a zoo name ({', '.join(registry.known_models())})"
        )
    return path


@dataclass
class ModelInfo:
    """What a model is, without its weights: enough for the checks that should run before the (slow)
    weight load — a prompt's tokens, a draft's tokenizer against the target's, the context length."""

    config: ModelConfig
    tokenizer: Any  # as LoadedModel.tokenizer
    source: str
    path: Path


def _model_file(model: str | Path) -> Path:
    """The folder or .gguf file to read (a folder holding one .gguf file → that file)."""
    path = resolve_model_path(model)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(
                f"{path} is neither a Hugging Face model folder (no config.json) nor a folder with one .gguf file"
            )
        path = ggufs[0]
    return path


def inspect_model(model: "str | Path | ModelInfo") -> ModelInfo:
    """A model's config and tokenizer, its weights left unread (a ModelInfo is returned as it is)."""
    if isinstance(model, ModelInfo):
        return model
    path = _model_file(model)
    if path.is_dir():
        from redwood.loading.hf import load_hf_tokenizer

        config, tokenizer = ModelConfig.from_hf_file(path / "config.json"), load_hf_tokenizer(path)
    else:
        from redwood.loading.gguf import load_gguf_tokenizer, read_gguf_config

        config, tokenizer = read_gguf_config(path), load_gguf_tokenizer(path)
    return ModelInfo(config=config, tokenizer=tokenizer, source=str(model), path=path)


def load_model(
    model: "str | Path | ModelInfo",
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    weights: str = "float32",
    draft: bool = False,
    execution: ExecutionConfig | None = None,
    tp=None,
) -> LoadedModel:
    """Load a model's weights; a ModelInfo (`inspect_model`) is loaded with the tokenizer it holds.
    weights: the CPU projection format (`redwood.models.cpu_weights`; "auto": "gguf" — each projection as
    its type in the file allows: 4-bit groups as int4 with the file's own grid, the rest int8 — for a GGUF
    file on the CPU, int4 when `draft` (a draft model's auto), else float32; a model whose shapes the format
    cannot pack takes the next of int4 → int8 → float32 under "auto"). A GGUF file is packed tensor by
    tensor as it is read (the float model never exists whole); a Hugging Face folder is loaded, then packed.
    execution: how its forwards run (`ExecutionConfig`; None: the defaults) — the backend for the device and
    weights, which prepares its weights (on CUDA: one q/k/v and one gate/up matmul per layer).
    tp: a tensor-parallel rank's group (`redwood.parallel.TPGroup`): only this rank's shard is read
    (`models.shard`; float weights only: weights "auto" means "float32" here, a packed format is a ConfigError)."""
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    info = model if isinstance(model, ModelInfo) else None
    path = info.path if info is not None else _model_file(model)
    if info is not None:
        model = info.source
    shard = None
    if tp is not None:
        shard = _shard_plan(tp, weights, path, info.config if info is not None else None)
        kind = "float32"
    else:
        kind = _cpu_format(weights, dev, path, draft, info.config if info is not None else None)
    if path.is_dir():
        from redwood.loading.hf import load_hf_tokenizer, read_hf_folder

        config, state = read_hf_folder(path, shard)
        net = build_model(config, state, torch_dtype, dev, tp=tp)
        tokenizer = info.tokenizer if info is not None else load_hf_tokenizer(path)
    else:
        from redwood.loading.gguf import load_gguf_tokenizer, read_gguf
        from redwood.models.cpu_weights import packer

        # (cast first: the same packed values as packing the loaded `dtype` model)
        pack = None if kind == "float32" else packer(kind, cast=torch_dtype)
        g = read_gguf(path, transform=pack if shard is None else shard.take)  # (sharded: each tensor cut as read)
        config = g.config
        net = build_model(config, g.tensors, torch_dtype, dev, rope_freqs=g.rope_freqs, tp=tp)
        del g
        tokenizer = info.tokenizer if info is not None else load_gguf_tokenizer(path)
    net.quantize_cpu(kind)
    net.set_execution(execution)
    return LoadedModel(model=net, tokenizer=tokenizer, config=config, source=str(model), path=path)


def load_draft_model(
    model: "str | Path | ModelInfo",
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    draft_weights: str = "auto",
    execution: ExecutionConfig | None = None,
    tp=None,
) -> LoadedModel:
    """Load a draft model in the weight format `draft_weights` (`SpeculativeConfig.draft_weights`; what it
    means on `device`: `cpu_weights.draft_weights_on`): a CPU format on the CPU; on CUDA the model's dtype,
    with int8 copies for its one-token forwards under "int8" (`Transformer.quantize_skinny`)."""
    weights, skinny = draft_weights_on(draft_weights, parse_device(device))
    if tp is not None and draft_weights == "auto":
        weights = "float32"  # (tensor parallelism shards float weights only)
    loaded = load_model(model, dtype=dtype, device=device, weights=weights, draft=True, execution=execution, tp=tp)
    if skinny:
        loaded.model.quantize_skinny(skinny)
    return loaded


def _read_config(path: Path) -> ModelConfig:
    if path.is_dir():
        return ModelConfig.from_hf_file(path / "config.json")
    from redwood.loading.gguf import read_gguf_config

    return read_gguf_config(path)


def _shard_plan(tp, weights: str, path: Path, config: ModelConfig | None):
    """This rank's `ShardPlan` for the model at `path`, its weight format checked first: tensor parallelism
    shards float weights (`backends.TP_FORMATS`); "auto" means "float32" under it."""
    from redwood.models.backends import TP_FORMATS
    from redwood.models.shard import ShardPlan

    if weights not in ("auto", "float32"):
        raise ConfigError(
            f"weights={weights!r} cannot be sharded: tensor parallelism runs {TP_FORMATS} (the packed CPU formats "
            "and their fused C++ layer are one process's)"
        )
    return ShardPlan(tp.rank, tp.world, config if config is not None else _read_config(path))


def _cpu_format(weights: str, device: torch.device, path: Path, draft: bool, config: ModelConfig | None) -> str:
    """The CPU format a model at `path` gets (`resolve_weights`), checked against its projections' shapes
    before any weight is read: "auto" falls back (`auto_formats`), an explicit format that does not fit
    is a ConfigError."""
    kind = resolve_weights(weights, device, path, draft=draft)
    if kind == "float32":
        return kind
    if config is None:
        if path.is_dir():
            config = ModelConfig.from_hf_file(path / "config.json")
        else:
            from redwood.loading.gguf import read_gguf_config

            config = read_gguf_config(path)
    with torch.device("meta"):
        shapes = Transformer(config)  # (no memory: only the projections' shapes are read)
    if weights == "auto":
        return next(k for k in auto_formats(kind) if k == "float32" or shapes.cpu_format_misfit(k) is None)
    if kind in FILE_FORMATS:  # (per projection as the file's types allow: int4 / kquant, else int8 / w8a8 / bf16)
        why = shapes.cpu_format_misfit(kind) if kind != FILE_FORMAT else None  # (gguf fits any shape)
        if why:
            raise ConfigError(f"weights={kind!r} cannot be used: {why}")
        return kind
    why = shapes.cpu_format_misfit(kind)
    if why:
        raise ConfigError(f"weights={kind!r} does not fit this model: {why}")
    return kind
