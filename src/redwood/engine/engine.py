"""The Engine: one step-level loop with continuous batching over a paged KV cache.

    engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", speculative=SpeculativeConfig(...))
    engine.add_request("def fib(n):", SamplingParams(max_new_tokens=64), request_id="a")
    while engine.has_unfinished():
        for delta in engine.step():        # RequestDelta(request_id, token_ids, text, finish_reason, stats,
            ...                            #   ..., sources, logprobs, spans: per-token outputs)

A step, for every method (nano-vllm's / vLLM v1's shape):

    batch = scheduler.schedule()         which rows decode, which prefill chunks run within the step's
                                         token budget, which requests are preempted (no tensors)
    result = executor.execute(work)      the device work: one autoregressive or draft → verify step over
                                         the decoding rows; the prefill chunks (`executor`)
    updates = output.process(result)     tokens to requests up to a stop, stats (`output`)
    scheduler.update(updates)            lengths, length limits; finished requests' blocks freed
    executor.commit(kept)                the decoding rows' KV: what each row keeps (0 once finished)
    deltas = output.deltas(updates)      what the step returns

Requests join at step boundaries; a row that finishes is refilled at the next one. The Engine owns the
models it is given (`LoadedModels`: several engines may share them), builds its `Executor` (which sizes its
KV cache now, within `EngineConfig`'s memory share), a `BlockPool` over those pages and the `Scheduler`.
Under tensor parallelism every rank runs this engine over its shards in lockstep, rank 0 forwarding its calls
(`engine.tp_worker`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import torch

from redwood.config import EngineConfig
from redwood.devices import free_memory
from redwood.engine.batch import DecodeRow, PrefillWork, StepBatch
from redwood.engine.calibrate import cost_key, load_or_calibrate
from redwood.engine.decode import resolve_verifier
from redwood.engine.executor import Executor
from redwood.engine.loaded import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, LoadedModels  # noqa: F401 (re-exported)
from redwood.engine.output import OutputProcessor, Request, RequestDelta, Update, delta  # noqa: F401
from redwood.engine.request import RequestState, SpecStats
from redwood.engine.scheduler import Scheduler, SeqState
from redwood.engine.step_clock import StepClock
from redwood.engine.threads import set_threads
from redwood.engine.tokenization import check_max_model_len, check_prompt_ids, encode_prompt, eos_token_ids  # noqa: F401
from redwood.engine.tp_worker import share_plan
from redwood.errors import ConfigError
from redwood.kv.blocks import BlockPool
from redwood.loading import ModelInfo, parse_device
from redwood.sampling_params import SamplingParams
from redwood.speculation.costs import CostModel
from redwood.speculation.costs_cache import costs_path
from redwood.speculation.policy import LONGEST_GAMMA, AutoPolicy, FixedPolicy, family_of
from redwood.speculation.trees import Tree


class Engine:
    """Loaded models serving requests step by step: `Engine(models, config)` over `LoadedModels`, or
    `Engine.from_pretrained(model, ...)` (loads them; the arguments as `redwood.LLM`'s), or
    `Engine.build(model, tokenizer, drafter=..., tree=..., **config)` over models already in memory."""

    def __init__(self, models: LoadedModels, config: EngineConfig | None = None, *, speculate: bool = True):
        """speculate False: plain decoding over models loaded for speculation (their drafters stay loaded,
        unused) — what a benchmark's AR baseline runs over the same load."""
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.loaded = models  # (everything loaded; `models` is what this engine runs)
        self.models = models if speculate else models.without_drafters()
        self.engine_config = config
        models = self.models
        self._closed = False
        self._driver = _tensor_parallel_driver(models, config)  # rank 0 under tensor parallelism, else None
        self.max_model_len = check_max_model_len(config.max_model_len, models.config.max_position_embeddings)
        self.eos_ids = eos_token_ids(models.config, models.tokenizer)
        self.policy = make_policy(models)
        self.executor = Executor(models, config, self.max_model_len, self.policy)
        if self.policy.auto:
            self.policy.graphs = self.executor.use_graphs
            # (on a GPU the last step's shadow scoring runs inside the next step, while the device works on it)
            self.policy.defer_scoring = self.executor.device_runs_ahead
            self.policy.costs = CostModel(self._calibrated_costs())
        self.pool = BlockPool(
            self.executor.num_pages, config.block_size, enable_prefix_cache=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.pool,
            self.executor.lookahead,
            self.max_model_len,
            max_prefill_requests=config.max_num_seqs,
            prefill_first=config.prefill_first,
        )
        self._requests: dict[str, Request] = {}
        self.output = OutputProcessor(self._requests, self.executor)
        self._aborted: list[RequestDelta] = []
        self._ids = itertools.count()
        self.num_steps = 0
        self.clock = StepClock()  # where the pure decoding steps' wall time goes (bench reports it)

    def _calibrated_costs(self):
        """The automatic policy's cost table (`engine.calibrate`), measured at the thread count decode steps
        start at (the CPU's adaptive count, `engine.threads`), then back to the prefill's."""
        own = self.drafter.own_model if self.drafter is not None else None
        threads = self.executor.thread_policy
        if threads is not None:
            set_threads(threads.current)
        try:
            tp = self.models.tp
            key = cost_key(self.model, own, tensor_parallel=1 if tp is None else tp.world)
            table = load_or_calibrate(self.model, own, self.max_model_len, tp=tp)
        finally:
            if threads is not None:
                set_threads(threads.base)
        self.policy.costs_path = costs_path(key)
        return table

    @classmethod
    def from_pretrained(cls, model: str | Path | ModelInfo = DEFAULT_MODEL, **settings) -> "Engine":
        """Load the models, then build the engine. `settings`: `LoadedModels.load`'s arguments (dtype, device,
        speculative, offload, offload_prefetch, threads, weights, execution) and `EngineConfig`'s fields."""
        from redwood.engine.tp_launch import load_models, with_torchrun_size

        load = {k: settings.pop(k) for k in LOAD_ARGS if k in settings}
        config = engine_config(**with_torchrun_size(settings))
        if config.cuda_graphs and parse_device(load.get("device", "cpu")).type != "cuda":
            raise ConfigError("cuda_graphs needs device='cuda'")
        return cls(load_models(model, load, config), config)  # (tensor parallel: rank 0's; the others serve it)

    @classmethod
    def build(
        cls,
        model,
        tokenizer=None,
        *,
        drafter=None,
        tree=None,
        verifier: str = "auto",
        model_name: str = "model",
        auto_drafters: list | None = None,
        **config,
    ) -> "Engine":
        """An Engine over a target `Transformer` already loaded (and a `Drafter` with its `Tree`, or
        `auto_drafters`: the drafters the automatic policy chooses from, the one with a cache or KV policy of
        its own first): what tools holding models (benchmarks, tests) use instead of loading them again."""
        config = engine_config(**config)
        models = LoadedModels.of(model, tokenizer, drafter=drafter, tree=tree, verifier=verifier, name=model_name)
        if auto_drafters:
            if drafter is not None or tree is not None:
                raise ConfigError("give drafter + tree (a fixed plan) or auto_drafters, not both")
            models.drafter, models.tree = auto_drafters[0], Tree.chain(LONGEST_GAMMA)
            models.auto_drafters = list(auto_drafters)
            models.draft_name = "auto"
        return cls(models, config)

    def rebuild(
        self, *, speculate: bool = True, tree: Tree | None = None, verifier: str | None = None, **config
    ) -> "Engine":
        """A new engine over this one's loaded models — plain decoding when `speculate` is False; the loaded
        drafter over `tree` with `verifier` when given — with `config` (`EngineConfig`'s fields; the
        tensor-parallel size is this one's). This engine is closed first (its KV cache freed before the new one
        sizes its own) and refuses calls after. Under tensor parallelism every rank rebuilds alike: the way a
        benchmark runs AR and speculation, at several trees, over one sharded load."""
        self._check_open()
        fields = {**config, "tensor_parallel_size": self.tensor_parallel_size}
        new_config = engine_config(**fields)  # (validated before any rank rebuilds)
        loaded = self.loaded
        if tree is not None or verifier is not None:
            if loaded.drafter is None or loaded.auto_drafters:
                raise ConfigError("a tree or verifier needs models loaded with one drafter (not the automatic policy)")
            loaded = dataclasses.replace(
                loaded,
                tree=loaded.tree if tree is None else tree,
                verifier=loaded.verifier if verifier is None else verifier,
                speculative=None,
            )
        if self._driver is not None:
            self._driver.send("rebuild", speculate, tree, verifier, fields)
        self.close()
        engine = Engine(loaded, new_config, speculate=speculate)
        engine.loaded = self.loaded  # (the next rebuild starts from what was loaded, not this tree)
        return engine

    def close(self) -> None:
        """Free this engine's KV cache and executor state now (the models stay loaded: another engine may
        serve them, `rebuild`); any call after is refused."""
        if self._closed:
            return
        self._closed = True
        if self._driver is not None:
            self._driver.release()
        self.executor = self.pool = self.scheduler = self.output = None
        self._requests = {}
        free_memory(self.model.device)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this engine was closed (Engine.rebuild returns the one that replaced it)")

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The target's logits after `token_ids` from one fresh forward (batch 1, a cache of its own, this
        engine's pool untouched) → [vocab] float32 — what a benchmark asks at a greedy parting. Under tensor
        parallelism every rank runs it (the forward's collectives)."""
        from redwood.engine.prefill import fresh_logits

        self._check_open()
        ids = [int(t) for t in token_ids]
        if self._driver is not None:
            self._driver.send("prompt_logits", ids)
        return fresh_logits(self.model, ids)

    # ------------------------------------------------------------------ what the engine holds
    model = property(lambda self: self.models.model)
    tokenizer = property(lambda self: self.models.tokenizer)
    config = property(lambda self: self.models.config)  # the target's ModelConfig
    model_name = property(lambda self: self.models.name)
    model_path = property(lambda self: self.models.path)
    drafter = property(lambda self: self.models.drafter)
    tree = property(lambda self: self.models.tree)
    verifier = property(lambda self: self.models.verifier)
    draft_name = property(lambda self: self.models.draft_name)
    speculative = property(lambda self: self.models.speculative)
    max_num_seqs = property(lambda self: self.engine_config.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.engine_config.max_num_batched_tokens)
    block_size = property(lambda self: self.engine_config.block_size)
    use_graphs = property(lambda self: self.executor.use_graphs)
    capture_s = property(lambda self: self.executor.capture_s)  # one-time CUDA-graph captures, kernel compiles
    cache = property(lambda self: self.executor.cache)
    draft_cache = property(lambda self: self.executor.draft_cache)

    # ------------------------------------------------------------------ requests
    def encode(self, prompt, chat: bool = False) -> list[int]:
        """Token ids for a text prompt (through the chat template when `chat`), or ids as given."""
        return encode_prompt(self.tokenizer, prompt, chat, self.model_name)

    def add_request(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None, chat: bool = False
    ) -> str:
        """Queue a request (text or token ids); returns its id. It joins the batch at a step boundary."""
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer; this model has none")
        if self.tree is not None:
            # (the greedy verifier: greedy only)
            resolve_verifier(self.verifier, self.tree, params.greedy, deterministic=self.drafter.deterministic_children)
        request_id = str(f"req-{next(self._ids)}" if request_id is None else request_id)
        if request_id in self._requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt, chat)
        check_prompt_ids(ids, self.config.vocab_size, self.max_model_len)
        max_new = min(params.max_new_tokens, self.max_model_len - len(ids))
        state = RequestState(
            prompt_ids=list(ids), params=params, tokenizer=self.tokenizer, eos_ids=self.eos_ids, max_new_tokens=max_new
        )
        state.stats.prompt_tokens = len(ids)
        if self.tree is not None:
            state.stats.spec = SpecStats(
                gamma=self.tree.max_depth - 1,
                drafted_per_step=self.tree.size - 1,
                policy="auto" if self.policy.auto else "fixed",
            )
        seq = SeqState(request_id, list(ids), max_new)
        seq.sure_new_tokens = max_new if params.ignore_eos and not params.stop else 0
        if self.drafter is not None:
            seq.prefix_limit = self.drafter.policy.prefix_limit(len(ids))
        self.scheduler.add(seq)  # (validates against the pool)
        self._requests[request_id] = Request(seq, state, params, t_added=time.perf_counter())
        if self._driver is not None:
            self._driver.send("add_request", ids, params, request_id)  # (checked here first: the ranks take it)
        return request_id

    def abort(self, request_id: str, notify: bool = True) -> bool:
        """Stop a request now (its blocks are freed); its last delta (finish_reason "abort") comes with
        the next step unless notify is False. False if it is unknown or already finished."""
        rec = self._requests.get(str(request_id))
        if rec is None or not self.scheduler.abort(rec.seq.request_id):
            return False
        if self._driver is not None:
            self._driver.send("abort", rec.seq.request_id, notify)
        self._vacate(rec)
        del self._requests[rec.seq.request_id]
        rec.state.finish_reason = "abort"
        if notify:
            self._aborted.append(delta(rec))
        return True

    def prefill_remaining(self, request_ids) -> int:
        """Prompt tokens of these requests still to prefill (a request counts 0 once it has its first
        token, or when it is unknown or finished): what a driver shows progress over."""
        left = 0
        for rid in request_ids:
            rec = self._requests.get(str(rid))
            if rec is not None and rec.t_first is None:
                left += rec.seq.num_tokens - rec.seq.num_computed
        return left

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine_config.tensor_parallel_size

    def check_ranks(self) -> None:
        """Under tensor parallelism, between steps: a `RankFailure` naming a rank that has ended (a driver idling
        — the server between requests — learns of it here, not only at its next step); else nothing."""
        if self._driver is not None:
            self._driver.check()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestDelta]:
        """Run one step; → the deltas of the requests that got tokens (or ended) in it."""
        self._check_open()
        if self._driver is None:
            return self._step()
        self._driver.send("step")
        try:
            return self._step()
        except BaseException:
            self._driver.abandon()  # (the other ranks may be mid-step: never wait on them again)
            raise

    @torch.inference_mode()
    def _step(self) -> list[RequestDelta]:
        clock = self.clock
        clock.start()
        out = self.scheduler.schedule()
        self.num_steps += 1
        decode, prefill, batch = self._place(out)
        clock.lap("schedule")
        plan, bucket, alongside = None, 0, None
        if batch.decode:
            bucket = self.executor.bucket(batch.decode)
            sched = self.scheduler
            plan = self.policy.plan(
                batch.decode, bucket, sched.prefill_backlog_steps(), backlog_decodes=sched.backlog_then_decodes()
            )
            if self.policy.auto and self.models.tp is not None:
                plan = share_plan(self.models.tp, self.policy, plan)  # (rank 0's: the one timed plan)
            alongside = self.policy.take_deferred()
        clock.lap("plan")
        result = self.executor.execute(batch, plan, alongside)
        clock.lap("execute")
        updates = self.output.process(batch, result, decode, prefill)
        clock.lap("output")
        if batch.decode:
            seconds = result.step_s - result.catch_up_s if result.timed else None
            self.policy.observe(
                batch.decode, result.plan, result.decode, seconds, bucket, result.catch_up_s, result.capture_s
            )
            for rec in decode:
                if rec.state.stats.spec is not None:
                    rec.state.stats.spec.count_plan(result.plan.name, plan.probe)
        clock.lap("policy")
        self._update_scheduler(updates)
        self.executor.commit({r.slot: 0 if r.seq.status.finished else u.num_computed for r, u in zip(decode, updates)})
        clock.lap("update")
        deltas, self._aborted = self._aborted + self.output.deltas(updates), []
        for u in updates:
            if u.request.seq.status.finished:
                self._vacate(u.request)
        clock.lap("deltas")
        clock.finish(bool(batch.decode) and not batch.prefill, result.step_s, result.capture_s + result.compile_s)
        return deltas

    def _place(self, out) -> tuple[list[Request], list[Request], StepBatch]:
        """Move the schedule onto the slots (preempted requests out — keeping their random streams —
        admitted ones in, grown block tables synced) → the step's decode and prefill requests and work."""
        for seq in out.preempted:
            rec = self._requests[seq.request_id]
            rec.random_state = self.executor.random_state(rec.slot)
            self._vacate(rec)
        for seq in out.admitted:
            rec = self._requests[seq.request_id]
            rec.slot = seq.slot
            self.executor.admit(rec.slot, rec.params, seq.num_computed, seq.prefill_len, rec.random_state)
        decode = [self._requests[s.request_id] for s in out.decode]
        prefill = [self._requests[c.request.request_id] for c in out.prefill]
        for rec in decode + prefill:
            self.executor.sync_table(rec.slot, rec.seq.block_table.blocks)
        batch = StepBatch(
            [
                DecodeRow(
                    r.slot,
                    r.params,
                    r.state.max_new_tokens - len(r.state.output_ids),
                    r.seq.all_token_ids,  # (the request's own list: no copy)
                    r.seq.num_computed,
                )
                for r in decode
            ],
            [
                PrefillWork(
                    r.slot, r.params, r.seq.all_token_ids[: r.seq.prefill_len], c.start, c.start + c.length, c.is_last
                )
                for r, c in zip(prefill, out.prefill)
            ],
        )
        return decode, prefill, batch

    def _update_scheduler(self, updates: list[Update]) -> None:
        for u in updates:
            if u.emits:
                self.scheduler.update_after_step(u.request.seq, u.num_computed, u.token_ids, stopped=u.stopped)
            else:
                self.scheduler.update_after_step(u.request.seq, u.num_computed)

    def _vacate(self, rec: Request) -> None:
        if rec.slot is not None:
            self.executor.vacate(rec.slot)
            rec.slot = None


