"""One decoder for Llama 2/3/3.1/3.2, Yi, Qwen2/2.5 and Mistral.

Pre-norm blocks: x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)), with GQA attention over a `KVCache`,
rotate-half RoPE and a SwiGLU MLP. Parameter names follow Hugging Face's (without the `model.` prefix),
so HF state dicts load directly and GGUF tensors are mapped onto the same names.

A forward takes new tokens for every row of the batch, their positions, the cache (new K/V are written
at slots lengths[b] + t) and attention metadata; it does not commit — the caller decides how many of
the new tokens each row keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from redwood.attention import reference
from redwood.attention.reference import AttentionMetadata, ContextView, Observer
from redwood.config import ExecutionConfig, ModelConfig
from redwood.kv.cache import KVCache
from redwood.models import backends
from redwood.models.backends import cpu_packed
from redwood.models.backends.cuda import CudaBackend
from redwood.models.backends.reference import ReferenceBackend
from redwood.models.rope import RotaryEmbedding, apply_rotary
from redwood.models.shard import ShardPlan

if TYPE_CHECKING:
    from redwood.parallel import TPGroup

OFFLOAD_ATTR = "_redwood_offload"  # the OffloadManager of an offloaded model (`models.offload`)


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
    """config: the layer's own (under tensor parallelism this rank's heads: `ShardPlan.local_config`); tp: the
    group whose all-reduce sums the ranks' o_proj outputs (None: one process)."""

    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup | None = None):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.o_bias)
        # one [Hq*D + 2*Hkv*D, H] weight for q, k and v, whose slices q_proj, k_proj, v_proj view (the CUDA
        # backend's prepare: one matmul instead of three)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # CPU packed weights (Transformer.quantize_cpu): q | k | v as few kernel calls as their kinds allow
        # (PackedLinear.concat; q_proj, k_proj, v_proj then hold views of these), used by backends.cpu_packed.packed_layer
        self.cpu_qkv: list | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        dest: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.qkv is not None:
            qkv = self.split_qkv(F.linear(x, *self.qkv))
        else:
            qkv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out = self.o_proj(self.attend(*qkv, cos, sin, cache, dest, meta))  # [B, T, H] (this rank's heads' part)
        return out if self.tp is None else self.tp.all_reduce(out)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [B, T, (Hq + 2 Hkv) D] → views q, k, v."""
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        dest: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotate q and k, write k and v into the cache, attend. q: [B, T, Hq*D]; k, v: [B, T, Hkv*D];
        dest: the new tokens' (pages, offsets) [B, T] each (`KVCache.physical`) → [B, T, Hq*D] (before o_proj)."""
        B, T, _ = q.shape
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
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

        ctx_idx = ctx_valid = span = None
        if isinstance(meta.view, reference.SpanView):  # StreamingLLM's two ranges: read as tiles, no gather
            span = (meta.view.lengths, meta.view.sinks, meta.view.window)
        elif meta.view is not None:
            ctx_idx, ctx_valid = meta.view(self.layer)
        window = meta.sliding_window
        return decode_attention(
            q,
            cache.k[self.layer],
            cache.v[self.layer],
            meta.lengths,
            block_table=None if cache.dense else cache.block_table,  # (dense: row b's page is page b)
            pending=meta.pending,
            new_mask=meta.packed_new_mask(),
            ctx_idx=ctx_idx,
            ctx_valid=ctx_valid,
            q_positions=meta.q_positions if window is not None else None,
            sliding_window=window,
            live=meta.live,
            ctx_span=span,
        )

    def _prefill_attention(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """A long plain prefill forward (backends.attention_kernel chose "triton_prefill": no view, observer,
        pending tokens or new-token mask) through the flash prefill kernel → [B, T, Hq, D]. A dense
        cache's table is arange(B)[:, None] with page_size = capacity, so both layouts go through it."""
        from redwood.attention.triton_prefill import prefill_attention

        window = meta.sliding_window
        return prefill_attention(
            q,
            cache.k[self.layer],
            cache.v[self.layer],
            meta.lengths,
            cache.block_table,
            q_positions=meta.q_positions if window is not None else None,
            sliding_window=window,
            live=meta.live,
        )


class MLP(nn.Module):
    """SwiGLU; under tensor parallelism this rank's slice of the width F, its down_proj outputs summed over the
    ranks (tp's all-reduce)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, h, bias=config.mlp_bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # one [2F, H] weight (as Attention.qkv)
        self.cpu_gate_up: list | None = None  # gate | up for CPU packed weights (as Attention.cpu_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, *self.gate_up).chunk(2, dim=-1)  # [.., F] each
            out = self.down_proj(F.silu(gate) * up)
        else:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x, cos, sin, cache, dest, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, dest, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder. Its forward runs through an execution backend (redwood.models.backends), chosen once from the
    device, the weights and an `ExecutionConfig` (`set_execution`; a model as built runs the reference backend,
    `load_model` selects the device's).

    tp: under tensor parallelism, this rank's group: the model then holds this rank's shard (`models.shard`: its
    heads, MLP slice and vocabulary rows) and its forward runs the collectives; `config` stays the whole model's
    (the vocabulary the sampler sees), `kv_config` is this rank's (its KV heads: what its caches hold)."""

    def __init__(self, config: ModelConfig, rope_freqs: torch.Tensor | None = None, tp: TPGroup | None = None):
        super().__init__()
        self.config, self.tp = config, tp
        self.shard = None if tp is None else ShardPlan(tp.rank, tp.world, config)
        local = config if self.shard is None else self.shard.local_config
        vocab = config.vocab_size if self.shard is None else self.shard.vocab[1] - self.shard.vocab[0]
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(local, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, vocab, bias=False)
        self.rotary = RotaryEmbedding(config, rope_freqs)
        # Weight formats (each a transform of the weights the forward reads)
        self.weights = "float32"  # the CPU projection format (quantize_cpu)
        self.packed_head: nn.Module | None = None  # the LM head in that format (quantize_cpu)
        self.skinny_int8: dict | None = None  # int8 projection copies for the CUDA skinny path (quantize_skinny)
        self.execution = ExecutionConfig()
        self.backend = ReferenceBackend(self.execution)

    def set_execution(self, execution: ExecutionConfig | None = None) -> None:
        """Run forwards as `execution` says (None: the defaults): the backend for this model's device and weights
        (`backends.select`), which prepares the weights it reads (the CUDA backend fuses q/k/v and gate/up).
        A ConfigError where the config asks for what this model cannot run (megakernel="on", attention="triton"
        without CUDA)."""
        execution = execution or ExecutionConfig()
        backend = backends.select(self, execution)
        backend.prepare(self)
        self.execution, self.backend = execution, backend

    def quantize_skinny(self, scheme: str = "int8") -> None:
        """Give the one-token (skinny) forwards int8 copies of every projection and of the LM head, with
        a float32 scale per output row (`gemv.quantize_int8`): the matrix-vector kernels then read half
        the bytes. Forwards the skinny path does not take (takes_skinny) keep the model-dtype weights.
        Meant for a draft model: the target verifies exactly, so the output stays the target's and only
        acceptance can move."""
        from redwood.errors import ConfigError

        if scheme != "int8":
            raise ConfigError(f"unknown weight quantization {scheme!r}; only 'int8' is supported")
        if not isinstance(self.backend, CudaBackend):
            raise ConfigError(
                "int8 weights run through the CUDA matrix-vector kernels (redwood.kernels.gemv), "
                f"which do not run on {self.device}"
            )
        self.skinny_int8 = self.backend.quantize_int8(self)
        self.backend.int8_changed(self)

    def quantize_cpu(self, kind: str) -> None:
        """Hold every projection and the LM head in a CPU weight format (backends.cpu_packed.quantize: "int8",
        "int4", "bfloat16", …; "float32" leaves the model as it is), then run forwards through the CPU packed
        backend. Same weights in every forward, so verification stays exact."""
        before = self.weights
        cpu_packed.quantize(self, kind)
        if self.weights != before:
            self.set_execution(self.execution)

    def cpu_format_misfit(self, kind: str) -> str | None:
        """Why a projection of this model cannot take the CPU format `kind` (None when all can)."""
        return cpu_packed.format_misfit(self, kind)

    @property
    def offloaded(self) -> bool:
        """Whether the decoder layers stream from host memory (`models.offload.offload_layers`)."""
        return getattr(self, OFFLOAD_ATTR, None) is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def kv_config(self) -> ModelConfig:
        """The config this model's KV caches are sized by: `config`, or under tensor parallelism this rank's
        (its KV heads)."""
        return self.config if self.shard is None else self.shard.local_config

    @property
    def kv_slot_bytes(self) -> int:
        """Bytes one cache slot (one token's K and V over every layer) takes in this model's caches."""
        c = self.kv_config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache(self.kv_config, batch_size, capacity, self.dtype, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] → [B, T, H]. Under tensor parallelism each rank looks up the ids in its vocabulary
        rows, zeros the others, and the all-reduce sums: one rank's row plus zeros, exact."""
        if self.shard is None:
            return self.embed_tokens(input_ids)
        start, stop = self.shard.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= stop - start)  # [B, T]: ids another rank holds
        x = self.embed_tokens(local.clamp(0, stop - start - 1)).masked_fill(outside[..., None], 0.0)
        return self.tp.all_reduce(x)

    def prefill_kernel(self) -> bool:
        """Whether long plain prefill forwards attend through the flash prefill kernel (`backends.prefill_kernel`):
        those forwards then materialize no scores, so the prefill loops (engine.prefill) drop their score budget."""
        return backends.prefill_kernel(self)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H]: the embeddings when they are tied."""
        if self.packed_head is not None and self.lm_head is self.packed_head:
            raise RuntimeError("the LM head is packed (quantize_cpu); call logits() instead of reading its weight")
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] → logits [.., V] (under tensor parallelism every rank's vocabulary rows, gathered)."""
        h = self.norm(hidden)
        out = self.packed_head(h) if self.packed_head is not None else F.linear(h, self.head_weight)
        if self.shard is None:  # (tensor parallel: [.., this rank's rows] until the gather)
            return out
        pad = self.shard.vocab_rows - out.shape[-1]  # (the last rank's rows may be fewer: the gather's pieces match)
        if pad:
            out = F.pad(out, (0, pad))
        return self.tp.all_gather_last(out, self.config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        new_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        pending: int = 0,
        view: ContextView | None = None,
        observer: Observer | None = None,
    ) -> torch.Tensor:
        """Run T new tokens per row through the model, writing their K/V into `cache`.

        input_ids, positions: [B, T]. The new tokens go to slots lengths + pending + t, after `pending`
        uncommitted tokens of earlier forwards (drafting). new_mask: [T, P + T] / [B, T, P + T] bool over
        pending + new tokens (None: all pending, causal among new). view: read the committed context
        through a compressed view (draft KV policies). observer(layer, q, k, mask): sees each layer's
        attention inputs (SnapKV scores the prompt with it).
        logits_at: optional [B, K] indices into T — only those positions get logits (prefill needs one).
        Returns logits [B, T or K, vocab] in float32.
        """
        logits = self.backend.whole_forward(
            self, input_ids, positions, cache, new_mask, logits_at, pending, view, observer
        )
        if logits is not None:
            return logits  # (the one-token megakernel: the whole forward in one launch)
        B, T = input_ids.shape
        dest = cache.physical(cache.slots(T, offset=pending))  # (pages, offsets) [B, T]: where the new K/V go
        capturing = cache.k.is_cuda and torch.cuda.is_current_stream_capturing()
        meta = AttentionMetadata(
            # inside a CUDA graph the reference path reads every slot (masked) rather than sync for the max
            lengths=cache.lengths,
            num_new=T,
            kv_len=cache.capacity if capturing else None,
            pending=pending,
            new_mask=new_mask,
            live=cache.live,
            q_positions=positions,
            sliding_window=self.config.sliding_window,
            view=view,
            observer=observer,
            backend=backends.attention_kernel(self, input_ids, T, observer, view, pending, new_mask),
        )
        x = self.embed(input_ids)  # [B, T, H]
        cos, sin = self.rotary(positions, x.dtype)  # [B, T, D] each
        # layers → norm → head, through the backend's path for this shape: logits [B, T or K, V] float32
        return self.backend.run(self, x, cos, sin, cache, dest, meta, logits_at)


