"""The executor: all of a step's device work, for the rows the scheduler picked.

The Engine hands it a `StepBatch` (which slots decode, which prefill chunks run) and gets back a
`StepResult` of plain host lists (tokens, their sources and logprobs, speculation counts, timings). In
between, on the device: the batch bucket, the runners and their CUDA graphs, the tree cut, the thread
count, drafting, verification, every sampled token (a prefill's first token included), the random
counters, and the KV commit (`commit`) — the commit's one owner.

Rows are batch *slots* [0, max_num_seqs). Device state per slot: the cache's page-table row, length and
live flag (`KVCache`), `prev` / `last` (the newest committed token / the sampled token not yet fed), the
sampler's settings and random stream (`Sampler.set_row`), the draft KV policy's per-row state (SnapKV's
selection) and, while a prefill is observed, its observers. A decoding step runs on the first n slots, n
the smallest batch bucket (1, 2, 4, …, max_num_seqs) holding every generating row — slots are handed out
lowest first, so n tracks the running count — and each bucket has its own runners and CUDA graphs. Rows in
the bucket that do not generate (idle slots, a request still prefilling) have live 0: they read no KV,
their writes land in scratch slots or the trash page, their results are dropped and their random
counters restored — so a request's output does not depend on what runs beside it.

`execute` leaves the decoding rows' KV uncommitted: how many tokens a row keeps depends on its stops
(EOS, stop strings, length limits), which the host decides from the result; the Engine then calls
`commit` with each row's count. A request's prefill runs in chunks into its slot (`engine.prefill`); with a
standalone draft model each chunk also runs through the draft into its own cache, which shares the
target's page table (same block ids, the draft model's pages).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from redwood.config import CPU_KV_MEMORY_GIB, EngineConfig
from redwood.engine import compile_clock
from redwood.engine.batch import DecodeRow, PrefillWork, StepBatch, StepResult, Tokens, logprob_rows
from redwood.engine.decode import ARStep, SpecStep, resolve_verifier
from redwood.engine.loaded import LoadedModels
from redwood.engine.prefill import prefill_row, prefill_rows
from redwood.engine.request import SOURCE_DRAFT, SOURCE_TARGET, token_logprob_list
from redwood.engine.runner import StepRunner, sync
from redwood.engine.threads import set_threads
from redwood.errors import ConfigError
from redwood.kv.cache import KVCache
from redwood.models import cpu_fused
from redwood.sample.sampler import Sampler, token_logprobs
from redwood.sampling_params import SamplingParams
from redwood.speculation.policy import AR, FixedPolicy, Plan
from redwood.speculation.trees import Tree


class _ObservedElsewhere:
    """A row's draft-prefill observer on a rank outside the draft model's (a draft on a subset of the
    tensor-parallel ranks, `SpeculativeConfig.draft_tensor_parallel`): the draft's ranks observe (SnapKV's
    selection is theirs); here the row's chunks still run alone, as there — every rank must run the same target
    forwards, their collectives in lockstep — and there is nothing to finish."""

    def finish(self) -> None:
        return None


OBSERVED_ELSEWHERE = _ObservedElsewhere()


class Executor:
    """Device state and device work of one Engine: its KV caches (allocated here, eagerly, within the
    config's memory share), slots, runners and sampler."""

    def __init__(self, models: LoadedModels, config: EngineConfig, max_model_len: int, policy=None):
        self.models = models
        self.model, self.drafter, self.tree, self.verifier = models.model, models.drafter, models.tree, models.verifier
        # what each step runs (`speculation.policy`): the models' fixed plan unless the Engine gives another
        self.policy = FixedPolicy(models.drafter, models.tree) if policy is None else policy
        self.drafters = list(self.policy.drafters)  # every drafter a step may use (`drafter`: the one with state)
        self.max_num_seqs, self.block_size = config.max_num_seqs, config.block_size
        self.max_model_len = max_model_len
        self.lookahead = self.policy.max_tree_size
        on_cuda = self.model.device.type == "cuda"
        self.use_graphs = on_cuda if config.cuda_graphs is None else config.cuda_graphs and on_cuda
        # On a GPU the host runs ahead of the device: host work placed between a step's launches and its first
        # read-back (prompt lookup's prefill indexing, the policy's deferred scoring: `execute(alongside=)`)
        # runs while the device works. In the main thread, not a helper thread: every torch call releases and
        # retakes the GIL, so a Python thread beside the launching one slowed both (an H100: 16 × 30K prefill
        # +0.30 s vs +0.18 s with the indexing simply after it, when a capacity check still drained the queue).
        self.device_runs_ahead = on_cuda
        if on_cuda:
            compile_clock.install()  # (eager steps book their kernels' first compiles as one-time costs)
        self.thread_policy = models.thread_policy  # decode steps' thread count chosen as they run
        self.runners: dict[tuple, StepRunner] = {}
        self._cut_trees: dict[int, Tree] = {}  # self.tree cut to its first d + 1 levels (`_step_tree`)
        self._observers: dict[int, tuple] = {}  # slot → (target's, draft model's) prefill observers
        self._synced = [0] * config.max_num_seqs  # block-table entries already copied to the device, per slot
        self.capture_s = 0.0  # one-time CUDA-graph captures and kernel compiles (left out of request timings)
        self._pending: tuple | None = None  # the decoding step's state until `commit`
        self._alongside: Callable[[], None] | None = None  # `execute`'s host work, until it runs
        # per slot: committed positions whose KV the draft model holds (it writes only on its own steps, so
        # after steps of another plan it lags the target and is caught up before its next step)
        self._draft_valid = [0] * config.max_num_seqs
        with torch.inference_mode(False):  # normal tensors: updated both inside steps and outside
            self._allocate(config)

    # ------------------------------------------------------------------ memory
    def _allocate(self, config: EngineConfig) -> None:
        own = self.drafter.own_model if self.drafter is not None else None
        models = [self.model] + ([own] if own is not None else [])
        page_bytes = sum(m.kv_slot_bytes * self.block_size for m in models)  # (under TP: this rank's KV heads)
        row_len = self.max_model_len + self.lookahead  # logical slots a row may touch
        need = self.max_num_seqs * -(-row_len // self.block_size)
        device = self.model.device
        if config.kv_cache_memory is not None:
            budget = int(config.kv_cache_memory * 2**30)
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.kv_memory_fraction)
        else:
            budget = int(CPU_KV_MEMORY_GIB * 2**30)
        num_pages = min(need, budget // page_bytes - 1)  # (one page more: the trash page)
        tp = getattr(self.models, "tp", None)
        if tp is not None:  # (tensor parallel: every rank's scheduler must see the same pool)
            num_pages = tp.min_int(num_pages)
        if num_pages < 1:
            raise ConfigError(
                f"the KV cache memory ({budget / 2**30:.3g} GiB) holds no {self.block_size}-token "
                f"page ({page_bytes / 2**20:.3g} MiB); give kv_cache_memory more or a smaller block_size"
            )
        self.num_pages = num_pages
        S = self.max_num_seqs
        self.cache = KVCache.paged(
            self.model.kv_config, S, num_pages, self.block_size, row_len, self.model.dtype, device
        )
        self.draft_cache = None
        if own is not None:
            self.draft_cache = KVCache.paged(own.kv_config, S, num_pages, self.block_size, row_len, own.dtype, device)
            self.draft_cache.block_table = self.cache.block_table  # the same blocks, the draft's pages
            self.draft_cache.live = self.cache.live
        for d in self.drafters:
            if d.elsewhere:
                continue  # (a draft model on other tensor-parallel ranks: its KV policy's state is theirs)
            owner = d.own_model or self.model
            d.policy.allocate(S, owner.config.num_layers, owner.kv_config.num_kv_heads, device)
        self.sampling_noise = config.sampling_noise
        self.sampler = Sampler.slots(S, device, config.sampling_noise)
        self.prev = torch.zeros(S, dtype=torch.long, device=device)
        self.last = torch.zeros(S, dtype=torch.long, device=device)
        self.buckets = sorted({min(2**i, S) for i in range(S.bit_length() + 1)})

    # ------------------------------------------------------------------ slots
    def admit(
        self, slot: int, params: SamplingParams, num_computed: int, prefill_len: int, random_state: tuple | None = None
    ) -> None:
        """Give a request the slot: its sampler settings (and random stream, kept across a preemption),
        its computed length (prefix-cache hits: scratch writes go past them), the draft policy's row."""
        self.sampler.set_row(slot, params, random_state)
        self.cache.lengths[slot] = num_computed
        if self.draft_cache is not None:
            self.draft_cache.lengths[slot] = num_computed
        self._draft_valid[slot] = num_computed
        observers = (None, None)
        if self.drafter is not None and self.drafter.elsewhere:
            if self.drafter.policy.observes_prefill:  # (its ranks prefill the row alone: so does this one)
                observers = (None, OBSERVED_ELSEWHERE)
        elif self.drafter is not None:
            obs = self.drafter.policy.admit(slot, prefill_len)
            observers = (obs, None) if self.drafter.own_model is None else (None, obs)
        self._observers[slot] = observers

    def random_state(self, slot: int) -> tuple:
        """The slot's random stream (kept by a request the scheduler preempts)."""
        return self.sampler.random.state(slot)

    def vacate(self, slot: int) -> None:
        """Free the slot: every later forward of that row reads and writes nothing of anyone's (trash
        page, live 0)."""
        self.cache.block_table[slot] = self.cache.trash_page
        self.cache.live[slot] = 0
        self.cache.lengths[slot] = 0
        if self.draft_cache is not None:
            self.draft_cache.lengths[slot] = 0
        self._observers.pop(slot, None)
        self._synced[slot] = 0
        for d in self.drafters:
            d.reset_row(slot)
        self.policy.forget(slot)

    def sync_table(self, slot: int, blocks: list[int]) -> None:
        """Copy a grown block table into the device table (only the new entries)."""
        done = self._synced[slot]
        if len(blocks) > done:
            self.cache.block_table[slot, done : len(blocks)] = torch.tensor(blocks[done:], dtype=torch.int32).to(
                self.cache.block_table.device, non_blocking=True
            )
            self._synced[slot] = len(blocks)

    # ------------------------------------------------------------------ the step
    def bucket(self, rows: list[DecodeRow]) -> int:
        """The batch bucket a decoding step over `rows` runs on: the smallest holding every row's slot."""
        top = max(r.slot for r in rows)
        return next(b for b in self.buckets if b > top)

    def execute(
        self, batch: StepBatch, plan: Plan | None = None, alongside: Callable[[], None] | None = None
    ) -> StepResult:
        """The step's decoding rows (one autoregressive or speculative step as `plan` says — by default the
        policy's fixed plan —, committed by `commit`), then its prefill chunks. `alongside`: host work run once
        during the step, after the decoding step's launches and before its read-back (while a GPU works)."""
        result = StepResult()
        self._alongside = alongside
        if batch.decode:
            if plan is None:
                plan = self.policy.plan(batch.decode, self.bucket(batch.decode))
            self._decode(batch.decode, result, plan)
        if batch.prefill:
            self._prefill(batch.prefill, result)
        self._run_alongside()  # (a step without decoding rows: now)
        return result

    def _run_alongside(self) -> None:
        job, self._alongside = self._alongside, None
        if job is not None:
            job()

    def _step_tree(self, tree: Tree | None, rows: list[DecodeRow], graphed: bool, greedy: bool) -> Tree | None:
        """The tree this step drafts: the plan's, cut to the levels its rows can still emit — a step
        emits at most depth tokens, so with every row k tokens from its limit, drafting past k − 1 tokens
        is waste (`--gamma 60 --max-new-tokens 8` drafting 60). With one token left for every row, None:
        a plain autoregressive step, no draft forward (every row ends with this step, so no draft
        cache needs its token; it is no speculation step in the stats, as vLLM counts only drafts).
        Only eager steps of greedy rows are cut: a graphed step replays one CUDA graph per tree, and a
        cut tree at every request's tail would capture new ones; and a sampled row's random draws
        follow the tree's shape, so a cut decided by its batch's rows would make its seeded output
        depend on what runs beside it (greedy output depends on nothing but the target)."""
        if tree is None or graphed or not greedy:
            return tree
        depth = max(r.remaining for r in rows) - 1  # draft levels kept
        if depth >= tree.max_depth - 1:
            return tree
        if depth < 1:
            return None
        key = (tree, depth)
        if key not in self._cut_trees:
            self._cut_trees[key] = tree.first_levels(depth)
        return self._cut_trees[key]

    def runner(self, role: str, n: int) -> StepRunner:
        """The runner of `role` ("target" | "draft") over the first n slots (made on first use)."""
        key = (role, n)
        runner = self.runners.get(key)
        if runner is None:
            from redwood.models.offload import get_offload

            if role == "target":
                model, cache = self.model, self.cache
            else:
                model, cache = self.drafter.own_model, self.draft_cache
            graphs = self.use_graphs and get_offload(model) is None
            runner = StepRunner(model, cache.rows(n), use_graphs=graphs)
            self.runners[key] = runner
        return runner

    def _catch_up_draft(self, rows: list[DecodeRow]) -> None:
        """Before a draft model's step: rows whose draft cache missed tokens committed by steps of other plans
        get them (one draft prefill over the gap; `propose` then re-feeds the newest committed token)."""
        lag = [r for r in rows if self._draft_valid[r.slot] < r.computed - 1]
        if not lag:
            return
        starts = [self._draft_valid[r.slot] for r in lag]
        stops = [r.computed - 1 for r in lag]
        prefill_rows(
            self.drafter.own_model, self.draft_cache, [r.slot for r in lag], [r.token_ids for r in lag], starts, stops
        )
        for r in lag:
            self._draft_valid[r.slot] = r.computed - 1

    def _decode(self, rows: list[DecodeRow], result: StepResult, plan: Plan) -> None:
        slots = [r.slot for r in rows]
        n = self.bucket(rows)
        active = [r.params for r in rows]
        sampler = self.sampler.view(0, n, active)
        want_lp = any(p.logprobs is not None for p in active)  # (a step without them computes none)
        target = self.runner("target", n)
        drafter = plan.drafter
        t0 = time.perf_counter()
        tree = self._step_tree(plan.tree, rows, target.use_graphs, sampler.all_greedy)
        if tree is not None and drafter.needs_history:
            history = [(r.slot, r.token_ids) for r in rows]
            if not drafter.prepare(history, tree, n, self.prev.device):
                tree = None  # nothing to propose in any row: a plain step
        own = tree is not None and drafter.own_model is not None
        compiled0 = compile_clock.seconds()
        if own:
            t_catch = time.perf_counter()
            self._catch_up_draft(rows)
            sync(self.model.device)
            # (its eager prefill meets new kernel specializations now and then: their compiles are one-time)
            result.compile_s = compile_clock.seconds() - compiled0
            result.catch_up_s = time.perf_counter() - t_catch - result.compile_s
        draft = self.runner("draft", n) if own else None
        if tree is None and plan.tree is not None:
            plan = Plan(AR)  # (the drafter had nothing, or the rows' limits cut every level: a plain step)
        policy, shape = self.thread_policy, (n, 1 if tree is None else tree.size)
        result.timed = True
        if policy is not None:
            count = policy.for_step(shape)
            result.timed = count == policy.current  # (a thread-count probe teaches the plan costs nothing)
            set_threads(count)
        if tree is None:
            kind = "ar"
            build = lambda: ARStep(target, sampler, want_lp)  # noqa: E731
        else:
            kind = resolve_verifier(
                self.verifier, tree, sampler.all_greedy, self.sampling_noise, drafter.deterministic_children
            )
            build = lambda: SpecStep(  # noqa: E731
                self.model, target, draft, drafter, tree, kind, sampler, want_lp
            )
        saved = sampler.random.counter.clone()

        def captures() -> float:  # graph-capture seconds of this bucket's runners so far (one-time costs)
            return target.capture_s + (draft.capture_s if draft is not None else 0.0)

        t_draft = None
        capture0 = captures()
        prev, last = self.prev[:n], self.last[:n]
        if target.use_graphs:
            key = (
                kind,
                sampler.all_greedy,
                sampler.any_greedy,
                sampler.any_filter,
                want_lp,
                tree,
                None if drafter is None or tree is None else drafter.graph_key(),
            )
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
        self._run_alongside()  # (the device still works on the step: this host work overlaps it)
        host_list = host.tolist()  # the step's one host synchronization
        lp_rows = logprob_rows(rows, lp) if want_lp else {}
        # Rows that did not generate keep their random counters (their draws are discarded).
        generating = torch.zeros(n, dtype=torch.bool)
        generating[slots] = True
        generating = generating.to(self.prev.device)
        sampler.random.counter.copy_(torch.where(generating, sampler.random.counter, saved))
        self.prev[:n] = torch.where(generating, new_prev, prev)
        self.last[:n] = torch.where(generating, nxt, last)
        t1 = time.perf_counter()
        if policy is not None:
            policy.record(count, shape, t1 - t0)
        captured_s = captures() - capture0
        if not target.use_graphs:  # (graphed, a step compiles only inside its captures — or in the catch-up)
            result.compile_s = compile_clock.seconds() - compiled0
        self.capture_s += captured_s + result.compile_s
        result.capture_s = captured_s
        result.step_s = (t1 - t0) - captured_s - result.compile_s
        result.plan = plan
        if t_draft is not None:
            result.draft_s = t_draft - t0 - draft_capture_s
            result.verify_s = t1 - t_draft - (captured_s - draft_capture_s)
        # (a step without drafts — a lone root, or AR at a request's end — is no speculation step)
        drafted = None if tree is None or tree.size == 1 else tree.size - 1
        for r in rows:
            a, nxt_b, path_b = host_list[r.slot][0], host_list[r.slot][1], host_list[r.slot][2:]
            emitted = path_b[1 : a + 1] + [nxt_b]
            lp_b = lp_rows.get(r.slot)
            if lp_b is not None:
                lp_b = token_logprob_list(emitted, *lp_b, r.params.logprobs)
            result.decode.append(
                Tokens(emitted, [SOURCE_DRAFT] * a + [SOURCE_TARGET], lp_b, None if drafted is None else (a, drafted))
            )
        self._pending = (
            target,
            draft,
            drafter if tree is not None else None,
            own,
            tree,
            path,
            torch.where(generating, accepted + 1, 0),
            {r.slot: r.computed for r in rows},
        )

    def commit(self, kept: dict[int, int]) -> None:
        """Commit the step's decoding rows: slot → tokens it keeps (its emitted tokens up to a stop; 0 for
        a row whose request finished — it is vacated next). The one place a step's KV is committed: the
        accepted tree nodes moved into place, the draft's accepted path, the lengths advanced."""
        if self._pending is None:
            return
        target, draft, drafter, own, tree, path, accepted_paths, computed = self._pending
        self._pending = None
        counts = [0] * target.cache.lengths.shape[0]
        for slot, k in kept.items():
            counts[slot] = k
        kept_t = torch.tensor(counts).to(self.prev.device)
        cache = target.cache
        if tree is not None and not tree.is_chain:
            cache.compact(path, kept_t)
        if drafter is not None:  # (rows that did not generate commit nothing; an AR step at the rows' end
            # has no draft to commit: they all finish with it)
            drafter.commit(draft, path, accepted_paths)
        if own:
            for slot, k in kept.items():
                if k:  # the draft now holds every committed position but the newest (re-fed next time)
                    self._draft_valid[slot] = computed[slot] + k - 1
        cache.commit(kept_t)

    def prefill_wide(self) -> bool:
        """Whether plain prefill chunks run at the thread policy's wide count: every model they run (the target, a
        draft model) computes the same bits at any count (the C++ layers at any length: `cpu_fused`). Else they
        keep its base count (the Python layers' gemms may round by the count)."""
        own = [] if self.drafter is None or self.drafter.own_model is None else [self.drafter.own_model]
        return self.thread_policy is not None and all(cpu_fused.takes_every_forward(m) for m in [self.model, *own])

    def _prefill(self, work: list[PrefillWork], result: StepResult) -> None:
        """This step's prefill chunks: observed ones (SnapKV) one request at a time, the others in one
        batch; a chunk that ends its prefill samples the request's first token."""
        policy = self.thread_policy
        if policy is not None:
            set_threads(policy.base)  # (observed chunks take the Python layers, whose gemms may round by the count)
        t0 = time.perf_counter()
        logits: dict[int, torch.Tensor] = {}
        plain = [(i, w) for i, w in enumerate(work) if self._observers.get(w.slot, (None, None)) == (None, None)]
        for i, w in enumerate(work):
            observers = self._observers.get(w.slot, (None, None))
            if observers != (None, None):
                logits[i] = self._prefill_observed(w, observers)
        if plain:
            if self.prefill_wide():
                set_threads(policy.wide)
            rows = [w.slot for _, w in plain]
            ids = [w.token_ids for _, w in plain]
            starts, stops = [w.start for _, w in plain], [w.stop for _, w in plain]
            out = prefill_rows(self.model, self.cache, rows, ids, starts, stops)
            if self.draft_cache is not None:
                prefill_rows(self.drafter.own_model, self.draft_cache, rows, ids, starts, stops)
                for w in (w for _, w in plain):
                    self._draft_valid[w.slot] = w.stop
            for k, (i, _) in enumerate(plain):
                logits[i] = out[k]
        # Prompt lookup's index of each row grown to its chunk's end (`DraftlessDrafter.index_prefix`): after the
        # forwards' launches (`prefill_rows` does not wait for them), before the first token's read-back below.
        for d in self.drafters:
            if d.needs_history:
                for w in work:
                    d.index_prefix(w.slot, w.token_ids, w.stop)
        sync(self.model.device)
        result.prefill_s = (time.perf_counter() - t0) / len(work)  # (the step's prefill time, device included)
        for i, w in enumerate(work):
            if not w.is_last:
                result.prefill.append(None)
                continue
            for obs in self._observers.get(w.slot, (None, None)):
                if obs is not None:
                    obs.finish()
            self._observers[w.slot] = (None, None)
            row = w.slot
            position = torch.tensor([len(w.token_ids)], device=logits[i].device)  # (the prompt's: 0 … len − 1)
            token = int(self.sampler.view(row, row + 1, [w.params]).sample(logits[i][None], position)[0])
            self.prev[row] = w.token_ids[-1]
            self.last[row] = token
            self.cache.live[row] = 1
            lp = None
            if w.params.logprobs is not None:
                at = torch.tensor([[token]], device=logits[i].device)
                chosen, top_v, top_i = (t[0].tolist() for t in token_logprobs(logits[i][None, None], at))
                lp = token_logprob_list([token], chosen, top_v, top_i, w.params.logprobs)
            result.prefill.append(Tokens([token], [SOURCE_TARGET], lp))

    def _prefill_observed(self, w: PrefillWork, observers: tuple) -> torch.Tensor | None:
        """A chunk of one request whose prefill is observed (SnapKV), alone; → its last logits."""
        target_obs, draft_obs = observers
        logits = prefill_row(
            self.model, self.cache.row(w.slot), w.token_ids, w.start, w.stop, target_obs, want_logits=w.is_last
        )
        if self.draft_cache is not None:
            prefill_row(self.drafter.own_model, self.draft_cache.row(w.slot), w.token_ids, w.start, w.stop, draft_obs)
            self._draft_valid[w.slot] = w.stop
        return logits
