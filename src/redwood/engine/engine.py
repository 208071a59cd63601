"""The Engine: one step-level loop with continuous batching over a paged KV cache.

    engine = Engine("qwen2.5-coder-1.5b-instruct", speculative=SpeculativeConfig(...))
    engine.add_request("def fib(n):", SamplingParams(max_new_tokens=64), request_id="a")
    while engine.has_unfinished():
        for delta in engine.step():        # RequestDelta(request_id, token_ids, text, finish_reason, stats,
            ...                            #   ..., sources, logprobs, spans: per-token outputs)

A step is: schedule (`Scheduler`: which rows decode, which prefill chunks run within the step's token
budget, preemptions) → run (one decoding step — autoregressive or draft → verify — over the rows that
generate, then the prefill chunks: unobserved ones batched in one forward, SnapKV-observed ones alone)
→ postprocess (emit tokens, check stops, commit KV, free what finished). Requests join at step
boundaries; a row that finishes is refilled at the next one.

Rows are batch *slots* [0, max_num_seqs). Device state per slot: the cache's page-table row, length and
live flag (`KVCache`), `prev` / `last` (the newest committed token / the sampled token not yet fed), the
sampler's settings and random stream (`Sampler.set_row`), the draft KV policy's per-row state (SnapKV's
selection). A decoding step runs on the first n slots, n the smallest batch bucket (1, 2, 4, …,
max_num_seqs) holding every generating row — slots are handed out lowest first, so n tracks the
running count — and each bucket has its own runners and CUDA graphs. Rows in the bucket that do not
generate (idle slots, a request still prefilling) have live 0: they read no KV, their writes land in
scratch slots or the trash page, their results are dropped and their random counters restored — so a
request's output does not depend on what runs beside it.

A request's prefill runs in chunks into its slot (`engine.prefill`); with a standalone draft model each
chunk also runs through the draft into its own cache, which shares the target's page table (same block
ids, the draft model's pages).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from redwood.config import ExecutionConfig, SpeculativeConfig
from redwood.engine.decode import ARStep, SpecStep, resolve_verifier
from redwood.engine.prefill import prefill_row, prefill_rows
from redwood.engine.request import (SOURCE_DRAFT, SOURCE_TARGET, RequestState, SpecStats, TokenLogprob,
                                    token_logprob_list)
from redwood.engine.runner import StepRunner, sync
from redwood.engine.sampling import Sampler, token_logprobs
from redwood.engine.scheduler import Scheduler, SeqState
from redwood.engine.threads import adaptive_threads, apply_threads, check_threads, set_threads
from redwood.errors import ConfigError, ContextLengthError
from redwood.kv.blocks import BlockPool
from redwood.kv.cache import KVCache
from redwood.loading import ModelInfo, inspect_model, load_model, parse_device, parse_dtype
from redwood.models.cpu_weights import check_weights
from redwood.sampling_params import SamplingParams
from redwood.speculation.trees import Tree

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"  # shares the target's tokenizer

# Special tokens that end a generation wherever a vocabulary has them (as llama.cpp's end-of-generation
# set): e.g. Qwen instruct files name only <|im_end|> as EOS, yet the model may also emit <|endoftext|>.
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "</s>",
                     "<|end|>", "<end_of_turn>")

DEFAULT_BLOCK_SIZE = 128
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_PREFILL_CHUNK = 2048  # max_num_batched_tokens: prefill tokens per step
CPU_KV_MEMORY_GIB = 4.0  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)
GPU_KV_MEMORY_FRACTION = 0.9  # of the device memory free after loading


def eos_token_ids(config, tokenizer) -> frozenset[int]:
    """EOS ids: the model config's, the tokenizer's EOS, and its end-of-generation special tokens."""
    ids = set(config.eos_token_ids)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        added = getattr(tokenizer, "added_tokens_encoder", {}) or {}
        for text in END_OF_GENERATION:
            if text in special or text in added:
                tid = tokenizer.convert_tokens_to_ids(text)
                if isinstance(tid, int) and 0 <= tid < config.vocab_size:
                    ids.add(tid)
    return frozenset(ids)


@dataclass
class RequestDelta:
    """What one step produced for one request.

    sources[i] / logprobs[i] belong to token_ids[i]: "draft" for a draft token the target accepted,
    "target" for a token sampled from the target (the prefill's first token, a correction, the bonus
    token; every token of autoregressive decoding); the target's raw log-probabilities (`TokenLogprob`)
    when the request set SamplingParams.logprobs (else None). spans: `text` cut into (text, source)
    runs, one per token whose characters it holds, in order — "".join(t for t, _ in spans) == text; a
    token's characters may come in a later delta than the token (text held back for stop strings or an
    incomplete UTF-8 sequence), and a token that adds no text (EOS, part of a character) has no span.
    """

    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new text (held back while it could begin a stop string)
    finish_reason: str | None  # None while running; "stop", "length", "context" or "abort" on its last delta
    stats: dict | None = None  # on the last delta: RequestStats.to_dict()
    prompt_token_ids: list[int] | None = None  # on the last delta
    sources: list[str] = field(default_factory=list)  # per new token: "draft" | "target"
    logprobs: list[TokenLogprob] | None = None  # per new token, when the request asked for logprobs
    spans: list[tuple[str, str]] = field(default_factory=list)  # text as (piece, source) per token


@dataclass
class _Request:
    seq: SeqState  # the scheduler's view
    state: RequestState  # output, text, stop conditions, stats
    params: SamplingParams
    slot: int | None = None
    observers: tuple = (None, None)  # (target's, draft model's) prefill observers while prefilling
    seed_state: tuple | None = None  # the random stream kept across a preemption
    t_added: float = 0.0
    t_first: float | None = None
    capture_at_first: float = 0.0  # Engine.capture_s when the first token came (decode_s leaves captures out)
    sent: int = 0  # output tokens already in deltas
    synced: int = 0  # block-table entries already copied to the device table


def _check_knobs(max_num_seqs, block_size, max_num_batched_tokens, kv_cache_memory) -> None:
    for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool) or
                                        not isinstance(kv_cache_memory, (int, float)) or not kv_cache_memory > 0):
        raise ConfigError(f"kv_cache_memory must be a positive number of GiB, got {kv_cache_memory!r}")


def encode_prompt(tokenizer, prompt, chat: bool = False, model_name: str = "the model") -> list[int]:
    """Token ids for a text prompt (through the chat template when `chat`), or ids as given."""
    if not isinstance(prompt, str):
        if chat:
            raise ConfigError("chat=True needs text prompts, not token ids")
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ConfigError("a prompt is a string or a sequence of token ids") from None
    if tokenizer is None:
        raise ConfigError(f"{model_name} has no tokenizer; pass token ids instead of text")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{model_name} has no chat template; drop --chat / chat=True")
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        ))
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A ContextLengthError for an empty prompt, ids outside the vocabulary, or no room to generate."""
    if not ids:
        raise ContextLengthError("the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ContextLengthError(f"the prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens but the context is {max_model_len} tokens "
            f"(at most {max_model_len - 1} prompt tokens leave room to generate)")


