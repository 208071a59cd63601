"""The CPU packed-weights backend: a model whose projections are CPU weight formats (redwood.models.cpu_weights,
`Transformer.quantize_cpu`). Per forward, by shape: a kquant model's forwards of any length without a compressed view
or observer as one C++ call a layer (redwood.models.cpu_fused); forwards of fewer rows a row than the packed gemm paths
take through `packed_layer` (q | k | v and gate | up as one kernel call each); the rest (prefill chunks) through the
plain layers, whose PackedLinear projections route them to the gemm paths. The same arithmetic on every path, bit
for bit (tests/models/test_cpu_packed_forward.py), so decode == verify.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redwood.models import cpu_fused, cpu_weights
from redwood.models.backends.reference import ReferenceBackend, gather
from redwood.models.rope import rotate


class CpuPackedBackend(ReferenceBackend):
    name = "cpu_packed"

    def takes_packed(self, model, x: torch.Tensor) -> bool:
        """Whether a forward of x [B, T, H] runs its layers through `packed_layer`: a float32 model with CPU packed
        projections (quantize_cpu), fewer new tokens per row than the packed gemm paths take (a prefill chunk
        keeps the plain path, which routes it there)."""
        return (
            model.layers[0].self_attn.cpu_qkv is not None
            and x.dtype == torch.float32
            and cpu_weights.prefill_rows(x) < min(cpu_weights.INT8_GEMM_ROWS, cpu_weights.INT4_GEMM_ROWS)
        )

    def run(self, model, x, cos, sin, cache, dest, meta, logits_at):
        fused = cpu_fused.plan(model, x, cos, sin, cache, dest, meta)  # kquant kinds, any length: a C++ call a layer
        if fused is not None:
            x = cpu_fused.run_layers(model, x, cache, fused)
        elif not self.takes_packed(model, x):
            return super().run(model, x, cos, sin, cache, dest, meta, logits_at)
        else:
            cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, D]: over heads in a [B, T, H, D] layout
            for layer in model.layers:
                x = packed_layer(layer, x, cos, sin, cache, dest, meta)
        return model.logits(gather(x, logits_at)).float()


def packed_layer(layer, x, cos, sin, cache, dest, meta):
    """DecoderLayer.forward for a float32 model whose projections are CPU packed weights (quantize_cpu), in a
    forward of fewer new tokens per row than the gemm paths take (CpuPackedBackend.run picks it): q | k
    | v and gate | up as one kernel call each where their kinds allow, each call's input cast to its
    kernel's dtype once (`PackedLinear.act_dtype`: bfloat16, float32 for kquant / q4k) and its output
    consumed by the float32 op that follows (a bias, the residual add, SiLU), q and k rotated in one pass. The same arithmetic as DecoderLayer.forward, bit for bit
    (tests/models/test_cpu_packed_forward.py): only the number of ops, copies and dispatches changes.
    cos, sin: [B, T, 1, D] (the rotary table broadcast over heads)."""
    attn, mlp = layer.self_attn, layer.mlp
    B, T, H = x.shape
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    h = layer.input_layernorm(x).view(B * T, H)  # (each kernel call casts to its act_dtype)
    qkv = _packed_outputs(attn.cpu_qkv, h).view(B, T, -1)  # float32 [B, T, (Hq + 2 Hkv) D]
    qk = qkv[..., : (Hq + Hkv) * D].view(B, T, Hq + Hkv, D)
    qk = rotate(qk, cos, sin)  # q and k rotated in one pass: [B, T, Hq + Hkv, D]
    v = qkv[..., (Hq + Hkv) * D :].view(B, T, Hkv, D)
    cache.write(attn.layer, dest, qk[:, :, Hq:].transpose(1, 2), v.transpose(1, 2))
    out = attn.attend_rotated(qk[:, :, :Hq].transpose(1, 2), cache, meta)  # [B, T, Hq D]
    x = _add_packed(x, attn.o_proj, out.view(B * T, Hq * D))
    h = layer.post_attention_layernorm(x).view(B * T, H)
    gate, up = _packed_pair(mlp.cpu_gate_up, h, mlp.gate_proj.out_features)
    return _add_packed(x, mlp.down_proj, F.silu(gate).mul_(up))


def _float_output(m, y: torch.Tensor) -> torch.Tensor:
    """A packed projection's bfloat16 product y → float32 with m's bias: PackedLinear.forward's
    y.to(float32) + bias, as one op where there is a bias (bfloat16 → float32 is exact)."""
    return y.float() if m.bias is None else torch.add(y, m.bias)


def _packed_outputs(groups: list, h: torch.Tensor) -> torch.Tensor:
    """The members' outputs side by side (float32 [M, N]) for groups of concatenated projections."""
    outs = [_float_output(g, g.raw(h.to(g.act_dtype))) for g in groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _packed_pair(groups: list, h: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up (float32 [M, n] each, contiguous as PackedLinear.forward's outputs) from their groups."""
    if len(groups) == 2:
        return tuple(_float_output(g, g.raw(h.to(g.act_dtype))) for g in groups)
    y, m = groups[0].raw(h.to(groups[0].act_dtype)), groups[0]
    if m.bias is None:
        return y[:, :n].float(), y[:, n:].float()
    return torch.add(y[:, :n], m.bias[:n]), torch.add(y[:, n:], m.bias[n:])


def _add_packed(x: torch.Tensor, m, h: torch.Tensor) -> torch.Tensor:
    """x + m(h) for a packed projection m, input h [M, K] (cast to m's act_dtype) and the residual x [B, T, N]
    (float32)."""
    y = m.raw(h.to(m.act_dtype)).view(*x.shape)
    return torch.add(x, y) if m.bias is None else x + torch.add(y, m.bias)


def quantize(model, kind: str) -> None:
    """Hold every projection and the LM head in a CPU weight format (redwood.models.cpu_weights:
    "int8", "int4", "bfloat16"; "float32" leaves the model as it is): each nn.Linear is replaced by a
    PackedLinear (its float weight is freed), and a tied LM head gets its own packed copy (the
    embedding stays float: a lookup reads one row). Same weights in every forward, so verification
    stays exact. CPU only: CUDA keeps its own path (quantize_skinny). Called by
    Transformer.quantize_cpu, which then selects this backend."""
    from redwood.errors import ConfigError

    file_format = kind in cpu_weights.FILE_FORMATS  # (per projection, as the GGUF file loaded it)
    if kind not in cpu_weights.WEIGHT_FORMATS and not file_format:
        raise ConfigError(f"unknown weights {kind!r}; choose one of {', '.join(cpu_weights.WEIGHT_FORMATS)}")
    if kind == model.weights:
        return
    if model.weights != "float32":
        raise ConfigError(f"the model's weights are already {model.weights}; load it again for {kind}")
    if model.device.type != "cpu":
        raise ConfigError(
            f"weights={kind!r} is a CPU format; on {model.device} the model keeps its dtype "
            f"(CUDA drafts can use draft_weights='int8')"
        )
    if model.layers[0].self_attn.qkv is not None:
        raise ConfigError("quantize_cpu needs the unfused projections (the CUDA backend fuses them)")
    why = None if file_format else format_misfit(model, kind)
    if why:
        raise ConfigError(f"weights={kind!r} does not fit this model: {why}")
    if file_format and not all(isinstance(getattr(m, n), cpu_weights.PackedLinear) for m, n in projections(model)):
        raise ConfigError(
            f"weights={kind!r} keeps a GGUF file's types, chosen as the file loads: load_model(path, weights={kind!r})"
        )
    for m, name in projections(model):
        linear = getattr(m, name)
        if isinstance(linear, cpu_weights.PackedLinear):  # packed as it loaded (`cpu_weights.packer`)
            if linear.kind != kind and not file_format:
                raise ConfigError(f"a projection is already {linear.kind}; load the model again for {kind}")
            continue
        setattr(m, name, cpu_weights.PackedLinear(linear.weight, linear.bias, kind))
    # The head too (a sixth of a 1.5B's bytes); a vocabulary that int4 cannot tile keeps a float head.
    head_kind = (
        cpu_weights.file_kind(tuple(model.head_weight.shape), kind)
        if file_format and not isinstance(model.lm_head, cpu_weights.PackedLinear)
        else kind
    )  # (a tied head: int8, from the float embedding)
    if isinstance(model.lm_head, cpu_weights.PackedLinear):
        model.packed_head = model.lm_head
    elif cpu_weights.check_packable(model.head_weight, head_kind) is None:
        model.packed_head = cpu_weights.PackedLinear(model.head_weight, None, head_kind)
        if model.lm_head is not None:
            model.lm_head = model.packed_head  # frees the float head
    model.weights = kind
    _concat_packed(model)
    # w8a8: fbgemm's packing now, once per kernel call (not at the first forward): the modules and the
    # concatenations (held in the layers' cpu_qkv / cpu_gate_up lists, not as modules)
    groups = [g for layer in model.layers for g in (layer.self_attn.cpu_qkv or []) + (layer.mlp.cpu_gate_up or [])]
    for m in [*model.modules(), *groups]:
        if isinstance(m, cpu_weights.PackedLinear) and m.kind == "w8a8":
            m.packed_w8a8()


def _concat_packed(model) -> None:
    """Give every layer its q | k | v and gate | up groups (Attention.cpu_qkv, MLP.cpu_gate_up): runs
    of consecutive projections that `PackedLinear.concat` takes become one kernel call each."""

    def groups(linears):
        out = [[linears[0]]]
        for m in linears[1:]:
            if cpu_weights.can_concat(out[-1] + [m]):
                out[-1].append(m)
            else:
                out.append([m])
        return [g[0] if len(g) == 1 else cpu_weights.PackedLinear.concat(g) for g in out]

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        members = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(isinstance(m, cpu_weights.PackedLinear) for m in members):
            return  # (a projection stayed float: the whole model keeps the plain path)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.cpu_qkv = groups([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.cpu_gate_up = groups([mlp.gate_proj, mlp.up_proj])


def projections(model) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every decoder-layer projection, in layer order."""
    return [
        (m, name)
        for layer in model.layers
        for m, names in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
        )
        for name in names
    ]


def format_misfit(model, kind: str) -> str | None:
    """Why a projection of this model cannot take the CPU format `kind` (None when all can)."""

    for m, name in projections(model):
        linear = getattr(m, name)  # (an nn.Linear, on the meta device too, or a PackedLinear)
        why = cpu_weights.check_packable((linear.out_features, linear.in_features), kind)
        if why:
            return why
    return None
