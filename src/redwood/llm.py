"""The Python API, shaped like vLLM's: `LLM(model=...)` then `llm.generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from redwood.config import ExecutionConfig
from redwood.engine.engine import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, Engine, engine_config  # noqa: F401 (re-exported)
from redwood.engine.request import TokenLogprob
from redwood.errors import ConfigError, ContextLengthError
from redwood.loading import parse_device
from redwood.progress import Progress
from redwood.sampling_params import SamplingParams
from redwood.speculation.config import SpeculativeConfig

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    """The result for one prompt: generated text and token ids (the prompt excluded), and stats."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" (max_new_tokens) or "context" (the model's context filled first)
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # per token, when SamplingParams.logprobs asked for them


@dataclass
class StreamDelta:
    """A piece of one request's output as it is generated (`index` = position in the prompt list)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict | None = None  # set on the request's last delta
    sources: list[str] = field(default_factory=list)  # per token: "draft" | "target" (see RequestDelta)
    logprobs: list[TokenLogprob] | None = None  # per token, when SamplingParams.logprobs asked for them
    spans: list[tuple[str, str]] = field(default_factory=list)  # text as (piece, source) per token


class LLM:
    """A loaded model ready to generate: a thin driver of its `Engine` (`llm.engine`).

    model: a zoo name (`redwood models list`), a Hugging Face folder, or a .gguf file (or their
    `redwood.loading.inspect_model` ModelInfo: its tokenizer is used, not loaded again).
    dtype: "float32" | "bfloat16" | "float16"; device: "cpu" | "cuda".
    speculative: a SpeculativeConfig (draft model or self-speculation, draft KV policy, γ, verifier);
    None decodes autoregressively. Either way the output is the target model's.
    offload: keep the target's decoder-layer weights in (pinned) host memory and stream them to the
    device, `offload_prefetch` layers at a time (see `redwood.models.offload`).
    cuda_graphs: capture each step shape in a CUDA graph, once per batch bucket (`redwood.engine.runner`);
    None → on for CUDA. An offloaded target always runs eagerly; a draft model next to it still runs graphed.
    engine_args: the Engine's scheduling and memory knobs (max_num_seqs, max_model_len, block_size,
    max_num_batched_tokens, kv_cache_memory, enable_prefix_caching, prefill_first) and sampling_noise (what seeded draws
    are keyed by: "position" or "counter"); see `redwood.config.EngineConfig`.
    threads: torch's CPU threads (None: OMP_NUM_THREADS when set, else the measured default; see
    `redwood.engine.threads`).
    weights: the CPU weight format of the target ("auto" for a GGUF file on the CPU: "kquant" — the file's
    Q4_K / Q6_K / Q8_0 / Q5_0 blocks × int8 activations, its other types w8a8 — where the kquant kernel builds (a C++
    compiler; a build for AVX-512 VNNI, AVX2 or any CPU: `redwood.cpu_kernels.kquant`), else "w8a8" — int8 weights × int8 activations — where the CPU's int8 sums are exact,
    else "gguf", the file's own 4-bit grid as int4 and its other types int8; float32 for other checkpoints;
    "float32" | "bfloat16" | "int8" | "int4" | "w8a8" | "q4k" | "gguf" | "kquant"; see
    `redwood.models.cpu_weights.gguf_default`). A draft model's format: `SpeculativeConfig.draft_weights`.
    execution: how the models' forwards run (`redwood.config.ExecutionConfig`: megakernel,
    prefill kernel, CPU fused layers, adaptive threads, …; None: the defaults).
    tensor_parallel_size (an engine_args field): shard the models over N ranks (`redwood.parallel`): this
    process is rank 0 and spawns ranks 1 … N−1 (gloo on the CPU, NCCL on CUDA), which replay its engine calls
    (`redwood.engine.tp_worker`). Under `torchrun --nproc_per_node N` every process runs the script: N comes
    from torchrun, rank 0's LLM returns and drives, and on the other ranks `LLM(...)` serves rank 0 and ends the
    process when rank 0's ends. Float weights only (weights "auto" → "float32").
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        speculative: SpeculativeConfig | None = None,
        offload: bool = False,
        offload_prefetch: int = 2,
        cuda_graphs: bool | None = None,
        threads: int | None = None,
        weights: str = "auto",
        execution: ExecutionConfig | None = None,
        **engine_args,
    ):
        from redwood.engine.tp_launch import load_models, with_torchrun_size

        self.engine_config = engine_config(cuda_graphs=cuda_graphs, **with_torchrun_size(engine_args))
        if cuda_graphs and parse_device(device).type != "cuda":
            raise ConfigError("cuda_graphs needs device='cuda'")
        load = dict(
            dtype=dtype,
            device=device,
            speculative=speculative,
            offload=offload,
            offload_prefetch=offload_prefetch,
            threads=threads,
            weights=weights,
            execution=execution,
        )
        self.models = load_models(model, load, self.engine_config)  # (a torchrun rank > 0 never returns)
        self.tp = self.models.tp  # rank 0's tensor-parallel group, or None
        m = self.models
        self.model, self.tokenizer, self.config = m.model, m.tokenizer, m.config
        self.model_name, self.model_path = m.name, m.path
        self.speculative, self.drafter, self.draft_name, self.tree = m.speculative, m.drafter, m.draft_name, m.tree
        self._engine: Engine | None = None
        if self.tp is not None:
            self._engine = Engine(self.models, self.engine_config)  # (now: the ranks serve this one from the start)
        self._calls = itertools.count()

    def close(self) -> None:
        """Release the tensor-parallel ranks (they exit); nothing for one process. Also done at exit."""
        if self._engine is not None and self._engine._driver is not None:
            self._engine._driver.close()

    @property
    def engine(self) -> Engine:
        """The LLM's Engine, built (and its KV cache sized) on first use: tools that only borrow the loaded
        models for engines of their own (`bench speculative`, `bench throughput`) leave the memory to those."""
        if self._engine is None:
            self._engine = Engine(self.models, self.engine_config)
        return self._engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self._engine = engine

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids for a text prompt (through the chat template when `chat`), or ids as given."""
        return self.engine.encode(prompt, chat)

    def _add(self, prompts, params, chat) -> tuple[list, list[str]]:
        """Queue every prompt (all or none: a bad one aborts those queued before it) → (prompts, ids)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ConfigError("no prompts given")
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        call = next(self._calls)
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                try:
                    ids.append(self.engine.add_request(prompt, p, request_id=f"llm{call}-{i}", chat=chat))
                except ContextLengthError as e:
                    raise type(e)(f"prompt {i}: {e}") from None
        except BaseException:
            for rid in ids:
                self.engine.abort(rid, notify=False)
            raise
        return prompts, ids

    def _steps(self, ids: list[str]):
        """engine.step() until the caller stops asking, with a progress bar over the requests' prefill
        when it takes more than one step (prompts past max_num_batched_tokens: an 8K-token prompt on
        the CPU prefilled ~96 s with no sign of life)."""
        left = self.engine.prefill_remaining(ids)
        bar = None
        if left > self.engine.max_num_batched_tokens:
            bar = Progress(total=left, desc="prefill", unit="tokens")
        try:
            while True:
                deltas = self.engine.step()
                if bar is not None:
                    now = self.engine.prefill_remaining(ids)
                    bar.update(left - now)
                    left = now
                    if left == 0:
                        bar.close()
                        bar = None
                yield deltas
        finally:
            if bar is not None:
                bar.close()

    # ------------------------------------------------------------------ generation
    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> Iterator[StreamDelta]:
        """Yield each request's new text and tokens as they are generated."""
        _, ids = self._add(prompts, params, chat)
        index = {rid: i for i, rid in enumerate(ids)}
        left = set(ids)
        steps = self._steps(ids)
        try:
            while left:
                for d in next(steps):
                    if d.request_id in index:
                        if d.finish_reason is not None:
                            left.discard(d.request_id)
                        yield StreamDelta(
                            index=index[d.request_id],
                            text=d.text,
                            token_ids=d.token_ids,
                            finish_reason=d.finish_reason,
                            stats=d.stats,
                            sources=d.sources,
                            logprobs=d.logprobs,
                            spans=d.spans,
                        )
        finally:  # a consumer that stops early (or an error) leaves nothing running
            steps.close()
            for rid in left:
                self.engine.abort(rid, notify=False)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuously batched); one RequestOutput per prompt, in order."""
        prompt_list, ids = self._add(prompts, params, chat)
        outs: list[RequestOutput | None] = [None] * len(ids)
        tokens: list[list[int]] = [[] for _ in ids]
        logprobs: list[list[TokenLogprob] | None] = [None for _ in ids]
        texts: list[list[str]] = [[] for _ in ids]
        index = {rid: i for i, rid in enumerate(ids)}
        left = len(ids)
        steps = self._steps(ids)
        try:
            while left:
                for d in next(steps):
                    i = index.get(d.request_id)
                    if i is None:
                        continue
                    tokens[i] += d.token_ids
                    if d.logprobs is not None:
                        logprobs[i] = logprobs[i] or []
                        logprobs[i] += d.logprobs
                    texts[i].append(d.text)
                    if d.finish_reason is not None:
                        p = prompt_list[i]
                        outs[i] = RequestOutput(
                            prompt=p if isinstance(p, str) else None,
                            prompt_token_ids=d.prompt_token_ids,
                            text="".join(texts[i]),
                            token_ids=tokens[i],
                            finish_reason=d.finish_reason,
                            stats=d.stats or {},
                            logprobs=logprobs[i],
                        )
                        left -= 1
        finally:
            steps.close()
            if left:
                for rid, i in index.items():
                    if outs[i] is None:
                        self.engine.abort(rid, notify=False)
        return outs