def check_max_model_len(max_model_len, context: int) -> int:
    """max_model_len (None → the model's context), checked against the context."""
    if max_model_len is None:
        return context
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or not 2 <= max_model_len <= context:
        raise ConfigError(f"max_model_len must be an integer in [2, {context}] (the model's context), "
                          f"got {max_model_len!r}")
    return max_model_len


class Engine:
    """A loaded model (and drafter) serving requests step by step.

    model / dtype / device / speculative / offload / offload_prefetch / cuda_graphs: as `redwood.LLM`.
    max_num_seqs: batch slots (requests generating at once). max_model_len: prompt + output limit per
    request (default: the model's context). block_size: tokens per KV page. max_num_batched_tokens:
    prefill tokens per step (a longer prompt is prefilled in chunks over several steps, beside the
    decoding rows). kv_cache_memory: GiB for the KV pages (target + draft model); default: on CUDA 90%
    of the memory free after loading, on the CPU 4 GiB — never more than max_num_seqs full-length
    requests need. enable_prefix_caching: share the KV blocks of identical prompt prefixes across
    requests (refcounted; off by default). threads: torch's CPU threads (`redwood.engine.threads`:
    None → OMP_NUM_THREADS when set, else the measured default; on CUDA only an explicit value is set).
    weights: the CPU projection format of the target (`redwood.models.cpu_weights.gguf_default`: "auto" →
    "kquant" for a GGUF file where the kquant kernel runs (the file's Q4_K / Q6_K blocks × int8 activations),
    else "w8a8" on a CPU whose int8 sums are exact (AVX512-VNNI), else "gguf" — each projection on the file's
    own grid: its 4-bit groups as int4, the rest int8; float32 for other checkpoints; "float32" | "bfloat16"
    | "int8" | "int4" | "w8a8" | "q4k" | "gguf" | "kquant"). draft_weights: the same for a draft model
    ("auto" → q4k where kquant runs, else w8a8, else int4 for a GGUF draft, the fastest speculation
    measured; float32 otherwise; the output stays the target's whatever the draft's format, only acceptance
    moves).
    """

    def __init__(self, model: str | Path | ModelInfo = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", speculative: SpeculativeConfig | None = None,
                 offload: bool = False, offload_prefetch: int = 2, cuda_graphs: bool | None = None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_model_len: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_num_batched_tokens: int = DEFAULT_PREFILL_CHUNK,
                 kv_cache_memory: float | None = None, enable_prefix_caching: bool = False,
                 threads: int | None = None, weights: str = "auto", draft_weights: str = "auto",
                 execution: ExecutionConfig | None = None):
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
        _check_knobs(max_num_seqs, block_size, max_num_batched_tokens, kv_cache_memory)
        check_threads(threads)
        if offload:
            from redwood.engine.offload import check_prefetch, offload_layers

            check_prefetch(offload_prefetch)
        dev = parse_device(device)  # (bad values: an error before anything loads)
        parse_dtype(dtype)
        check_weights(weights, dev, offload)
        check_weights(draft_weights, dev, name="draft_weights")
        if draft_weights != "auto" and (speculative is None or not speculative.draft_model):
            raise ConfigError("draft_weights applies to a draft model: "
                              + ("self-speculation drafts with the target's weights" if speculative is not None
                                 else "give speculative=SpeculativeConfig(draft_model=...)"))
        if cuda_graphs and dev.type != "cuda":
            raise ConfigError("cuda_graphs needs device='cuda'")
        # Tokenizers and configs first: what they can refuse is refused before minutes of weight loading.
        model = inspect_model(model)
        draft_info = None
        if speculative is not None and speculative.draft_model:
            from redwood.speculation.drafters import check_compatible

            draft_info = inspect_model(speculative.draft_model)
            check_compatible(model.tokenizer, draft_info.tokenizer, model.config.vocab_size,
                             draft_info.config.vocab_size)
        check_max_model_len(max_model_len, model.config.max_position_embeddings)
        if threads is not None or dev.type == "cpu":
            apply_threads(threads)  # before loading: dequantizing the weights runs on these threads too
        loaded = load_model(model, dtype=dtype, device="cpu" if offload else device,
                            weights="float32" if offload else weights, execution=execution)
        if offload:  # loaded on the host: the layers stay there, the rest moves to the device
            offload_layers(loaded.model, device, prefetch=offload_prefetch)
        on_cuda = loaded.model.device.type == "cuda"
        self.tokenizer, self.model = loaded.tokenizer, loaded.model
        self.config = loaded.config
        drafter = tree = None
        self.draft_name = None
        if speculative is not None:
            tree = speculative.make_tree()
            drafter = self._make_drafter(speculative, dtype, device, draft_info, draft_weights, execution)
        self._setup(loaded.model, loaded.tokenizer, loaded.source, loaded.path, drafter, tree,
                    "auto" if speculative is None else speculative.verifier,
                    on_cuda if cuda_graphs is None else bool(cuda_graphs), max_num_seqs, max_model_len,
                    block_size, max_num_batched_tokens, kv_cache_memory, enable_prefix_caching)
        self.speculative = speculative
        if dev.type == "cpu" and not offload and self._thread_exact_decode():
            self.thread_policy = adaptive_threads(threads, enabled=execution is None or execution.adaptive_threads)

    @classmethod
    def build(cls, model, tokenizer=None, *, drafter=None, tree=None, verifier: str = "auto",
              cuda_graphs: bool | None = None, model_name: str = "model", max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
              max_model_len: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
              max_num_batched_tokens: int = DEFAULT_PREFILL_CHUNK, kv_cache_memory: float | None = None,
              enable_prefix_caching: bool = False) -> "Engine":
        """An Engine over an already loaded target `Transformer` (and a `Drafter` with its `Tree`):
        what tools holding models (benchmarks, tests) use instead of loading them again."""
        from redwood.speculation.trees import Tree

        _check_knobs(max_num_seqs, block_size, max_num_batched_tokens, kv_cache_memory)
        if (drafter is None) != (tree is None):
            raise ConfigError("a drafter needs a tree (Tree.chain(γ) for a chain) and a tree needs a drafter")
        if isinstance(tree, int):
            tree = Tree.chain(tree)
        self = cls.__new__(cls)
        self.model, self.tokenizer, self.config = model, tokenizer, model.config
        self.draft_name = None if drafter is None else type(drafter).__name__
        self.speculative = None
        on_cuda = model.device.type == "cuda"
        self._setup(model, tokenizer, model_name, None, drafter, tree, verifier,
                    on_cuda if cuda_graphs is None else bool(cuda_graphs) and on_cuda, max_num_seqs,
                    max_model_len, block_size, max_num_batched_tokens, kv_cache_memory, enable_prefix_caching)
        return self

    def _setup(self, model, tokenizer, name, path, drafter, tree, verifier, use_graphs, max_num_seqs,
               max_model_len, block_size, max_num_batched_tokens, kv_cache_memory, enable_prefix_caching) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, model.config
        self.model_name, self.model_path = name, path
        self.thread_policy = None  # decode steps' thread count chosen as they run (engine.threads.AdaptiveThreads)
        self.drafter, self.tree, self.verifier = drafter, tree, verifier
        self.use_graphs = use_graphs
        self.max_model_len = check_max_model_len(max_model_len, self.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.lookahead = 1 if self.tree is None else self.tree.size
        self.eos_ids = eos_token_ids(self.config, self.tokenizer)
        # The KV pages, scheduler and slot state are allocated on first use (`__getattr__`): an LLM whose
        # models a tool borrows (benchmarks build engines of their own) never holds a KV pool.
        self._pending_allocation = (kv_cache_memory, enable_prefix_caching, max_num_batched_tokens)
        self._requests: dict[str, _Request] = {}
        self._aborted: list[RequestDelta] = []
        self._ids = itertools.count()
        self._runners: dict[tuple, StepRunner] = {}
        self._cut_trees: dict[int, Tree] = {}  # self.tree cut to its first d + 1 levels (`_step_tree`)
        self.capture_s = 0.0  # one-time CUDA-graph captures (left out of request timings)
        self.num_steps = 0

    def _make_drafter(self, spec: SpeculativeConfig, dtype, device, draft_info, draft_weights: str = "auto",
                      execution: ExecutionConfig | None = None):
        """The drafter `spec` asks for; a draft model loads from `draft_info` (`inspect_model`: its
        tokenizer already checked against the target's) in the CPU format `draft_weights`."""
        from redwood.speculation.drafters import ModelDrafter, SelfDrafter

        policy = spec.make_policy()
        if spec.self_speculate:
            self.draft_name = f"self ({policy.describe()})"
            return SelfDrafter(self.model, policy)
        draft = load_model(draft_info, dtype=dtype, device=device, weights=draft_weights, draft=True,
                           execution=execution)
        if spec.draft_quant:
            draft.model.quantize_skinny(spec.draft_quant)
        packed = draft.model.weights if draft.model.weights != "float32" else None
        quant = "".join(f", {q} weights" for q in (spec.draft_quant, packed) if q)
        self.draft_name = f"{draft.source} ({policy.describe()}{quant})"
        return ModelDrafter(draft.model, policy, self.config.vocab_size)

    # ------------------------------------------------------------------ memory
    _LAZY = frozenset({"cache", "draft_cache", "pool", "scheduler", "sampler", "prev", "last", "buckets",
                       "num_pages"})

    def __getattr__(self, name: str):
        # (only reached for attributes not set yet)
        if name in Engine._LAZY and self.__dict__.get("_pending_allocation") is not None:
            args, self._pending_allocation = self._pending_allocation, None
            with torch.inference_mode(False):  # normal tensors: updated both inside steps and outside
                self._allocate(*args)
            return getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _allocate(self, kv_gib: float | None, prefix_caching: bool, prefill_tokens: int) -> None:
        models = [self.model] + ([self.drafter.own_model] if self.drafter is not None and
                                 self.drafter.own_model is not None else [])
        page_bytes = sum(2 * m.config.num_layers * m.config.num_kv_heads * m.config.head_dim * self.block_size
                         * m.dtype.itemsize for m in models)
        row_len = self.max_model_len + self.lookahead  # logical slots a row may touch
        per_row = -(-row_len // self.block_size)
        need = self.max_num_seqs * per_row
        device = self.model.device
        if kv_gib is not None:
            budget = int(kv_gib * 2**30)
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_KV_MEMORY_FRACTION)
        else:
            budget = int(CPU_KV_MEMORY_GIB * 2**30)
        num_pages = min(need, budget // page_bytes - 1)  # (one page more: the trash page)
        if num_pages < 1:
            raise ConfigError(f"the KV cache memory ({budget / 2**30:.3g} GiB) holds no {self.block_size}-token "
                              f"page ({page_bytes / 2**20:.3g} MiB); give kv_cache_memory more or a smaller block_size")
        self.num_pages = num_pages
        S = self.max_num_seqs
        self.cache = KVCache.paged(self.config, S, num_pages, self.block_size, row_len, self.model.dtype, device)
        self.draft_cache = None
        if len(models) > 1:
            d = models[1]
            self.draft_cache = KVCache.paged(d.config, S, num_pages, self.block_size, row_len, d.dtype, device)
            self.draft_cache.block_table = self.cache.block_table  # the same blocks, the draft's pages
            self.draft_cache.live = self.cache.live
        if self.drafter is not None:
            owner = self.drafter.own_model or self.model
            self.drafter.policy.allocate(S, owner.config.num_layers, owner.config.num_kv_heads, device)
        self.pool = BlockPool(num_pages, self.block_size, enable_prefix_cache=prefix_caching)
        self.scheduler = Scheduler(S, prefill_tokens, self.pool, self.lookahead, self.max_model_len,
                                   max_prefill_requests=S)
        self.sampler = Sampler.slots(S, device)
        self.prev = torch.zeros(S, dtype=torch.long, device=device)
        self.last = torch.zeros(S, dtype=torch.long, device=device)
        self.buckets = sorted({min(2**i, S) for i in range(S.bit_length() + 1)})

    # ------------------------------------------------------------------ requests
    def encode(self, prompt, chat: bool = False) -> list[int]:
        """Token ids for a text prompt (through the chat template when `chat`), or ids as given."""
        return encode_prompt(self.tokenizer, prompt, chat, self.model_name)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool = False) -> str:
        """Queue a request (text or token ids); returns its id. It joins the batch at a step boundary."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer; this model has none")
        if self.tree is not None:
            resolve_verifier(self.verifier, self.tree, params.greedy)  # (the greedy verifier: greedy only)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request_id = str(request_id)
        if request_id in self._requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt, chat)
        check_prompt_ids(ids, self.config.vocab_size, self.max_model_len)
        max_new = min(params.max_new_tokens, self.max_model_len - len(ids))
        state = RequestState(prompt_ids=list(ids), params=params, tokenizer=self.tokenizer, eos_ids=self.eos_ids,
                             max_new_tokens=max_new)
        state.stats.prompt_tokens = len(ids)
        if self.tree is not None:
            state.stats.spec = SpecStats(gamma=self.tree.max_depth - 1, drafted_per_step=self.tree.size - 1)
        seq = SeqState(request_id, list(ids), max_new)
        if self.drafter is not None:
            seq.prefix_limit = self.drafter.policy.prefix_limit(len(ids))
        self.scheduler.add(seq)  # (validates against the pool)
        self._requests[request_id] = _Request(seq, state, params, t_added=time.perf_counter())
        return request_id

    def abort(self, request_id: str, notify: bool = True) -> bool:
        """Stop a request now (its blocks are freed); its last delta (finish_reason "abort") comes with
        the next step unless notify is False. False if it is unknown or already finished."""
        rec = self._requests.get(str(request_id))
        if rec is None or not self.scheduler.abort(rec.seq.request_id):
            return False
        self._vacate(rec)
        del self._requests[rec.seq.request_id]
        rec.state.finish_reason = "abort"
        if notify:
            self._aborted.append(self._delta(rec))
        return True

    def prefill_remaining(self, request_ids) -> int:
        """Prompt tokens of these requests still to prefill (a request counts 0 once it has its first
        token, or when it is unknown or finished): what a driver shows progress over."""
        left = 0
        for rid in request_ids:
            rec = self._requests.get(str(rid))
            if rec is not None and rec.t_first is None:
                left += len(rec.seq.all_token_ids) - rec.seq.num_computed
        return left

    def has_unfinished(self) -> bool:
        if self.__dict__.get("_pending_allocation") is not None:
            return False  # (nothing was ever added)
        return self.scheduler.has_unfinished() or bool(self._aborted)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """Run one step; → the deltas of the requests that got tokens (or ended) in it."""
        out = self.scheduler.schedule()
        self.num_steps += 1
        deltas, self._aborted = self._aborted, []
        for seq in out.preempted:
            rec = self._requests[seq.request_id]
            rec.seed_state = self.sampler.random.state(rec.slot)
            self._vacate(rec)
        for seq in out.admitted:
            self._admit(self._requests[seq.request_id])
        self._sync_tables([*out.decode, *(c.request for c in out.prefill)])
        if out.decode:
            deltas += self._decode([self._requests[s.request_id] for s in out.decode])
        if out.prefill:
            deltas += self._prefill([(self._requests[c.request.request_id], c) for c in out.prefill])
        return deltas

    def _thread_exact_decode(self) -> bool:
        """Whether a decode step computes the same bits at any thread count: every forward it runs goes through
        the C++ layers (kquant-kind models; a standalone draft reading its full cache)."""
        from redwood.kv.policies import FullPolicy
        from redwood.models import cpu_fused

        d = self.drafter
        if d is not None and (d.own_model is None or not isinstance(d.policy, FullPolicy)
                              or not cpu_fused.model_takes(d.own_model)):
            return False
        return cpu_fused.model_takes(self.model)

    def _admit(self, rec: _Request) -> None:
        seq, row = rec.seq, rec.seq.slot
        rec.slot = row
        self.sampler.set_row(row, rec.params, rec.seed_state)
        self.cache.lengths[row] = seq.num_computed  # (prefix-cache hits): scratch writes go past them
        if self.draft_cache is not None:
            self.draft_cache.lengths[row] = seq.num_computed
        target_obs = draft_obs = None
        if self.drafter is not None:
            obs = self.drafter.policy.admit(row, seq.prefill_len)
            if self.drafter.own_model is None:
                target_obs = obs
            else:
                draft_obs = obs
        rec.observers = (target_obs, draft_obs)

    def _vacate(self, rec: _Request) -> None:
        """Free the request's slot on the device: every later forward of that row reads and writes nothing
        of anyone's (trash page, live 0)."""
        row = rec.slot
        if row is None:
            return
        self.cache.block_table[row] = self.cache.trash_page
        self.cache.live[row] = 0
        self.cache.lengths[row] = 0
        if self.draft_cache is not None:
            self.draft_cache.lengths[row] = 0
        rec.slot = None
        rec.synced = 0

    def _sync_tables(self, seqs: list[SeqState]) -> None:
        """Copy grown block tables into the device table (only the new entries)."""
        for seq in seqs:
            rec = self._requests[seq.request_id]
            blocks = seq.block_table.blocks
            done = rec.synced
            if len(blocks) > done:
                self.cache.block_table[rec.slot, done:len(blocks)] = torch.tensor(
                    blocks[done:], dtype=torch.int32).to(self.cache.block_table.device, non_blocking=True)
                rec.synced = len(blocks)

    def _prefill(self, work: list[tuple[_Request, object]]) -> list[RequestDelta]:
        """This step's prefill chunks: observed ones (SnapKV) one request at a time, the others in one
        batch; a chunk that ends its prefill samples the request's first token."""
        if self.thread_policy is not None:
            set_threads(self.thread_policy.base)  # (prefill's gemm paths may round differently at other counts)
        t0 = time.perf_counter()
        logits: dict[int, torch.Tensor] = {}
        plain = [(i, rec, c) for i, (rec, c) in enumerate(work) if rec.observers == (None, None)]
        for i, (rec, c) in enumerate(work):
            if rec.observers != (None, None):
                logits[i] = self._prefill_one(rec, c)
        if plain:
            rows = [rec.slot for _, rec, _ in plain]
            ids = [rec.seq.all_token_ids[:rec.seq.prefill_len] for _, rec, _ in plain]
            starts = [c.start for _, _, c in plain]
            stops = [c.start + c.length for _, _, c in plain]
            out = prefill_rows(self.model, self.cache, rows, ids, starts, stops)
            if self.draft_cache is not None:
                prefill_rows(self.drafter.own_model, self.draft_cache, rows, ids, starts, stops)
            for k, (i, _, _) in enumerate(plain):
                logits[i] = out[k]
        spent = (time.perf_counter() - t0) / len(work)  # (the step's prefill time, shared)
        deltas = []
        for i, (rec, chunk) in enumerate(work):
            rec.state.stats.prefill_s += spent
            seq, row = rec.seq, rec.slot
            if not chunk.is_last:
                self.scheduler.update_after_step(seq, chunk.length)
                continue
            for obs in rec.observers:
                if obs is not None:
                    obs.finish()
            rec.observers = (None, None)
            token = int(self.sampler.view(row, row + 1, [rec.params]).sample(logits[i][None])[0])
            self.prev[row] = seq.all_token_ids[seq.prefill_len - 1]
            self.last[row] = token
            self.cache.live[row] = 1
            if rec.t_first is None:
                rec.t_first, rec.capture_at_first = time.perf_counter(), self.capture_s
            lp = None
            if rec.params.logprobs is not None:
                at = torch.tensor([[token]], device=logits[i].device)
                chosen, top_v, top_i = (t[0].tolist() for t in token_logprobs(logits[i][None, None], at))
                lp = token_logprob_list([token], chosen, top_v, top_i, rec.params.logprobs)
            deltas.append(self._emit(rec, [token], [SOURCE_TARGET], lp, prefill=chunk))
            if rec.seq.status.finished:
                self._vacate(rec)
        return deltas

    def _prefill_one(self, rec: _Request, chunk) -> torch.Tensor | None:
        """A chunk of one request whose prefill is observed (SnapKV), alone; → its last logits."""
        seq, row = rec.seq, rec.slot
        ids = seq.all_token_ids[:seq.prefill_len]
        stop = chunk.start + chunk.length
        target_obs, draft_obs = rec.observers
        logits = prefill_row(self.model, self.cache.row(row), ids, chunk.start, stop, target_obs,
                             want_logits=chunk.is_last)
        if self.draft_cache is not None:
            prefill_row(self.drafter.own_model, self.draft_cache.row(row), ids, chunk.start, stop, draft_obs)
        return logits

    def _emit(self, rec: _Request, tokens: list[int], sources: list[str],
              logprobs: list[TokenLogprob] | None = None, prefill=None, spec_step=None) -> RequestDelta:
        """Give the request its new tokens (up to a stop) with their sources (and logprobs, when it asked)
        and tell the scheduler (which frees its blocks when it finishes; the caller vacates its slot
        once the step's commits are done). spec_step: (accepted, drafted) of the speculative step that
        made the tokens, recorded with the count kept (before a last delta carries the stats)."""
        state, seq = rec.state, rec.seq
        kept = []
        for i, tok in enumerate(tokens):
            kept.append(tok)
            if state.append(tok, sources[i], None if logprobs is None else logprobs[i]):
                break
        if spec_step is not None:
            state.stats.spec.record(spec_step[0], emitted=len(kept), drafted=spec_step[1])
        stopped = state.finish_reason == "stop"
        if prefill is not None:
            self.scheduler.update_after_step(seq, prefill.length, kept, stopped=stopped)
        else:
            self.scheduler.update_after_step(seq, len(kept), kept, stopped=stopped)
        if seq.status.finished:
            if state.finish_reason is None:  # the scheduler's length limits
                state.finish_reason = state.length_reason()
            now = time.perf_counter()
            state.stats.decode_s = now - (rec.t_first or now) - (self.capture_s - rec.capture_at_first)
            del self._requests[seq.request_id]
        return self._delta(rec)

    def _delta(self, rec: _Request) -> RequestDelta:
        state, sent = rec.state, rec.sent
        rec.sent = len(state.output_ids)
        done = state.finish_reason is not None
        text, spans = state.pop_delta_spans()
        logprobs = None if rec.params.logprobs is None else state.output_logprobs[sent:]
        return RequestDelta(rec.seq.request_id, state.output_ids[sent:], text, state.finish_reason,
                            state.stats.to_dict() if done else None, state.prompt_ids if done else None,
                            sources=state.output_sources[sent:], logprobs=logprobs, spans=spans)

    # ------------------------------------------------------------------ decoding
    def _step_tree(self, recs: list[_Request], graphed: bool, greedy: bool):
        """The tree this step drafts: the engine's, cut to the levels its rows can still emit — a step
        emits at most depth tokens, so with every row k tokens from its limit, drafting past k − 1 tokens
        is waste (`--gamma 60 --max-new-tokens 8` drafting 60). With one token left for every row, None:
        a plain autoregressive step, no draft forward (every row ends with this step, so no draft
        cache needs its token; it is no speculation step in the stats, as vLLM counts only drafts).
        Only eager steps of greedy rows are cut: a graphed step replays one CUDA graph per tree, and a
        cut tree at every request's tail would capture new ones; and a sampled row's random draws
        follow the tree's shape, so a cut decided by its batch's rows would make its seeded output
        depend on what runs beside it (greedy output depends on nothing but the target)."""
        tree = self.tree
        if tree is None or graphed or not greedy:
            return tree
        depth = max(r.state.max_new_tokens - len(r.state.output_ids) for r in recs) - 1  # draft levels kept
        if depth >= tree.max_depth - 1:
            return tree
        if depth < 1:
            return None
        cut = self._cut_trees.get(depth)
        if cut is None:  # the first depth + 1 levels (nodes are numbered breadth-first: a prefix)
            cut = self._cut_trees[depth] = Tree(tree.parents[:tree.levels[depth].stop])
        return cut

    def _runner(self, role: str, n: int) -> StepRunner:
        key = (role, n)
        runner = self._runners.get(key)
        if runner is None:
            from redwood.engine.offload import get_offload

            if role == "target":
                model, cache = self.model, self.cache
            else:
                model, cache = self.drafter.own_model, self.draft_cache
            graphs = self.use_graphs and get_offload(model) is None
            runner = StepRunner(model, cache.rows(n), use_graphs=graphs)
            self._runners[key] = runner
        return runner

    @staticmethod
    def _logprob_rows(recs: list[_Request], lp: tuple[torch.Tensor, ...]) -> dict[int, tuple[list, list, list]]:
        """The step's `token_logprobs` output on the host, for the rows whose requests asked:
        {slot: (chosen [A], top values [A][20], top ids [A][20])} (only those rows are copied)."""
        rows = [r.slot for r in recs if r.params.logprobs is not None]
        idx = torch.tensor(rows).to(lp[0].device)
        chosen, top_v, top_i = (t.index_select(0, idx).tolist() for t in lp)
        return {b: (chosen[k], top_v[k], top_i[k]) for k, b in enumerate(rows)}

    def _decode(self, recs: list[_Request]) -> list[RequestDelta]:
        rows = [r.slot for r in recs]
        n = next(b for b in self.buckets if b > max(rows))
        active = [r.params for r in recs]
        sampler = self.sampler.view(0, n, active)
        want_lp = any(p.logprobs is not None for p in active)  # (a step without them computes none)
        target = self._runner("target", n)
        draft = self._runner("draft", n) if self.draft_cache is not None else None
        tree = self._step_tree(recs, target.use_graphs, sampler.all_greedy)
        policy, shape = self.thread_policy, (n, 1 if tree is None else tree.size)
        if policy is not None:
            count = policy.for_step(shape)
            set_threads(count)
        if tree is None:
            kind = "ar"
            build = lambda: ARStep(target, sampler, want_lp)  # noqa: E731
        else:
            kind = resolve_verifier(self.verifier, tree, sampler.all_greedy)
            build = lambda: SpecStep(self.model, target, draft, self.drafter, tree, kind, sampler,  # noqa: E731
                                     want_lp)
        saved = sampler.random.counter.clone()

        def captures() -> float:  # graph-capture seconds of this bucket's runners so far (one-time costs)
            return target.capture_s + (draft.capture_s if draft is not None else 0.0)

        t_draft = None
        t0 = time.perf_counter()
        capture0 = captures()
        prev, last = self.prev[:n], self.last[:n]
        if target.use_graphs:
            key = (kind, sampler.all_greedy, sampler.any_greedy, sampler.any_filter, want_lp,
                   None if self.drafter is None else self.drafter.graph_key())
            captured = target.captured_step(key, build, (prev, last), restore=sampler.random.checkpoint)
            path, accepted, nxt, new_prev, host, lp = captured.replay(prev, last)
        elif tree is None:
            path, accepted, nxt, new_prev, host, lp = build()(prev, last)
        else:  # eager: the draft and the verification timed apart
            step = build()
            tokens, q = step.draft(prev, last)
            sync(self.model.device)
            t_draft = time.perf_counter()
            draft_capture_s = captures() - capture0
            path, accepted, nxt, new_prev, host, lp = step.verify(tokens, q)
        host_list = host.tolist()  # the step's one host synchronization
        lp_rows = self._logprob_rows(recs, lp) if want_lp else {}
        # Rows that did not generate keep their random counters (their draws are discarded).
        generating = torch.zeros(n, dtype=torch.bool)
        generating[rows] = True
        generating = generating.to(self.prev.device)
        sampler.random.counter.copy_(torch.where(generating, sampler.random.counter, saved))
        self.prev[:n] = torch.where(generating, new_prev, prev)
        self.last[:n] = torch.where(generating, nxt, last)
        t1 = time.perf_counter()
        if policy is not None:
            policy.record(count, shape, t1 - t0)
        captured_s = captures() - capture0
        self.capture_s += captured_s
        kept = [0] * n
        deltas, done = [], []
        for rec in recs:
            b = rec.slot
            a, nxt_b, path_b = host_list[b][0], host_list[b][1], host_list[b][2:]
            spec = rec.state.stats.spec
            if spec is not None:
                spec.step_s += (t1 - t0) - captured_s
                if t_draft is not None:
                    spec.draft_s += t_draft - t0 - draft_capture_s
                    spec.verify_s += t1 - t_draft - (captured_s - draft_capture_s)
            before = len(rec.state.output_ids)
            emitted = path_b[1:a + 1] + [nxt_b]
            lp_b = lp_rows.get(b)
            if lp_b is not None:
                lp_b = token_logprob_list(emitted, *lp_b, rec.params.logprobs)
            # (a step without drafts — a lone root, or AR at a request's end — is no speculation step)
            deltas.append(self._emit(rec, emitted, [SOURCE_DRAFT] * a + [SOURCE_TARGET], lp_b,
                                     spec_step=None if tree is None or tree.size == 1 else (a, tree.size - 1)))
            if rec.seq.status.finished:
                done.append(rec)  # (its row commits nothing; vacated below)
            else:
                kept[b] = len(rec.state.output_ids) - before
        kept_t = torch.tensor(kept).to(self.prev.device)
        cache = target.cache
        if tree is not None and not tree.is_chain:
            cache.compact(path, kept_t)
        if self.drafter is not None and tree is not None:  # (rows that did not generate commit nothing;
            # an AR step at the rows' end has no draft to commit: they all finish with it)
            self.drafter.commit(draft, path, torch.where(generating, accepted + 1, 0))
        cache.commit(kept_t)
        for rec in done:
            self._vacate(rec)
        return deltas

