"""Devices and dtypes as users name them ("cpu", "cuda:1", "bfloat16"), parsed once with a clear error."""

from __future__ import annotations

import torch

from redwood.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def free_memory(device: torch.device) -> None:
    """Let dropped objects' memory go now (a closed engine's KV pool), so the next one sizes its own from memory
    that is really free: a garbage collection, and on CUDA the caching allocator's unused blocks returned."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; choose one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}; use 'cpu' or 'cuda' (or 'cuda:N')") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {device!r}; use 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but no CUDA GPU is available (use --device cpu)")
    return dev
