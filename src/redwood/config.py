"""Configuration at the bottom of the package: `ModelConfig` (one dataclass for every supported decoder family)
`EngineConfig` (an engine's scheduling and memory settings) and `ExecutionConfig` (how forwards run), validated on construction. How to speculate
is `redwood.speculation.config.SpeculativeConfig`.

Supported families share one decoder (see `models/transformer.py`): pre-norm RMSNorm, GQA attention with
rotate-half RoPE, SwiGLU MLP. They differ only in the flags below:

- llama (Llama 2/3/3.1/3.2, Yi): optional llama3 / linear rope scaling, optional attention / MLP bias;
- qwen2 (Qwen2, Qwen2.5): bias on the q/k/v projections;
- mistral: a sliding attention window.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from redwood.errors import ConfigError, ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# What sampled tokens are drawn with (`EngineConfig.sampling_noise`, `redwood.sample.sampler.Sampler`).
SAMPLING_NOISES = ("position", "counter")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long context (`rope_type` 'linear' or 'llama3')."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 → hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama when attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False
    sliding_window: int | None = None  # each query sees at most this many keys (itself included)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {self.arch!r}; redwood supports {', '.join(SUPPORTED_ARCHS)}"
            )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"model config: sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {self.rope_scaling.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Map a Hugging Face `config.json` (transformers 4.x or 5.x layout) onto a ModelConfig."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHS:
            archs = d.get("architectures") or []
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures {archs}); "
                f"redwood supports {', '.join(SUPPORTED_ARCHS)}"
            )
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; redwood implements SwiGLU (silu)")
        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in `rope_theta` + `rope_scaling`.
        rope = dict(d.get("rope_parameters") or {})
        if not rope:
            rope = dict(d.get("rope_scaling") or {})
            rope["rope_theta"] = d.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type != "default":
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )
        sliding = None
        if model_type == "mistral":
            sliding = d.get("sliding_window")
        elif model_type == "qwen2" and d.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=true (per-layer windows) is not supported")
        attention_bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        num_heads = int(d["num_attention_heads"])
        return cls(
            arch=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or 0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"no config.json in {path.parent}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)


DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_BLOCK_SIZE = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # prefill tokens per step
CPU_KV_MEMORY_GIB = 4.0  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)
GPU_KV_MEMORY_FRACTION = 0.9  # of the device memory free when the engine allocates


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """An Engine's scheduling and memory settings (`redwood.engine.Engine`), validated on construction.

    max_num_seqs: batch slots (requests generating at once). max_model_len: prompt + output limit per
    request (None: the model's context; checked against it when the engine is built). block_size: tokens
    per KV page. max_num_batched_tokens: prefill tokens per step (a longer prompt is prefilled in chunks
    over several steps, beside the decoding rows). kv_cache_memory: GiB for this engine's KV pages (target
    + draft model); None: on CUDA `kv_memory_fraction` of the device memory free when the engine is
    built, on the CPU CPU_KV_MEMORY_GIB — never more than max_num_seqs full-length requests need. Two
    engines over the same loaded models each take their own share (give the first a fraction or GiB that
    leaves room for the second). enable_prefix_caching: share the KV blocks of identical prompt prefixes
    across requests (refcounted). cuda_graphs: capture each step shape in a CUDA graph (None: on for CUDA).
    sampling_noise: the random numbers a sampled token is drawn with — "position" (default): the token at
    absolute position P (the prompt's tokens are 0 … len − 1) is drawn with the request seed's number at P
    (`RowRandom.positional`), so with the `match` verifier a seeded request gives the same tokens under
    autoregressive decoding and any speculation plan; "counter": the row's per-draw counter stream (the
    engine before positional numbers; exact too, but the tokens depend on how the request speculated).
    tensor_parallel_size: ranks the models are sharded over (`redwood.parallel`; `LLM` spawns them, or takes
    torchrun's); 1: one process. prefill_first: while prompts wait to be prefilled, steps run their prefill
    alone and the decoding rows wait (SGLang's order; the default mixes both in every step, as vLLM does) — a
    burst of requests finishes sooner, the early rows' inter-token latency grows while it prefills.
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_cache_memory: float | None = None
    kv_memory_fraction: float = GPU_KV_MEMORY_FRACTION
    enable_prefix_caching: bool = False
    cuda_graphs: bool | None = None
    sampling_noise: str = "position"
    tensor_parallel_size: int = 1
    prefill_first: bool = False

    def __post_init__(self) -> None:
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.sampling_noise not in SAMPLING_NOISES:
            raise ConfigError(
                f"sampling_noise must be one of {', '.join(SAMPLING_NOISES)}, got {self.sampling_noise!r}"
            )
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        m = self.max_model_len
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {m!r}")
        kv = self.kv_cache_memory
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, (int, float)) or not kv > 0):
            raise ConfigError(f"kv_cache_memory must be a positive number of GiB, got {kv!r}")
        f = self.kv_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ConfigError(f"kv_memory_fraction must be in (0, 1], got {f!r}")
        for name in ("enable_prefix_caching", "prefill_first"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be True, False or None, got {self.cuda_graphs!r}")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class ExecutionConfig:
    """How a model's forwards run: which execution backend (redwood.models.backends) and which of its paths,
    chosen once at load (`Transformer.set_execution`). Every path computes the same forward: the defaults take
    the fastest path each forward's shape allows; the switches are for A/B measurements and tests.

    attention: "auto" (the Triton decode kernel for decode / verify / tree forwards on CUDA, the reference
        elsewhere), "reference" (PyTorch SDPA everywhere), "triton" (the kernel; a ConfigError where it cannot run).
    kernels: the Triton kernels of the CUDA backend (fused q/k/v and gate/up, the small-op and skinny-matmul
        kernels): "auto" (on CUDA where triton imports), "on" (also in Triton's interpreter on the CPU: tests),
        "off" (plain PyTorch layers: the A/B baseline).
    skinny: few-token forwards through the skinny-matmul kernels (False: cuBLAS + the fused small-op kernels).
    skinny_rows: forwards of ≤ this many rows (batch × tokens) take them (None: the GPU's tuned table).
    skinny_tile_rows: (lo, hi) rows within 9-64 that take the tile kernel too (None: the tuned table's).
    megakernel: one-row one-token forwards as one persistent kernel (redwood.kernels.megakernel): "auto" (where
        the model fits), "on" (a ConfigError where it does not), "off".
    prefill_kernel: long plain prefill forwards through the flash prefill kernel on CUDA (attention.triton_prefill).
    cpu_fused: a kquant model's short CPU forwards as one C++ call a layer (redwood.models.cpu_fused).
    adaptive_threads: on a small CPU machine, decode steps pick 1 or 2 threads by timing both (engine.threads).
    """

    attention: str = "auto"
    kernels: str = "auto"
    skinny: bool = True
    skinny_rows: int | None = None
    skinny_tile_rows: tuple[int, int] | None = None
    megakernel: str = "auto"
    prefill_kernel: bool = True
    cpu_fused: bool = True
    adaptive_threads: bool = True

    def __post_init__(self) -> None:
        for name, choices in (
            ("attention", ("auto", "reference", "triton")),
            ("kernels", ("auto", "on", "off")),
            ("megakernel", ("auto", "on", "off")),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(f"execution {name}={getattr(self, name)!r}: choose one of {', '.join(choices)}")
        for name in ("skinny", "prefill_kernel", "cpu_fused", "adaptive_threads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"execution {name}={getattr(self, name)!r}: True or False")
        if self.skinny_rows is not None and (
            isinstance(self.skinny_rows, bool) or not isinstance(self.skinny_rows, int) or self.skinny_rows < 1
        ):
            raise ConfigError(f"execution skinny_rows={self.skinny_rows!r}: a positive int or None")
        if self.skinny_tile_rows is not None:
            rows = tuple(self.skinny_tile_rows)
            if (
                len(rows) != 2
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
                or not 1 <= rows[0] <= rows[1]
            ):
                raise ConfigError(f"execution skinny_tile_rows={self.skinny_tile_rows!r}: (lo, hi) with 1 ≤ lo ≤ hi")
            object.__setattr__(self, "skinny_tile_rows", rows)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
