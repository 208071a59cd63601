"""The CUDA backend: q/k/v and gate/up fused into one weight each (`prepare`), and per forward, by shape:

- one row × one token: the whole forward as one persistent kernel (redwood.kernels.megakernel), where the model
  fits it and the skinny path is on;
- few rows (batch × tokens: `takes_skinny`): four skinny-matmul kernels a layer with the norms, residual adds and
  SiLU — and for one token the rotary embedding and the cache write — fused in (redwood.kernels.gemv, qkv_rope),
  plus attention; reading the int8 copies of `quantize_int8` where a draft has them;
- the rest: cuBLAS matmuls with each residual add fused into the next RMSNorm and the small ops as Triton kernels
  (redwood.kernels.fused);
- without the Triton kernels (no triton): the plain layers over the fused weights.

`ExecutionConfig(kernels="on")` takes this backend on the CPU too (Triton's interpreter: tests).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from redwood.config import ExecutionConfig
from redwood.errors import ConfigError
from redwood.kernels import fused as fused_kernels
from redwood.kernels import gemv, l2_prefetch, megakernel, qkv_rope, skinny_configs
from redwood.models.backends.reference import ReferenceBackend, gather


class CudaBackend(ReferenceBackend):
    name = "cuda"

    def __init__(self, execution: ExecutionConfig):
        super().__init__(execution)
        self.kernels = False  # the Triton kernels (fused small ops, skinny matmuls) run
        # Forwards of ≤ skinny_rows rows (batch × tokens) through the skinny-matmul kernels: 1, or the tuned
        # table's max_rows where 2-8-token forwards measured faster this way; skinny_tile_rows: a range [lo, hi]
        # of rows within 9-64 (batched decoding and drafting) that also takes it, through the tile kernel (the
        # tuned table's tile_rows), or None.
        self.skinny = False
        self.skinny_rows = 1
        self.skinny_tile_rows: tuple[int, int] | None = None
        # One-token forwards of one row as one persistent kernel (taken while `skinny` is on: it is the skinny
        # path's one-token form)
        self.megakernel: megakernel.MegaForward | None = None
        self._prefetch_plans: dict = {}  # (budget, int8) → l2_prefetch.LayerPrefetch (captured forwards)

    def prepare(self, model) -> None:
        """Fuse q/k/v and gate/up weights per layer (fewer, larger matmuls: what a GPU step wants; q_proj, k_proj,
        v_proj, gate_proj and up_proj become views, so no memory is duplicated and the state dict is unchanged),
        then pick the paths the execution config and the device allow."""
        ex = self.execution
        fuse_projections(model)
        forced = ex.kernels == "on"
        if forced and fused_kernels.triton is None:
            raise ConfigError("execution kernels='on' needs an importable triton")
        self.kernels = forced or fused_kernels.available(model.device)
        self.skinny = ex.skinny and self.kernels and (forced or gemv.available(model.device))
        self.skinny_rows = ex.skinny_rows or skinny_configs.max_rows(model.device)
        self.skinny_tile_rows = ex.skinny_tile_rows or skinny_configs.tile_rows(model.device)
        self.megakernel = None
        if ex.megakernel != "off":
            why = megakernel.misfit(model)
            if why is None:
                self.megakernel = megakernel.MegaForward(model, int8=model.skinny_int8)
            elif ex.megakernel == "on":
                raise ConfigError(f"the one-token megakernel cannot run this model: {why}")

    def set_megakernel(self, mega: megakernel.MegaForward | None) -> None:
        """Take one-row one-token forwards through `mega` (a benchmark's build: profiling, experiment #defines),
        or through the skinny kernels (None)."""
        self.megakernel = mega

    def quantize_int8(self, model) -> dict:
        """int8 copies of every projection and of the LM head, with a float32 scale per output row
        (`gemv.quantize_int8`), for the skinny path (Transformer.quantize_skinny)."""
        if not self.skinny:
            raise ConfigError(
                "int8 weights run through the CUDA matrix-vector kernels (redwood.kernels.gemv), "
                f"which do not run on {model.device}"
            )
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                {
                    "qkv": gemv.quantize_int8(attn.qkv[0]),
                    "o": gemv.quantize_int8(attn.o_proj.weight),
                    "gate_up": gemv.quantize_int8(mlp.gate_up[0]),
                    "down": gemv.quantize_int8(mlp.down_proj.weight),
                }
            )
        return {"layers": layers, "lm_head": gemv.quantize_int8(model.head_weight)}

    def int8_changed(self, model) -> None:
        """The model's int8 copies changed (quantize_skinny): the megakernel's builds and pointer tables were for
        the model-dtype weights."""
        if self.megakernel is not None:
            self.megakernel = (
                megakernel.MegaForward(model, int8=model.skinny_int8) if megakernel.misfit(model) is None else None
            )

    def takes_skinny(self, rows: int) -> bool:
        """Whether a forward of `rows` = batch × new tokens goes through the skinny-matmul kernels."""
        lo, hi = self.skinny_tile_rows or (0, 0)
        return rows <= min(self.skinny_rows, gemv.MAX_ROWS) or lo <= rows <= min(hi, gemv.MAX_ROWS)

    def whole_forward(self, model, input_ids, positions, cache, new_mask, logits_at, pending, view, observer):
        mega = self.megakernel
        if (
            mega is not None
            and self.skinny
            and mega.takes(input_ids, cache, new_mask, view, observer)
            and (logits_at is None or logits_at.numel() == 1)
        ):
            try:
                return mega.forward(input_ids, positions, cache, pending)  # the whole forward in one launch
            except megakernel.Unavailable as e:
                warnings.warn(
                    f"the one-token megakernel could not be built for this model ({e}); "
                    "one-token forwards use the skinny kernels",
                    stacklevel=3,
                )
                self.megakernel = None
        return None

    def run(self, model, x, cos, sin, cache, dest, meta, logits_at):
        if not self.kernels:
            return super().run(model, x, cos, sin, cache, dest, meta, logits_at)
        B, T, _ = x.shape
        if self.skinny and self.takes_skinny(B * T):
            return self._run_skinny(model, x, cos, sin, cache, dest, meta, logits_at)
        h, residual = x, None
        for layer in model.layers:
            h, residual = fused_layer(layer, h, residual, cos, sin, cache, dest, meta)
        if logits_at is not None:
            idx = logits_at[..., None].expand(-1, -1, h.shape[-1])
            h, residual = torch.gather(h, 1, idx), torch.gather(residual, 1, idx)
        normed, _ = fused_kernels.add_rms_norm(h, residual, model.norm.weight, model.norm.eps)
        return F.linear(normed, model.head_weight).float()

    def _run_skinny(self, model, x, cos, sin, cache, dest, meta, logits_at):
        q8 = model.skinny_int8
        prefetch = self._l2_prefetch(model) if x.shape[0] * x.shape[1] == 1 else None
        for i, layer in enumerate(model.layers):
            hook = (lambda i=i: prefetch.issue(i)) if prefetch is not None else None
            x = skinny_layer(layer, x, cos, sin, cache, dest, meta, q8["layers"][i] if q8 else None, hook)
        if prefetch is not None:
            prefetch.join()
        x = gather(x, logits_at)
        weight, scale = q8["lm_head"] if q8 else (model.head_weight, None)
        return gemv.linear(x, weight, scale=scale, norm=(model.norm.weight, model.norm.eps)).float()

    def _l2_prefetch(self, model) -> l2_prefetch.LayerPrefetch | None:
        """This model's one-token L2 prefetch plan for a captured forward (None where it is off), kept per
        (budget, weights) so every graph of the model shares one side stream and its tables."""
        if not l2_prefetch.enabled(model.device):
            return None
        budget = int(l2_prefetch.megabytes() * 2**20)
        q8 = model.skinny_int8
        key = (budget, q8 is not None)
        cached = self._prefetch_plans
        if key not in cached:
            layers = [
                {"o": q8["layers"][i]["o"][0], "gate_up": q8["layers"][i]["gate_up"][0]}
                if q8
                else {"o": layer.self_attn.o_proj.weight, "gate_up": layer.mlp.gate_up[0]}
                for i, layer in enumerate(model.layers)
            ]
            cached[key] = l2_prefetch.LayerPrefetch(layers, budget, model.device)
        return cached[key]


def fuse_projections(model) -> None:
    """One q/k/v and one gate/up weight per layer (Attention.qkv, MLP.gate_up), the projections' weights becoming
    views of them (no copy; the state dict is unchanged). Idempotent."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv is None:
            attn.qkv = fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        if mlp.gate_up is None:
            mlp.gate_up = fuse_linears(mlp.gate_proj, mlp.up_proj)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


def attend(attn, q, k, v, cos, sin, cache, dest, meta) -> torch.Tensor:
    """Attention.attend with one kernel that rotates q and k and writes k and v into the cache. q: [B, T, Hq*D];
    k, v: [B, T, Hkv*D] → [B, T, Hq*D] (before o_proj)."""
    B, T, _ = q.shape
    shape = (B, T, -1, attn.head_dim)
    q = fused_kernels.rope_and_write(
        q.view(shape), k.view(shape), v.view(shape), cos, sin, cache.k[attn.layer], cache.v[attn.layer], *dest
    )  # [B, Hq, T, D]
    return attn.attend_rotated(q, cache, meta)


def fused_layer(layer, h, residual, cos, sin, cache, dest, meta):
    """DecoderLayer.forward with each residual add fused into the next RMSNorm (one Triton kernel): the stream is
    carried as (h, residual) whose sum is `x` there. residual None: the first layer."""
    if residual is None:
        residual, normed = h, fused_kernels.rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
    else:
        normed, residual = fused_kernels.add_rms_norm(
            h, residual, layer.input_layernorm.weight, layer.input_layernorm.eps
        )
    attn = layer.self_attn
    h = attn.o_proj(attend(attn, *attn.split_qkv(F.linear(normed, *attn.qkv)), cos, sin, cache, dest, meta))
    norm = layer.post_attention_layernorm
    normed, residual = fused_kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
    mlp = layer.mlp
    return mlp.down_proj(fused_kernels.silu_mul(F.linear(normed, *mlp.gate_up))), residual


def skinny_layer(layer, x, cos, sin, cache, dest, meta, int8: dict | None = None, after_qkv=None):
    """DecoderLayer.forward for few tokens (CudaBackend.skinny_rows), as four skinny-matmul kernels with the
    norms, residual adds, SiLU — and for one token the rotary embedding and the cache write — fused in
    (redwood.kernels.gemv), plus attention (and rope_and_write for more tokens).
    x [B, T, H] is the residual stream, updated in place and returned. int8: {"qkv", "o", "gate_up",
    "down"} → (int8 weight, scale) read instead of the model-dtype weights (CudaBackend.quantize_int8).
    after_qkv: called once the one-token q/k/v kernel is launched (the L2 prefetch of this layer's
    later weights forks there: redwood.kernels.l2_prefetch)."""
    attn, mlp = layer.self_attn, layer.mlp
    w = int8 or {
        "qkv": (attn.qkv[0], None),
        "o": (attn.o_proj.weight, None),
        "gate_up": (mlp.gate_up[0], None),
        "down": (mlp.down_proj.weight, None),
    }
    norm = layer.input_layernorm
    if x.shape[0] * x.shape[1] == 1:  # one token: the projection rotates q, k and writes k, v itself
        q = qkv_rope.qkv_rope_write(
            x,
            w["qkv"][0],
            attn.qkv[1],
            scale=w["qkv"][1],
            norm=(norm.weight, norm.eps),
            cos=cos,
            sin=sin,
            k_cache=cache.k[attn.layer],
            v_cache=cache.v[attn.layer],
            pages=dest[0],
            offsets=dest[1],
            num_heads=attn.num_heads,
        )
        if after_qkv is not None:
            after_qkv()
        out = attn.attend_rotated(q, cache, meta)
    else:
        qkv = gemv.linear(x, w["qkv"][0], attn.qkv[1], scale=w["qkv"][1], norm=(norm.weight, norm.eps))
        out = attend(attn, *attn.split_qkv(qkv), cos, sin, cache, dest, meta)
    gemv.linear(out, w["o"][0], attn.o_proj.bias, scale=w["o"][1], residual=x)
    norm = layer.post_attention_layernorm
    act = gemv.linear(
        x, w["gate_up"][0], mlp.gate_up[1], scale=w["gate_up"][1], norm=(norm.weight, norm.eps), silu_mul=True
    )
    return gemv.linear(act, w["down"][0], mlp.down_proj.bias, scale=w["down"][1], residual=x)