def hf_state_dict_to_redwood(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names (`model.layers.0...`, `lm_head.weight`) onto ours."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb" in name:
            continue
        out[name] = tensor
    return out


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    rope_freqs: torch.Tensor | None = None,
    tp: TPGroup | None = None,
) -> Transformer:
    """A Transformer holding `state` (HF names), cast to dtype/device, with no random init.

    The module is built on the meta device and the tensors are assigned in, so a 1.5B model costs no
    initialization time and no second copy. Checks that nothing is missing, left over or misshapen.
    A projection already packed as it loaded (a `cpu_weights.PackedLinear` in place of its weight, from
    `cpu_weights.packer`) replaces its nn.Linear, bias included; `quantize_cpu` then finishes the model.
    The model runs the reference backend until `set_execution` picks its device's (`load_model` does).
    tp: build this rank's shard (`state` then holds its pieces: `ShardPlan.take`, as the loaders read them).
    """
    from redwood.errors import ModelLoadError

    with torch.device("meta"):
        model = Transformer(config, tp=tp)
    state = hf_state_dict_to_redwood(state)
    if model.lm_head is None:
        state.pop("lm_head.weight", None)  # tied: some checkpoints store the copy anyway
    for name in [n for n, t in state.items() if isinstance(t, nn.Module)]:
        packed, path = state.pop(name), name.removesuffix(".weight")
        linear = model.get_submodule(path)
        if (packed.out_features, packed.in_features) != (linear.out_features, linear.in_features):
            raise ModelLoadError(
                f"weight {name}: shape {(packed.out_features, packed.in_features)} does not "
                f"match the config's {(linear.out_features, linear.in_features)}"
            )
        bias = state.pop(path + ".bias", None)
        if (bias is None) != (linear.bias is None):
            raise ModelLoadError(
                f"weights do not match the model config: {'missing' if bias is None else 'unexpected'} ['{path}.bias']"
            )
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
