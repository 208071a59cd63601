"""Load a Hugging Face model folder: config.json, safetensors weights (one file or sharded), tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from redwood.config import ModelConfig
from redwood.errors import ModelLoadError
from redwood.progress import Progress


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the shards named by model.safetensors.index.json, or *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({folder / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise ModelLoadError(f"{folder}: shards named in the index are missing: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        has_bin = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
        raise ModelLoadError(
            f"no *.safetensors weights in {folder}"
            + (" (only PyTorch .bin/.pt checkpoints found; convert them to safetensors)" if has_bin else "")
        )
    return files


def read_hf_folder(folder: str | Path, shard=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named weights of a model folder; with `shard` (a `models.shard.ShardPlan`) only this
    tensor-parallel rank's pieces, each read as a slice of the file (the whole tensor is never read)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = ModelConfig.from_hf_file(folder / "config.json")
    state: dict[str, torch.Tensor] = {}
    files = safetensors_files(folder)
    with Progress(total=sum(f.stat().st_size for f in files), desc=f"loading {folder.name}", unit="B") as bar:
        for f in files:
            try:
                state.update(load_file(str(f)) if shard is None else _read_shard(f, shard))
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"cannot read {f}: {e} (truncated or corrupt? re-download it)") from None
            bar.update(f.stat().st_size)
    return config, state


def _read_shard(path: Path, shard) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as `shard` cuts them (`ShardPlan.slice_of`): rows or columns read
    straight from the mapped file."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            where = shard.slice_of(name)
            if shard.zero_bias(name):
                out[name] = torch.zeros_like(f.get_tensor(name))  # (a bias: [H])
            elif where is None:
                out[name] = f.get_tensor(name)
            else:
                dim, start, stop = where
                part = f.get_slice(name)
                out[name] = (part[start:stop] if dim == 0 else part[:, start:stop]).contiguous()
    return out


def load_hf_tokenizer(folder: str | Path):
    """The folder's tokenizer via transformers, or None when the folder has no tokenizer files."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from None
