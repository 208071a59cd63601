"""Load a model by zoo name, Hugging Face folder or GGUF file into a `LoadedModel`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from redwood.config import ExecutionConfig, ModelConfig
from redwood.devices import DTYPES, parse_device, parse_dtype  # noqa: F401 (re-exported)
from redwood.errors import ConfigError, ModelLoadError
from redwood.models.cpu_weights import (
    FILE_FORMAT,
    FILE_FORMATS,
    KQUANT,
    WEIGHT_FORMATS,
    auto_formats,
    draft_weights_on,
    resolve_weights,
)
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
    (`models.shard`), its formats checked against the shard's shapes (kquant: the row-parallel cuts on whole
    super-blocks, else a ConfigError naming the formats that shard)."""
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    info = model if isinstance(model, ModelInfo) else None
    path = info.path if info is not None else _model_file(model)
    if info is not None:
        model = info.source
    config = info.config if info is not None else None
    shard = None
    if tp is not None:
        from redwood.models.shard import ShardPlan

        shard = ShardPlan(tp.rank, tp.world, config if config is not None else _read_config(path))
    kind = _cpu_format(weights, dev, path, draft, config, shard)
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
        if shard is not None:  # (each tensor cut as it is read, then packed: no rank reads a whole projection)
            from redwood.models.shard import ShardTransform

            pack = ShardTransform(shard, pack)
        g = read_gguf(path, transform=pack)
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
    loaded = load_model(model, dtype=dtype, device=device, weights=weights, draft=True, execution=execution, tp=tp)
    if skinny:
        loaded.model.quantize_skinny(skinny)
    return loaded


def _read_config(path: Path) -> ModelConfig:
    if path.is_dir():
        return ModelConfig.from_hf_file(path / "config.json")
    from redwood.loading.gguf import read_gguf_config

    return read_gguf_config(path)


def check_sharded_format(info: ModelInfo, weights: str, device, world: int, draft: bool = False) -> str:
    """The CPU format the model `info` gets under `world` tensor-parallel ranks (every rank's pieces have the
    same shapes), or the one-line ConfigError that names the formats that shard — before any rank starts."""
    from redwood.models.shard import ShardPlan

    if draft:
        weights = draft_weights_on(weights, parse_device(device))[0]
    shard = ShardPlan(0, world, info.config)
    return _cpu_format(weights, parse_device(device), info.path, draft, info.config, shard)


def _kquant_cut_misfit(path: Path, shard) -> str | None:
    """Why kquant cannot keep the GGUF file's blocks on `shard`'s rank: a Q4_K / Q6_K / Q8_0 / Q5_0 row-parallel
    projection (o_proj, down_proj: each rank holds a range of every row's columns) whose range is not whole file
    blocks (256 values; Q8_0 / Q5_0: 32); None when every such cut falls on their boundaries (column-parallel rows
    cut anywhere)."""
    from redwood.cpu_kernels.kquant import FILE_BLOCK, TYPES
    from redwood.loading.gguf import hf_name, read_gguf_header

    for name, t in read_gguf_header(path).tensors.items():
        target = hf_name(name)
        where = None if target is None or t.type_name not in TYPES else shard.slice_of(target)
        block = FILE_BLOCK.get(t.type_name, 0)
        if where is not None and where[0] == 1 and (where[1] % block or where[2] % block):
            kind = "super-blocks" if block == 256 else "blocks"
            return (
                f"{target} ({t.type_name}) splits its {t.shape[1]} inputs into {where[2] - where[1]} a rank, "
                f"inside its {block}-value {kind}"
            )
    return None


def _cpu_format(
    weights: str, device: torch.device, path: Path, draft: bool, config: ModelConfig | None, shard=None
) -> str:
    """The CPU format a model at `path` gets (`resolve_weights`), checked against its projections' shapes
    before any weight is read: "auto" falls back (`auto_formats`), an explicit format that does not fit
    is a ConfigError. shard: a tensor-parallel rank's `ShardPlan`: its pieces' shapes are checked."""
    kind = resolve_weights(weights, device, path, draft=draft)
    if kind == "float32":
        return kind
    if config is None:
        config = _read_config(path)
    with torch.device("meta"):  # (no memory: only the projections' shapes are read)
        shapes = Transformer(config if shard is None else shard.local_config)

    def misfit(k: str) -> str | None:
        if k == KQUANT and shard is not None and (why := _kquant_cut_misfit(path, shard)):
            return why
        return shapes.cpu_format_misfit(k) if k != FILE_FORMAT else None  # (gguf fits any shape)

    if weights == "auto":
        return next(k for k in auto_formats(kind) if k == "float32" or misfit(k) is None)
    if shard is not None and (why := misfit(kind)):
        fits = [k for k in ("float32", *WEIGHT_FORMATS, *FILE_FORMATS) if k == "float32" or misfit(k) is None]
        fits = [k for k in fits if k not in FILE_FORMATS or str(path).endswith(".gguf")]
        raise ConfigError(
            f"weights={kind!r} cannot be sharded over {shard.world} ranks: {why}; formats that shard here: "
            + ", ".join(dict.fromkeys(fits))
        )
    if kind in FILE_FORMATS:  # (per projection as the file's types allow: int4 / kquant, else int8 / w8a8 / bf16)
        why = misfit(kind)
        if why:
            raise ConfigError(f"weights={kind!r} cannot be used: {why}")
        return kind
    why = shapes.cpu_format_misfit(kind)
    if why:
        raise ConfigError(f"weights={kind!r} does not fit this model: {why}")
    return kind
