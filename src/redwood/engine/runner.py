"""Decode-shaped forwards over one model and one KV cache — eager, or replayed from CUDA graphs.

Every step after the prefill (an autoregressive decode, a draft level, a verification over a token tree)
is a forward of a few new tokens per row with a fixed shape. On CUDA, launching the ~15 kernels of each
of a model's layers from Python costs more than the kernels themselves at batch 1, so a `StepRunner`
captures each distinct step shape once into a CUDA graph and replays it:

    key = (T new tokens, pending tokens, mask key, draft KV policy)   →   graph, static ids / positions

Inside the graph everything is read from device tensors that persist across steps: the cache's `lengths`
(advanced in place by `commit`), the static input buffers (copied in before each replay) and the policy's
buffers (a compressed draft view is recomputed from `lengths` inside the graph). Nothing in a captured
forward synchronizes with the host (the Triton attention kernel reads the lengths on the device).

A speculative step can go further: `StepRunner.captured_step` captures a whole callable — every draft
level, the verification forward, sampling and the verifier — into one graph (the forwards inside it run
inline, not as graphs of their own), so a step costs one replay and one host synchronization.

The logits a replay returns live in the graph's static output: consume them before the same step shape
runs again. The Engine keeps one runner per (role, batch bucket) over the rows [0, bucket) of its cache
for its lifetime, so graphs are captured once per engine, not once per request.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch

from redwood.kernels import pdl
from redwood.kv.cache import KVCache
from redwood.kv.policies import DraftKVPolicy
from redwood.models.transformer import Transformer

_inline = [0]  # > 0: forwards run directly (they are being captured as part of a larger graph)


@contextmanager
def inline_forwards() -> Iterator[None]:
    """Within this block every StepRunner.forward runs the model directly instead of replaying a graph."""
    _inline[0] += 1
    try:
        yield
    finally:
        _inline[0] -= 1


class StepRunner:
    """Runs decode / draft / verify forwards of `model` over `cache`."""

    def __init__(self, model: Transformer, cache: KVCache, use_graphs: bool):
        self.model, self.cache = model, cache
        self.use_graphs = use_graphs and cache.k.is_cuda
        self._graphs: dict[Hashable, _Captured] = {}
        # One memory pool for all of this runner's graphs: they replay one at a time, and each graph's
        # output stays allocated, so sharing the pool only lets intermediates reuse memory.
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.captures = 0  # graphs captured so far (reported by benchmarks)
        self.capture_s = 0.0  # seconds spent warming up and capturing them (one-time costs, not steps)
        self._steps: dict[Hashable, CapturedStep] = {}

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        pending: int = 0,
        new_mask: torch.Tensor | None = None,
        mask_key: Hashable = None,
        policy: DraftKVPolicy | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] float32 for new tokens ids / positions [B, T] (see Transformer.forward).

        policy: read the committed context through this draft KV policy's view (computed from the
        cache's current lengths). mask_key: a hashable naming `new_mask`'s content (e.g. the tree and
        draft level); required with a mask when graphs are on, since one graph serves every call with
        that key.
        """
        if not self.use_graphs or _inline[0]:
            view = None if policy is None else policy.view(self.cache.lengths)
            return self.model(ids, positions, self.cache, new_mask=new_mask, pending=pending, view=view)
        if new_mask is not None and mask_key is None:
            raise ValueError("a graphed forward with a mask needs a mask_key naming the mask")
        key = (tuple(ids.shape), pending, mask_key, None if policy is None else (id(policy), policy.version))
        captured = self._graphs.get(key)
        if captured is None:
            t0 = self._capture_started()
            captured = _Captured(self.model, self.cache, ids, positions, pending, new_mask, policy, self._pool)
            self._graphs[key] = captured
            self._capture_done(t0)
        return captured.replay(ids, positions)

    def _capture_started(self) -> float:
        torch.cuda.synchronize(self.cache.k.device)
        return time.perf_counter()

    def _capture_done(self, t0: float) -> None:
        torch.cuda.synchronize(self.cache.k.device)
        dt = time.perf_counter() - t0
        self.captures += 1
        self.capture_s += dt

    def captured_step(
        self,
        key: Hashable,
        build: Callable[[], Callable[..., tuple]],
        inputs: tuple[torch.Tensor, ...],
        restore: Callable[[], Callable[[], None]],
    ) -> "CapturedStep":
        """The graph of a whole step under `key`, captured on first use (graphs must be on).

        build() makes the step callable (called once; it and what it holds live as long as the graph);
        inputs: example inputs (their shapes are fixed by the key); restore(): snapshot the state the
        warm-up runs must not advance and return a function that puts it back (`RowRandom.checkpoint`).
        """
        captured = self._steps.get(key)
        if captured is None:
            t0 = self._capture_started()
            captured = CapturedStep(build(), inputs, self._pool, restore)
            self._steps[key] = captured
            self._capture_done(t0)
        return captured


def _warm_up_and_capture(graph: torch.cuda.CUDAGraph, pool, run: Callable[[], object]):
    """Run `run` twice on a side stream (lazy initialization, Triton compilation), then capture it.

    Both under `pdl.launches()`: where a benchmark asked for it (`pdl.request`, redwood.kernels.pdl), the Triton
    kernels are launched with programmatic dependent launch — compiled and loaded in the warm-up, so the
    capture only records them. The callers synchronized the device first, so weights written before
    (loading, quantization) are settled: the kernels prefetch their first weight tile before waiting."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pdl.launches():
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph, pool=pool):
            return run()


class CapturedStep:
    """One CUDA graph of a whole step callable fn(*inputs) → tuple of tensors."""

    def __init__(
        self,
        fn: Callable[..., tuple],
        inputs: tuple[torch.Tensor, ...],
        pool,
        restore: Callable[[], Callable[[], None]],
    ):
        self.fn = fn
        self.inputs = tuple(x.clone() for x in inputs)
        undo = restore()
        self.graph = torch.cuda.CUDAGraph()
        with inline_forwards():
            warm = _warm_up_and_capture(self.graph, pool, lambda: fn(*self.inputs))
        undo()  # the warm-up runs drew random numbers; the capture itself ran nothing
        self.out = warm

    def replay(self, *inputs: torch.Tensor) -> tuple:
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        self.graph.replay()
        return self.out


class _Captured:
    """One CUDA graph of one forward shape, with its static inputs and output."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        ids: torch.Tensor,
        positions: torch.Tensor,
        pending: int,
        new_mask: torch.Tensor | None,
        policy: DraftKVPolicy | None,
        pool,
    ):
        self.ids = ids.clone()
        self.positions = positions.clone()
        self.mask = None if new_mask is None else new_mask.clone()

        def step() -> torch.Tensor:
            view = None if policy is None else policy.view(cache.lengths)
            return model(self.ids, self.positions, cache, new_mask=self.mask, pending=pending, view=view)

        # Warm up outside the capture. A forward writes only scratch slots past the committed lengths and
        # never commits, so running it is free of side effects.
        self.graph = torch.cuda.CUDAGraph()
        self.out = _warm_up_and_capture(self.graph, pool, step)

    def replay(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timing on CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], object], device: torch.device, repeats: int, warmup: int, reduce: Callable = statistics.median
) -> float:
    """Wall time of fn() in ms — the median (or `reduce`, e.g. min) of `repeats` runs after `warmup` untimed
    runs, synced around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(reduce(times))
