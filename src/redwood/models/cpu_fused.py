"""A kquant model's decoder layers as one C++ call each on the CPU (redwood.cpu_kernels layer.cpp).

Where: a float32 CPU model whose every projection is a kquant kind (`--weights kquant` / `q4k`, the CPU
default for GGUF files where the kernel builds), in any forward that reads the full context (no compressed view,
no SnapKV observer): decode, chain and tree verifies, drafting, and prefill chunks of any length — so a prefill
computes the same bits at any thread count and runs at every core (engine.executor). Everything else keeps
`backends.cpu_packed.packed_layer` or the plain layers.

Why: besides the projections, the ~25 small PyTorch ops a layer between them (norms, bias adds, rotary,
cache write, the page gather, attention, SiLU, residual adds) and the Python that calls them cost a decode step
a large share of its time, each a dispatch and an allocation over a few KB. The C++ layer does the same
arithmetic in loops over the same few KB (the profile before and after: docs/perf/cpu.md, session 17).

The key plan — which cache slots each new token attends to — is computed once per forward (for all layers)
as ranges of logical slots: one range [0, L + P + t + 1) for a causal decode / chain / draft query, the
mask's runs for a tree or a finished row (`reference.query_keys`).

`ExecutionConfig(cpu_fused=False)` turns the path off (A/B measurements). Taken by the CPU packed backend
(redwood.models.backends.cpu_packed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redwood.attention import reference
from redwood.models import cpu_weights


def layer_args(layer) -> tuple | None:
    """The layer's constant arguments for the C++ call (weights, types, biases, groups, norms, eps), or None
    when a projection is not a kquant kind. Kept on the layer after the first call."""
    cached = layer.__dict__.get("_cpu_fused_args", False)
    if cached is not False:
        return cached
    attn, mlp = layer.self_attn, layer.mlp
    args = None
    if attn.cpu_qkv is not None and mlp.cpu_gate_up is not None:
        qkv, gate_up = list(attn.cpu_qkv), list(mlp.cpu_gate_up)
        members = [*qkv, attn.o_proj, *gate_up, mlp.down_proj]
        if all(isinstance(m, cpu_weights.PackedLinear) and m.kind in cpu_weights._KQ_KINDS for m in members):
            from redwood.cpu_kernels import kquant

            args = (
                [m.kq for m in members],
                [kquant.TYPES[m.type_name][0] for m in members],
                [m.bias for m in members],
                [len(qkv), len(gate_up)],
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                float(layer.input_layernorm.eps),
            )
    layer.__dict__["_cpu_fused_args"] = args
    return args


def model_takes(model) -> bool:
    """Whether every layer of this model runs through the C++ layer (its kinds; the kernel built)."""
    cached = model.__dict__.get("_cpu_fused", None)
    if cached is None:
        from redwood.cpu_kernels import kquant

        cached = kquant.available() and all(layer_args(layer) is not None for layer in model.layers)
        model.__dict__["_cpu_fused"] = cached
    return cached


def takes_every_forward(model) -> bool:
    """Whether every forward of this model without a compressed view or observer — prefill chunks of any length
    included — runs through the C++ layers, and so computes the same bits at any thread count (the kquant rows and
    the layer's (token, head) tasks are split among threads, never a sum)."""
    return model.execution.cpu_fused and model_takes(model)


@dataclass
class Plan:
    """One forward's arguments shared by all layers."""

    cos: torch.Tensor  # float32 [M, D]
    sin: torch.Tensor
    write_at: torch.Tensor  # int64 [M, 2]: (page, offset) of each new token's K/V
    block_table: torch.Tensor  # int32 [B, W]
    tokens_per_row: int
    range_ptr: torch.Tensor  # int64 [M + 1]
    ranges: torch.Tensor  # int64 [R, 2]: half-open logical slot ranges, query m's in range_ptr[m]..[m + 1]


def plan(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, dest, meta) -> Plan | None:
    """The C++ layers' shared arguments for a forward of x [B, T, H] (cos / sin [B, T, D], dest the new
    tokens' (pages, offsets) [B, T]), or None when this forward keeps the Python layers."""
    B, T, _ = x.shape
    if (
        not model.execution.cpu_fused
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or meta.view is not None
        or meta.observer is not None
        or not model_takes(model)
    ):
        return None
    lengths = meta.lengths.tolist()
    P = meta.pending
    plain = meta.new_mask is None and meta.sliding_window is None and (meta.live is None or bool((meta.live > 0).all()))
    if plain:  # causal: token t of row b sees slots [0, L_b + P + t + 1)
        ranges = torch.tensor([[0, L + P + t + 1] for L in lengths for t in range(T)], dtype=torch.long)
        ptr = torch.arange(B * T + 1, dtype=torch.long)
    else:
        S = meta.read_len()
        keys = reference.query_keys(meta.full_mask(), (B, T, S))
        spans, ptr = [], [0]
        for b in range(B):
            for t in range(T):
                spans.extend(_runs(keys[b][t]))
                ptr.append(len(spans))
        ranges = torch.tensor(spans, dtype=torch.long).reshape(-1, 2)
        ptr = torch.tensor(ptr, dtype=torch.long)
    D = cos.shape[-1]
    return Plan(
        cos.reshape(B * T, D).contiguous(),
        sin.reshape(B * T, D).contiguous(),
        torch.stack([dest[0].reshape(-1), dest[1].reshape(-1)], 1).long().contiguous(),
        cache.block_table.contiguous(),
        T,
        ptr,
        ranges,
    )


def _runs(keys) -> list[tuple[int, int]]:
    """A `query_keys` entry as half-open ranges of consecutive slots (in slot order)."""
    if keys is None:
        return []
    lo, hi, idx = keys
    if idx is None:
        return [(lo, hi)]
    out: list[list[int]] = []
    for s in idx.tolist():
        if out and out[-1][1] == s:
            out[-1][1] = s + 1
        else:
            out.append([s, s + 1])
    return [tuple(r) for r in out]


def run_layers(model, x: torch.Tensor, cache, p: Plan) -> torch.Tensor:
    """All decoder layers over x [B, T, H] (float32, updated in place and returned)."""
    B, T, H = x.shape
    flat = x.view(B * T, H)
    from redwood.cpu_kernels import kquant

    op = kquant.ops().decoder_layer  # (the chosen variant's build: kquant.variant())
    attn = model.layers[0].self_attn
    Hq, Hkv = attn.num_heads, attn.num_kv_heads
    for i, layer in enumerate(model.layers):
        w, types, biases, groups, n1, n2, eps = layer_args(layer)
        op(
            flat,
            w,
            types,
            biases,
            groups,
            n1,
            n2,
            eps,
            p.cos,
            p.sin,
            cache.k[i],
            cache.v[i],
            p.write_at,
            p.block_table,
            p.tokens_per_row,
            p.range_ptr,
            p.ranges,
            Hq,
            Hkv,
        )
    return x
