"""Execution backends: how a `Transformer`'s forward runs on a device, chosen once at load (`select`, from the
device, the weights and an `ExecutionConfig`; `Transformer.set_execution`). Every backend computes the model's one
forward (embed → layers → norm → head) and each prepares its own weights (`prepare`):

| backend | where | its paths, by forward shape |
|---|---|---|
| `reference.ReferenceBackend` | float weights on the CPU; `kernels="off"` | plain PyTorch layers |
| `cpu_packed.CpuPackedBackend` | CPU packed weights (`Transformer.quantize_cpu`) | the C++ layer (`models.cpu_fused`: kquant kinds, short forwards without a compressed view), the packed layers (fewer rows than the gemm paths take), else plain |
| `cuda.CudaBackend` | CUDA (`kernels="on"`: Triton's interpreter too) | the megakernel (one row × one token), the skinny kernels (by rows), fused kernels, else plain |

`attention_kernel` picks each forward's attention (reference SDPA, the Triton decode kernel, the flash prefill).
"""

from __future__ import annotations

import torch

from redwood.config import ExecutionConfig
from redwood.errors import ConfigError

# Forwards with more new tokens than this (prefill) attend through the flash prefill kernel on CUDA
# (attention.triton_prefill; ExecutionConfig(prefill_kernel=False) turns it off) or the reference path; the decode
# kernel packs all new tokens of a row into one pass over the KV, which pays for decode, verify and tree steps.
FAST_ATTENTION_MAX_NEW = 256


def select(model, execution: ExecutionConfig):
    """The backend for `model` (its device and weights) under `execution`, not yet prepared."""
    from redwood.models.backends.cpu_packed import CpuPackedBackend
    from redwood.models.backends.cuda import CudaBackend
    from redwood.models.backends.reference import ReferenceBackend

    if getattr(model, "tp", None) is not None:
        return _tensor_parallel(model, execution)
    if model.weights != "float32":
        backend = CpuPackedBackend(execution)
    elif execution.kernels == "on" or (execution.kernels == "auto" and model.device.type == "cuda"):
        backend = CudaBackend(execution)
    else:
        backend = ReferenceBackend(execution)
    if execution.megakernel == "on" and not isinstance(backend, CudaBackend):
        from redwood.kernels import megakernel

        why = megakernel.misfit(model) or f"the {backend.name} backend runs this model"
        raise ConfigError(f"the one-token megakernel cannot run this model: {why}")
    return backend


def _tensor_parallel(model, execution: ExecutionConfig):
    """A tensor-parallel shard's backend: the plain layers, whose o_proj / down_proj outputs go through the
    all-reduce before the residual add. A packed CPU model's projections run their own kernels there
    (`PackedLinear` picks the kernel or the gemm path by rows, each row exact as TP=1's). What fuses o / down
    with the residual steps aside: the C++ layer (`cpu_fused`), the CUDA backend's fused kernels and the
    megakernel (a ConfigError where one is asked for)."""
    from redwood.models.backends.reference import ReferenceBackend

    if execution.megakernel == "on" or execution.kernels == "on":
        raise ConfigError(
            "tensor parallelism runs the plain layers (the megakernel and the fused CUDA kernels add o_proj / "
            "down_proj into the residual before the all-reduce could): leave megakernel and kernels at 'auto' or 'off'"
        )
    return ReferenceBackend(execution)


def prefill_kernel(model) -> bool:
    """Whether long plain prefill forwards (more than FAST_ATTENTION_MAX_NEW new tokens, no view, observer, pending
    tokens or new-token mask) attend through the flash prefill kernel (attention.triton_prefill): on CUDA, for a
    dtype and head dim the kernel takes, unless the execution pins the reference attention or turns it off. Those
    forwards then materialize no scores, so the prefill loops (engine.prefill) drop their score budget."""
    ex = model.execution
    if ex.attention == "reference" or not ex.prefill_kernel:
        return False
    from redwood.attention import triton_prefill

    return triton_prefill.available(model.device, model.dtype, model.config.head_dim)


def attention_kernel(
    model, input_ids: torch.Tensor, T: int, observer, view=None, pending: int = 0, new_mask=None
) -> str:
    """The attention of a forward of T new tokens a row (`AttentionMetadata.backend`): "triton_prefill",
    "triton" or "reference"."""
    if T > FAST_ATTENTION_MAX_NEW:
        plain = observer is None and view is None and pending == 0 and new_mask is None
        if plain and prefill_kernel(model):
            return "triton_prefill"
        return "reference"  # (SnapKV's observer needs the scores; views, trees, drafts: not in the kernel)
    attention = model.execution.attention
    if attention == "reference" or observer is not None:
        return "reference"
    if input_ids.device.type == "cuda":
        from redwood.attention import triton_decode

        if triton_decode.available(input_ids.device, model.dtype, model.config.head_dim):
            return "triton"
    if attention == "triton":
        raise ConfigError("the Triton attention kernel needs a CUDA device and an importable triton")
    return "reference"
