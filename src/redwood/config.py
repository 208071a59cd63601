"""Model configuration: one dataclass for every supported decoder family, validated on construction.

Supported families share one decoder (see `models/transformer.py`): pre-norm RMSNorm, GQA attention with
rotate-half RoPE, SwiGLU MLP. They differ only in the flags below:

- llama (Llama 2/3/3.1/3.2, Yi): optional llama3 / linear rope scaling, optional attention / MLP bias;
- qwen2 (Qwen2, Qwen2.5): bias on the q/k/v projections;
- mistral: a sliding attention window.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from redwood.errors import ConfigError, ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
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


VERIFIERS = ("auto", "greedy", "sampling", "sequoia", "specinfer", "topk")


DRAFT_QUANT = (None, "int8")  # draft weight formats for the one-token draft forwards

# The most draft tokens one step may accept: γ for a chain, depth − 1 for a tree. Acceptance compounds
# along a path, so even at a per-token acceptance of 0.95 a 64th draft token is accepted in 4% of steps
# (0.95^64) and expected tokens per step are within 4% of their γ → ∞ limit (1 / (1 − α) = 20); the
# papers' chains and trees stay at or under ~16-20 levels. Deeper drafts only cost draft forwards and a
# longer verify (`--gamma 1000` spent 282 s drafting to emit 8 tokens).
MAX_DRAFT_DEPTH = 64


def check_draft_tree(tree, what: str = "tree") -> None:
    """A ConfigError for a speculation tree with no draft token (a lone root: plain decoding — vLLM
    likewise rejects num_speculative_tokens 0 with a draft) or deeper than MAX_DRAFT_DEPTH drafts."""
    if tree.size < 2:
        raise ConfigError(f"{what} has no draft tokens (a lone root); speculate at least one token per step, "
                          f"or drop the speculation settings to decode autoregressively")
    if tree.max_depth - 1 > MAX_DRAFT_DEPTH:
        raise ConfigError(f"{what} drafts {tree.max_depth - 1} tokens deep; at most {MAX_DRAFT_DEPTH} (a longer "
                          f"path is almost never accepted whole, and every level costs a draft forward)")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate (MagicDec-style chains).

    draft_model: a zoo name / folder / .gguf of a small model sharing the target's tokenizer; or
    self_speculate=True: the target drafts for itself, reading a compressed view of its own KV cache.
    draft_kv: which committed tokens the draft reads — "full", "streaming" (sinks + recent window) or
    "snapkv" (prefill-selected positions + recent tokens), within `draft_budget` tokens.
    sinks / window: StreamingLLM's sink count and recent window (window defaults to budget − sinks);
    for snapkv, `window` is the observation window (default 32) and `pool_kernel` its smoothing.
    num_draft_tokens: γ, draft tokens per step of a chain (the target verifies γ + 1 positions).
    tree: a token tree instead of a chain — "chain:G", "chains:KxL", a tree JSON file or a shipped tree
    name (see `redwood tree-search`); the target verifies all its nodes in one forward.
    verifier: "greedy" (accept the target's argmax; temperature 0 only), "sampling" (speculative
    rejection sampling; on a tree, Sequoia's), "sequoia" (children drawn without replacement),
    "specinfer" (children drawn with replacement), "topk" (the draft's top-k children; the target
    samples), or "auto" (greedy when every request is greedy, else sampling / sequoia). All but greedy
    are lossless at any temperature / top-k / top-p.
    draft_quant: "int8" — the draft model's one-token forwards read int8 copies of its projection
    weights (per-row scales; CUDA only): half the bytes per draft level. Verification stays exact, so
    outputs do not change; acceptance may.
    """

    draft_model: str | None = None
    self_speculate: bool = False
    draft_kv: str = "full"
    draft_budget: int | None = None
    sinks: int | None = None
    window: int | None = None
    pool_kernel: int = 5
    num_draft_tokens: int = 4
    tree: str | None = None
    verifier: str = "auto"
    draft_quant: str | None = None

    def __post_init__(self) -> None:
        from redwood.kv.policies import KV_POLICIES

        if bool(self.draft_model) == bool(self.self_speculate):
            raise ConfigError("speculation needs exactly one of draft_model=... or self_speculate=True")
        if self.draft_kv not in KV_POLICIES:
            raise ConfigError(f"unknown draft_kv {self.draft_kv!r}; choose one of {', '.join(KV_POLICIES)}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens (gamma) must be an integer >= 1, got {self.num_draft_tokens!r}")
        if self.num_draft_tokens > MAX_DRAFT_DEPTH:
            raise ConfigError(f"num_draft_tokens (gamma) must be at most {MAX_DRAFT_DEPTH}, got "
                              f"{self.num_draft_tokens} (see redwood.config.MAX_DRAFT_DEPTH)")
        if self.verifier not in VERIFIERS:
            raise ConfigError(f"unknown verifier {self.verifier!r}; choose one of {', '.join(VERIFIERS)}")
        for name in ("draft_budget", "window"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.sinks is not None and (not isinstance(self.sinks, int) or self.sinks < 0):
            raise ConfigError(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if self.draft_quant not in DRAFT_QUANT:
            raise ConfigError(f"unknown draft_quant {self.draft_quant!r}; choose one of {DRAFT_QUANT[1:]} or None")
        if self.draft_quant and self.self_speculate:
            raise ConfigError("draft_quant applies to a draft model; self-speculation drafts with the target's weights")
        self.make_policy()  # validates the policy's own settings
        self.make_tree()

    def make_tree(self):
        """The token tree each step drafts: `tree` if given, else a chain of num_draft_tokens."""
        from redwood.speculation.trees import Tree, resolve_tree

        if not self.tree:
            return Tree.chain(self.num_draft_tokens)
        tree = resolve_tree(self.tree)
        check_draft_tree(tree, f"tree {self.tree}")
        return tree

    def make_policy(self):
        from redwood.kv.policies import make_policy

        return make_policy(self.draft_kv, budget=self.draft_budget, sinks=self.sinks, window=self.window,
                           kernel=self.pool_kernel)


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
        for name, choices in (("attention", ("auto", "reference", "triton")), ("kernels", ("auto", "on", "off")),
                              ("megakernel", ("auto", "on", "off"))):
            if getattr(self, name) not in choices:
                raise ConfigError(f"execution {name}={getattr(self, name)!r}: choose one of {', '.join(choices)}")
        for name in ("skinny", "prefill_kernel", "cpu_fused", "adaptive_threads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"execution {name}={getattr(self, name)!r}: True or False")
        if self.skinny_rows is not None and (isinstance(self.skinny_rows, bool) or not isinstance(self.skinny_rows, int)
                                             or self.skinny_rows < 1):
            raise ConfigError(f"execution skinny_rows={self.skinny_rows!r}: a positive int or None")
        if self.skinny_tile_rows is not None:
            rows = tuple(self.skinny_tile_rows)
            if len(rows) != 2 or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows) \
                    or not 1 <= rows[0] <= rows[1]:
                raise ConfigError(f"execution skinny_tile_rows={self.skinny_tile_rows!r}: (lo, hi) with 1 ≤ lo ≤ hi")
            object.__setattr__(self, "skinny_tile_rows", rows)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
