"""One decoder for Llama 2/3/3.1/3.2, Yi, Qwen2/2.5 and Mistral.

Pre-norm blocks: x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)), with GQA attention over a `KVCache`,
rotate-half RoPE and a SwiGLU MLP. Parameter names follow Hugging Face's (without the `model.` prefix),
so HF state dicts load directly and GGUF tensors are mapped onto the same names.

A forward takes new tokens for every row of the batch, their positions, the cache (new K/V are written
at slots lengths[b] + t) and attention metadata; it does not commit — the caller decides how many of
the new tokens each row keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redwood.attention import reference
from redwood.attention.reference import AttentionMetadata, ContextView, Observer
from redwood.config import ModelConfig
from redwood.kernels import fused as fused_kernels
from redwood.kernels import gemv, l2_prefetch, megakernel, qkv_rope, skinny_configs
from redwood.kv.cache import KVCache
from redwood.models import cpu_fused, cpu_weights
from redwood.models.rope import RotaryEmbedding, apply_rotary, rotate


# Forwards with more new tokens than this (prefill) attend through the flash prefill kernel on CUDA
# (attention.triton_prefill; REDWOOD_PREFILL_KERNEL=0 turns it off) or the reference path; the decode kernel
# packs all new tokens of a row into one pass over the KV, which pays for decode, verify and tree steps.
FAST_ATTENTION_MAX_NEW = 256


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 (as HF does) and scale in the model dtype.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
            # torch's own op: the same arithmetic as below (weight · (x · rsqrt(mean(x²) + eps)), bit for bit
            # on the CPU: tests/models/test_transformer.py), one dispatch instead of eight. (Not on CUDA:
            # its fused kernel's reduction order is not checked against the formula there.)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.o_bias)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse
        self.kernels = False  # fused Triton kernels for rope + cache write (CUDA), set by fuse
        # CPU packed weights (Transformer.quantize_cpu): q | k | v as few kernel calls as their kinds allow
        # (PackedLinear.concat; q_proj, k_proj, v_proj then hold views of these), used by forward_packed
        self.cpu_qkv: list | None = None

    def fuse(self) -> None:
        """One [Hq*D + 2*Hkv*D, H] weight for q, k and v (one matmul instead of three); q_proj, k_proj
        and v_proj become views into it, so no memory is duplicated and the state dict is unchanged."""
        self.qkv = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.kernels = fused_kernels.available(self.qkv[0].device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                dest: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        if self.qkv is not None:
            qkv = self.split_qkv(F.linear(x, *self.qkv))
        else:
            qkv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attend(*qkv, cos, sin, cache, dest, meta))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [B, T, (Hq + 2 Hkv) D] → views q, k, v."""
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, cache: KVCache, dest: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """Rotate q and k, write k and v into the cache, attend. q: [B, T, Hq*D]; k, v: [B, T, Hkv*D];
        dest: the new tokens' (pages, offsets) [B, T] each (`KVCache.physical`) → [B, T, Hq*D] (before o_proj)."""
        B, T, _ = q.shape
        if self.kernels:  # one kernel: rotate q and k, write k and v into the cache → q [B, Hq, T, D]
            shape = (B, T, -1, self.head_dim)
            q = fused_kernels.rope_and_write(q.view(shape), k.view(shape), v.view(shape), cos, sin,
                                             cache.k[self.layer], cache.v[self.layer], *dest)
        else:
            q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
            k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            cache.write(self.layer, dest, k, v)
        return self.attend_rotated(q, cache, meta)

    def attend_rotated(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of rotated queries q [B, Hq, T, D] over the cache (the new K/V already written)
        → [B, T, Hq*D]."""
        B, _, T, _ = q.shape
        if meta.backend == "triton":
            out = self._fast_attention(q, cache, meta)  # [B, T, Hq, D]
        elif meta.backend == "triton_prefill":
            out = self._prefill_attention(q, cache, meta)  # [B, T, Hq, D]
        else:
            k_all, v_all, mask = reference.read_kv(cache, self.layer, meta)
            if meta.observer is not None:
                meta.observer(self.layer, q, k_all, mask)
            out = reference.attention(q, k_all, v_all, mask, meta).transpose(1, 2)  # [B, T, Hq, D]
        return out.reshape(B, T, self.num_heads * self.head_dim)

    def _fast_attention(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        from redwood.attention.triton_decode import decode_attention

        ctx_idx = ctx_valid = None
        if meta.view is not None:
            ctx_idx, ctx_valid = meta.view(self.layer)
        window = meta.sliding_window
        return decode_attention(
            q, cache.k[self.layer], cache.v[self.layer], meta.lengths,
            block_table=None if cache.dense else cache.block_table,  # (dense: row b's page is page b)
            pending=meta.pending,
            new_mask=meta.packed_new_mask(), ctx_idx=ctx_idx, ctx_valid=ctx_valid,
            q_positions=meta.q_positions if window is not None else None, sliding_window=window,
            live=meta.live,
        )

    def _prefill_attention(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """A long plain prefill forward (Transformer._backend chose "triton_prefill": no view, observer,
        pending tokens or new-token mask) through the flash prefill kernel → [B, T, Hq, D]. A dense
        cache's table is arange(B)[:, None] with page_size = capacity, so both layouts go through it."""
        from redwood.attention.triton_prefill import prefill_attention

        window = meta.sliding_window
        return prefill_attention(
            q, cache.k[self.layer], cache.v[self.layer], meta.lengths, cache.block_table,
            q_positions=meta.q_positions if window is not None else None, sliding_window=window, live=meta.live,
        )


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, h, bias=config.mlp_bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse
        self.kernels = False
        self.cpu_gate_up: list | None = None  # gate | up for CPU packed weights (as Attention.cpu_qkv)

    def fuse(self) -> None:
        """gate_proj and up_proj as views of one [2F, H] weight: one matmul."""
        self.gate_up = _fuse_linears(self.gate_proj, self.up_proj)
        self.kernels = fused_kernels.available(self.gate_up[0].device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate_up = F.linear(x, *self.gate_up)  # [.., 2F]
            if self.kernels:
                return self.down_proj(fused_kernels.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output dim; re-point each linear's
    parameters at its slice of the result. Returns (weight, bias or None)."""
    weight = torch.cat([m.weight for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot fuse linears with and without bias")
    bias = torch.cat([m.bias for m in linears]) if all(has_bias) else None
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, dest, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, dest, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_packed(self, x, cos, sin, cache, dest, meta):
        """The same layer for a float32 model whose projections are CPU packed weights (quantize_cpu), in a
        forward of fewer new tokens per row than the gemm paths take (Transformer.forward picks it): q | k
        | v and gate | up as one kernel call each where their kinds allow, each call's input cast to its
        kernel's dtype once (`PackedLinear.act_dtype`: bfloat16, float32 for kquant / q4k) and its output
        consumed by the float32 op that follows (a bias, the residual add, SiLU), q and k rotated in one pass. The same arithmetic as `forward`, bit for bit
        (tests/models/test_cpu_packed_forward.py): only the number of ops, copies and dispatches changes.
        cos, sin: [B, T, 1, D] (the rotary table broadcast over heads)."""
        attn, mlp = self.self_attn, self.mlp
        B, T, H = x.shape
        Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        h = self.input_layernorm(x).view(B * T, H)  # (each kernel call casts to its act_dtype)
        qkv = _packed_outputs(attn.cpu_qkv, h).view(B, T, -1)  # float32 [B, T, (Hq + 2 Hkv) D]
        qk = qkv[..., :(Hq + Hkv) * D].view(B, T, Hq + Hkv, D)
        qk = rotate(qk, cos, sin)  # q and k rotated in one pass: [B, T, Hq + Hkv, D]
        v = qkv[..., (Hq + Hkv) * D:].view(B, T, Hkv, D)
        cache.write(attn.layer, dest, qk[:, :, Hq:].transpose(1, 2), v.transpose(1, 2))
        out = attn.attend_rotated(qk[:, :, :Hq].transpose(1, 2), cache, meta)  # [B, T, Hq D]
        x = _add_packed(x, attn.o_proj, out.view(B * T, Hq * D))
        h = self.post_attention_layernorm(x).view(B * T, H)
        gate, up = _packed_pair(mlp.cpu_gate_up, h, mlp.gate_proj.out_features)
        return _add_packed(x, mlp.down_proj, F.silu(gate).mul_(up))

    def forward_fused(self, h, residual, cos, sin, cache, dest, meta):
        """The same layer with each residual add fused into the next RMSNorm (one Triton kernel):
        the stream is carried as (h, residual) whose sum is `x` above. residual None: the first layer."""
        if residual is None:
            residual, normed = h, fused_kernels.rms_norm(h, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            normed, residual = fused_kernels.add_rms_norm(h, residual, self.input_layernorm.weight,
                                                          self.input_layernorm.eps)
        h = self.self_attn(normed, cos, sin, cache, dest, meta)
        norm = self.post_attention_layernorm
        normed, residual = fused_kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(normed), residual

    def forward_skinny(self, x, cos, sin, cache, dest, meta, int8: dict | None = None, after_qkv=None):
        """The same layer for few tokens (Transformer.skinny_rows), as four skinny-matmul kernels with the
        norms, residual adds, SiLU — and for one token the rotary embedding and the cache write — fused in
        (redwood.kernels.gemv), plus attention (and rope_and_write for more tokens).
        x [B, T, H] is the residual stream, updated in place and returned. int8: {"qkv", "o", "gate_up",
        "down"} → (int8 weight, scale) read instead of the model-dtype weights (Transformer.quantize_skinny).
        after_qkv: called once the one-token q/k/v kernel is launched (the L2 prefetch of this layer's
        later weights forks there: redwood.kernels.l2_prefetch)."""
        attn, mlp = self.self_attn, self.mlp
        w = int8 or {"qkv": (attn.qkv[0], None), "o": (attn.o_proj.weight, None),
                     "gate_up": (mlp.gate_up[0], None), "down": (mlp.down_proj.weight, None)}
        norm = self.input_layernorm
        if x.shape[0] * x.shape[1] == 1:  # one token: the projection rotates q, k and writes k, v itself
            q = qkv_rope.qkv_rope_write(x, w["qkv"][0], attn.qkv[1], scale=w["qkv"][1],
                                        norm=(norm.weight, norm.eps), cos=cos, sin=sin, k_cache=cache.k[attn.layer],
                                        v_cache=cache.v[attn.layer], pages=dest[0], offsets=dest[1],
                                        num_heads=attn.num_heads)
            if after_qkv is not None:
                after_qkv()
            out = attn.attend_rotated(q, cache, meta)
        else:
            qkv = gemv.linear(x, w["qkv"][0], attn.qkv[1], scale=w["qkv"][1], norm=(norm.weight, norm.eps))
            out = attn.attend(*attn.split_qkv(qkv), cos, sin, cache, dest, meta)
        gemv.linear(out, w["o"][0], attn.o_proj.bias, scale=w["o"][1], residual=x)
        norm = self.post_attention_layernorm
        act = gemv.linear(x, w["gate_up"][0], mlp.gate_up[1], scale=w["gate_up"][1],
                          norm=(norm.weight, norm.eps), silu_mul=True)
        return gemv.linear(act, w["down"][0], mlp.down_proj.bias, scale=w["down"][1], residual=x)


_ACT = cpu_weights._ACT  # the CPU packed kernels' activation dtype


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


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, rope_freqs: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, rope_freqs)
        # "auto": the Triton kernel for decode/verify/tree steps on CUDA (reference SDPA for prefill, for
        # observed forwards and on the CPU); "reference": SDPA everywhere (tests, A/B benchmarks).
        self.attention_backend = "auto"
        # Forwards of ≤ skinny_rows tokens through the skinny-matmul kernels (set by fuse_projections
        # where they run; False: cuBLAS matmuls + the fused small-op kernels, for A/B benchmarks).
        # skinny_rows: 1, or the tuned table's max_rows where 2-8-token forwards measured faster this way;
        # skinny_tile_rows: a range [lo, hi] of batch × tokens within 9-64 (batched decoding and drafting)
        # that also takes it, through the tile kernel (the tuned table's tile_rows), or None.
        self.skinny = False
        self.skinny_rows = 1
        self.skinny_tile_rows: tuple[int, int] | None = None
        self.skinny_int8: dict | None = None  # int8 projection copies for the skinny path (quantize_skinny)
        self.weights = "float32"  # the CPU projection format (quantize_cpu)
        self.packed_head: nn.Module | None = None  # the LM head in that format (quantize_cpu)
        self._prefetch_plans: dict = {}  # (budget, int8) → l2_prefetch.LayerPrefetch (captured forwards)
        # One-token forwards of one row as one persistent kernel (redwood.kernels.megakernel; set by
        # fuse_projections where the model fits unless REDWOOD_MEGAKERNEL=0, or by use_megakernel); taken
        # while `skinny` is on (it is the skinny path's one-token form)
        self.megakernel: megakernel.MegaForward | None = None

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up weights per layer (fewer, larger matmuls: what a GPU step wants)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.skinny = self.layers[0].mlp.kernels and gemv.available(self.device)
        self.skinny_rows = skinny_configs.max_rows(self.device)
        self.skinny_tile_rows = skinny_configs.tile_rows(self.device)
        if megakernel.enabled() and megakernel.misfit(self) is None:
            self.megakernel = megakernel.MegaForward(self)

    def use_megakernel(self, on: bool = True) -> None:
        """Take (or stop taking) one-token one-row forwards through the megakernel; a clear error where the
        model does not fit it (megakernel.misfit)."""
        from redwood.errors import ConfigError

        if not on:
            self.megakernel = None
            return
        why = megakernel.misfit(self)
        if why is not None:
            raise ConfigError(f"the one-token megakernel cannot run this model: {why}")
        if self.megakernel is None:
            self.megakernel = megakernel.MegaForward(self)

    def quantize_skinny(self, scheme: str = "int8") -> None:
        """Give the one-token (skinny) forwards int8 copies of every projection and of the LM head, with
        a float32 scale per output row (`gemv.quantize_int8`): the matrix-vector kernels then read half
        the bytes. Forwards the skinny path does not take (takes_skinny) keep the model-dtype weights.
        Meant for a draft model: the target verifies exactly, so the output stays the target's and only
        acceptance can move."""
        from redwood.errors import ConfigError

        if scheme != "int8":
            raise ConfigError(f"unknown weight quantization {scheme!r}; only 'int8' is supported")
        if not self.skinny:
            raise ConfigError("int8 weights run through the CUDA matrix-vector kernels (redwood.kernels.gemv), "
                              f"which do not run on {self.device}")
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append({"qkv": gemv.quantize_int8(attn.qkv[0]), "o": gemv.quantize_int8(attn.o_proj.weight),
                           "gate_up": gemv.quantize_int8(mlp.gate_up[0]),
                           "down": gemv.quantize_int8(mlp.down_proj.weight)})
        self.skinny_int8 = {"layers": layers, "lm_head": gemv.quantize_int8(self.head_weight)}
        if self.megakernel is not None:  # its builds and pointer tables were for the model-dtype weights
            self.megakernel = megakernel.MegaForward(self) if megakernel.misfit(self) is None else None

    def quantize_cpu(self, kind: str) -> None:
        """Hold every projection and the LM head in a CPU weight format (redwood.models.cpu_weights:
        "int8", "int4", "bfloat16"; "float32" leaves the model as it is): each nn.Linear is replaced by a
        PackedLinear (its float weight is freed), and a tied LM head gets its own packed copy (the
        embedding stays float: a lookup reads one row). Same weights in every forward, so verification
        stays exact. CPU only: CUDA keeps its own path (quantize_skinny)."""
        from redwood.errors import ConfigError

        file_format = kind in cpu_weights.FILE_FORMATS  # (per projection, as the GGUF file loaded it)
        if kind not in cpu_weights.WEIGHT_FORMATS and not file_format:
            raise ConfigError(f"unknown weights {kind!r}; choose one of {', '.join(cpu_weights.WEIGHT_FORMATS)}")
        if kind == self.weights:
            return
        if self.weights != "float32":
            raise ConfigError(f"the model's weights are already {self.weights}; load it again for {kind}")
        if self.device.type != "cpu":
            raise ConfigError(f"weights={kind!r} is a CPU format; on {self.device} the model keeps its dtype "
                              f"(CUDA drafts can use draft_quant='int8')")
        if self.layers[0].self_attn.qkv is not None:
            raise ConfigError("quantize_cpu needs the unfused projections (fuse_projections is for CUDA)")
        why = None if file_format else self.cpu_format_misfit(kind)
        if why:
            raise ConfigError(f"weights={kind!r} does not fit this model: {why}")
        if file_format and not all(isinstance(getattr(m, n), cpu_weights.PackedLinear) for m, n in self._projections()):
            raise ConfigError(f"weights={kind!r} keeps a GGUF file's types, chosen as the file loads: "
                              f"load_model(path, weights={kind!r})")
        for m, name in self._projections():
            linear = getattr(m, name)
            if isinstance(linear, cpu_weights.PackedLinear):  # packed as it loaded (`cpu_weights.packer`)
                if linear.kind != kind and not file_format:
                    raise ConfigError(f"a projection is already {linear.kind}; load the model again for {kind}")
                continue
            setattr(m, name, cpu_weights.PackedLinear(linear.weight, linear.bias, kind))
        # The head too (a sixth of a 1.5B's bytes); a vocabulary that int4 cannot tile keeps a float head.
        head_kind = cpu_weights.file_kind(tuple(self.head_weight.shape), kind) if file_format and not isinstance(
            self.lm_head, cpu_weights.PackedLinear) else kind  # (a tied head: int8, from the float embedding)
        if isinstance(self.lm_head, cpu_weights.PackedLinear):
            self.packed_head = self.lm_head
        elif cpu_weights.check_packable(self.head_weight, head_kind) is None:
            self.packed_head = cpu_weights.PackedLinear(self.head_weight, None, head_kind)
            if self.lm_head is not None:
                self.lm_head = self.packed_head  # frees the float head
        self.weights = kind
        self._concat_packed()
        # w8a8: fbgemm's packing now, once per kernel call (not at the first forward): the modules and the
        # concatenations (held in the layers' cpu_qkv / cpu_gate_up lists, not as modules)
        groups = [g for layer in self.layers for g in (layer.self_attn.cpu_qkv or []) + (layer.mlp.cpu_gate_up or [])]
        for m in [*self.modules(), *groups]:
            if isinstance(m, cpu_weights.PackedLinear) and m.kind == "w8a8":
                m.packed_w8a8()

    def _concat_packed(self) -> None:
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

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            members = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            if not all(isinstance(m, cpu_weights.PackedLinear) for m in members):
                return  # (a projection stayed float: the whole model keeps the plain path)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.cpu_qkv = groups([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.cpu_gate_up = groups([mlp.gate_proj, mlp.up_proj])

    def _projections(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every decoder-layer projection, in layer order."""
        return [(m, name) for layer in self.layers for m, names in
                ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                 (layer.mlp, ("gate_proj", "up_proj", "down_proj"))) for name in names]

    def cpu_format_misfit(self, kind: str) -> str | None:
        """Why a projection of this model cannot take the CPU format `kind` (None when all can)."""

        for m, name in self._projections():
            linear = getattr(m, name)  # (an nn.Linear, on the meta device too, or a PackedLinear)
            why = cpu_weights.check_packable((linear.out_features, linear.in_features), kind)
            if why:
                return why
        return None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache(self.config, batch_size, capacity, self.dtype, self.device)

    def prefill_kernel(self) -> bool:
        """Whether long plain prefill forwards (more than FAST_ATTENTION_MAX_NEW new tokens, no view,
        observer, pending tokens or new-token mask) attend through the flash prefill kernel
        (attention.triton_prefill): on CUDA, for a dtype and head dim the kernel takes, unless the model is
        pinned to the reference or REDWOOD_PREFILL_KERNEL=0 (on by default: 1.25-3.7× faster per chunk on
        the H200, NOTES.md session 13). Those forwards then
        materialize no scores, so the prefill loops (engine.prefill) drop their score budget."""
        if self.attention_backend == "reference":
            return False
        from redwood.attention import triton_prefill

        return triton_prefill.enabled() and triton_prefill.available(self.device, self.dtype, self.config.head_dim)

    def _backend(self, input_ids: torch.Tensor, T: int, observer, view=None, pending: int = 0,
                 new_mask=None) -> str:
        if T > FAST_ATTENTION_MAX_NEW:
            plain = observer is None and view is None and pending == 0 and new_mask is None
            if plain and self.prefill_kernel():
                return "triton_prefill"
            return "reference"  # (SnapKV's observer needs the scores; views, trees, drafts: not in the kernel)
        if self.attention_backend == "reference" or observer is not None:
            return "reference"
        if input_ids.device.type == "cuda":
            from redwood.attention import triton_decode

            if triton_decode.available(input_ids.device, self.dtype, self.config.head_dim):
                return "triton"
        if self.attention_backend == "triton":
            from redwood.errors import ConfigError

            raise ConfigError("the Triton attention kernel needs a CUDA device and an importable triton")
        return "reference"

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H]: the embeddings when they are tied."""
        if self.packed_head is not None and self.lm_head is self.packed_head:
            raise RuntimeError("the LM head is packed (quantize_cpu); call logits() instead of reading its weight")
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(self.norm(hidden))
        return F.linear(self.norm(hidden), self.head_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                new_mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                pending: int = 0, view: ContextView | None = None,
                observer: Observer | None = None) -> torch.Tensor:
        """Run T new tokens per row through the model, writing their K/V into `cache`.

        input_ids, positions: [B, T]. The new tokens go to slots lengths + pending + t, after `pending`
        uncommitted tokens of earlier forwards (drafting). new_mask: [T, P + T] / [B, T, P + T] bool over
        pending + new tokens (None: all pending, causal among new). view: read the committed context
        through a compressed view (draft KV policies). observer(layer, q, k, mask): sees each layer's
        attention inputs (SnapKV scores the prompt with it).
        logits_at: optional [B, K] indices into T — only those positions get logits (prefill needs one).
        Returns logits [B, T or K, vocab] in float32.
        """
        mega = self.megakernel
        if (mega is not None and self.skinny and mega.takes(input_ids, cache, new_mask, view, observer)
                and (logits_at is None or logits_at.numel() == 1)):
            try:
                return mega.forward(input_ids, positions, cache, pending)  # the whole forward in one launch
            except megakernel.Unavailable as e:
                import warnings

                warnings.warn(f"the one-token megakernel could not be built for this model ({e}); "
                              "one-token forwards use the skinny kernels", stacklevel=2)
                self.megakernel = None
        B, T = input_ids.shape
        dest = cache.physical(cache.slots(T, offset=pending))  # (pages, offsets) [B, T]: where the new K/V go
        capturing = cache.k.is_cuda and torch.cuda.is_current_stream_capturing()
        meta = AttentionMetadata(
            # inside a CUDA graph the reference path reads every slot (masked) rather than sync for the max
            lengths=cache.lengths, num_new=T, kv_len=cache.capacity if capturing else None,
            pending=pending, new_mask=new_mask, live=cache.live,
            q_positions=positions, sliding_window=self.config.sliding_window, view=view, observer=observer,
            backend=self._backend(input_ids, T, observer, view, pending, new_mask),
        )
        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary(positions, x.dtype)
        if self.layers[0].self_attn.kernels and self.layers[0].mlp.kernels:
            if self.skinny and self.takes_skinny(B * T):
                return self._forward_skinny(x, cos, sin, cache, dest, meta, logits_at)
            return self._forward_fused(x, cos, sin, cache, dest, meta, logits_at)
        if self.takes_packed(x):
            fused = cpu_fused.plan(self, x, cos, sin, cache, dest, meta)  # kquant kinds: a C++ call a layer
            if fused is not None:
                x = cpu_fused.run_layers(self, x, cache, fused)
            else:
                cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, D]: over heads in a [B, T, H, D] layout
                for layer in self.layers:
                    x = layer.forward_packed(x, cos, sin, cache, dest, meta)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, cache, dest, meta)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        return self.logits(x).float()

    def takes_packed(self, x: torch.Tensor) -> bool:
        """Whether a forward of x [B, T, H] runs its layers through DecoderLayer.forward_packed: a float32
        model with CPU packed projections (quantize_cpu), fewer new tokens per row than the packed gemm
        paths take (a prefill chunk keeps the plain path, which routes it there)."""

        return (self.layers[0].self_attn.cpu_qkv is not None and x.dtype == torch.float32
                and cpu_weights.prefill_rows(x) < min(cpu_weights.INT8_GEMM_ROWS, cpu_weights.INT4_GEMM_ROWS))

    def _forward_fused(self, h, cos, sin, cache, dest, meta, logits_at):
        residual = None
        for layer in self.layers:
            h, residual = layer.forward_fused(h, residual, cos, sin, cache, dest, meta)
        if logits_at is not None:
            idx = logits_at[..., None].expand(-1, -1, h.shape[-1])
            h, residual = torch.gather(h, 1, idx), torch.gather(residual, 1, idx)
        normed, _ = fused_kernels.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)
        return F.linear(normed, self.head_weight).float()

    def takes_skinny(self, rows: int) -> bool:
        """Whether a forward of `rows` = batch × new tokens goes through the skinny-matmul kernels."""
        lo, hi = self.skinny_tile_rows or (0, 0)
        return rows <= min(self.skinny_rows, gemv.MAX_ROWS) or lo <= rows <= min(hi, gemv.MAX_ROWS)

    def _forward_skinny(self, x, cos, sin, cache, dest, meta, logits_at):
        q8 = self.skinny_int8
        prefetch = self._l2_prefetch() if x.shape[0] * x.shape[1] == 1 else None
        for i, layer in enumerate(self.layers):
            hook = (lambda i=i: prefetch.issue(i)) if prefetch is not None else None
            x = layer.forward_skinny(x, cos, sin, cache, dest, meta, q8["layers"][i] if q8 else None, hook)
        if prefetch is not None:
            prefetch.join()
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        weight, scale = q8["lm_head"] if q8 else (self.head_weight, None)
        return gemv.linear(x, weight, scale=scale, norm=(self.norm.weight, self.norm.eps)).float()

    def _l2_prefetch(self) -> l2_prefetch.LayerPrefetch | None:
        """This model's one-token L2 prefetch plan for a captured forward (None where it is off), kept per
        (budget, weights) so every graph of the model shares one side stream and its tables."""
        if not l2_prefetch.enabled(self.device):
            return None
        budget = int(l2_prefetch.megabytes() * 2**20)
        q8 = self.skinny_int8
        key = (budget, q8 is not None)
        cached = self._prefetch_plans
        if key not in cached:
            layers = [{"o": q8["layers"][i]["o"][0], "gate_up": q8["layers"][i]["gate_up"][0]} if q8 else
                      {"o": layer.self_attn.o_proj.weight, "gate_up": layer.mlp.gate_up[0]}
                      for i, layer in enumerate(self.layers)]
            cached[key] = l2_prefetch.LayerPrefetch(layers, budget, self.device)
        return cached[key]


def hf_state_dict_to_redwood(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names (`model.layers.0...`, `lm_head.weight`) onto ours."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb" in name:
            continue
        out[name] = tensor
    return out


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str, rope_freqs: torch.Tensor | None = None) -> Transformer:
    """A Transformer holding `state` (HF names), cast to dtype/device, with no random init.

    The module is built on the meta device and the tensors are assigned in, so a 1.5B model costs no
    initialization time and no second copy. Checks that nothing is missing, left over or misshapen.
    A projection already packed as it loaded (a `cpu_weights.PackedLinear` in place of its weight, from
    `cpu_weights.packer`) replaces its nn.Linear, bias included; `quantize_cpu` then finishes the model.
    """
    from redwood.errors import ModelLoadError

    with torch.device("meta"):
        model = Transformer(config)
    state = hf_state_dict_to_redwood(state)
    if model.lm_head is None:
        state.pop("lm_head.weight", None)  # tied: some checkpoints store the copy anyway
    for name in [n for n, t in state.items() if isinstance(t, nn.Module)]:
        packed, path = state.pop(name), name.removesuffix(".weight")
        linear = model.get_submodule(path)
        if (packed.out_features, packed.in_features) != (linear.out_features, linear.in_features):
            raise ModelLoadError(f"weight {name}: shape {(packed.out_features, packed.in_features)} does not "
                                 f"match the config's {(linear.out_features, linear.in_features)}")
        bias = state.pop(path + ".bias", None)
        if (bias is None) != (linear.bias is None):
            raise ModelLoadError(f"weights do not match the model config: {'missing' if bias is None else 'unexpected'} "
                                 f"['{path}.bias']")
        if bias is not None:
            packed.bias = bias.detach().float()
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, packed)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ModelLoadError(
            "weights do not match the model config: "
            + (f"missing {missing[:5]}{'…' if len(missing) > 5 else ''} " if missing else "")
            + (f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}" if unexpected else "")
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ModelLoadError(
                f"weight {name}: shape {tuple(tensor.shape)} does not match the config's {tuple(expected[name])}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(config, rope_freqs).to(device)
    return model.eval().requires_grad_(False)