def _tensor_parallel_driver(models: LoadedModels, config: EngineConfig):
    """Rank 0's `tp_worker.Driver` for models sharded over several ranks (None for one process, and on the other
    ranks: they replay the driver's calls). Such models serve one engine at a time (the ranks replay one call
    stream): another is built by `Engine.rebuild`, which closes the first on every rank."""
    tp = getattr(models, "tp", None)
    world = 1 if tp is None else tp.world
    if config.tensor_parallel_size != world:
        raise ConfigError(
            f"tensor_parallel_size {config.tensor_parallel_size}: these models are loaded "
            + ("in one process" if tp is None else f"over {world} ranks")
            + " (LLM(tensor_parallel_size=N) loads them sharded)"
        )
    if tp is None or tp.rank != 0:
        return None
    from redwood.engine.tp_worker import Driver

    return Driver.of(tp).claim()  # (one engine at a time: the ranks replay one call stream)


def make_policy(models: LoadedModels):
    """What plans the steps: the automatic policy over the models' drafters, or their fixed plan."""
    if models.auto_drafters:
        policy = AutoPolicy(models.auto_drafters)
        seed = models.speculative.seed_rates() if models.speculative is not None else None
        if seed is not None:
            rates, temperature = seed
            policy.acceptance.seed(family_of(models.auto_drafters[0]), temperature, rates)
        return policy
    return FixedPolicy(models.drafter, models.tree)


# LoadedModels.load's keyword arguments (the rest of from_pretrained's settings are EngineConfig's)
LOAD_ARGS = ("dtype", "device", "speculative", "offload", "offload_prefetch", "threads", "weights", "execution")


def engine_config(**fields) -> EngineConfig:
    """An EngineConfig from keyword arguments (a ConfigError naming an unknown one)."""
    moved = [name for name in ("draft_weights", "draft_quant") if name in fields]
    if moved:
        raise ConfigError(
            f"{moved[0]} is not an engine setting: draft_weights moved to SpeculativeConfig(draft_weights=...)"
        )
    unknown = sorted(set(fields) - set(EngineConfig.fields()))
    if unknown:
        raise ConfigError(f"unknown engine setting(s) {', '.join(unknown)}; known: {', '.join(EngineConfig.fields())}")
    return EngineConfig(**fields)
