"""Calibrating the automatic policy's cost model on the running device (`speculation.costs`).

One row, forwards of N = 1, 2, 4, … new tokens at a short and a long context, for the target and a standalone
draft model: the curves `CostTable` interpolates. The context is not prefilled — a forward's time does not
depend on what its keys hold, so the cache's lengths are simply set (seconds instead of minutes of prefill on
a CPU). Forwards run as the engine runs them (`StepRunner`: CUDA graphs on CUDA), at the thread count decode
steps start at. Other work on the machine only ever adds time, so each point is the *minimum* over PASSES
passes (the whole sweep repeated, so a burst of load hits one pass's points, not all of one point's runs) of
REPEATS runs each; then the curve is made monotone — a forward over fewer tokens, or at a shorter context,
never costs more than one over more (`ForwardCurve.monotone`). A calibration taken while the machine was
busy once gave 1.7 s for one token and 0.46 s for two; the policy then never chose long chains.

`load_or_calibrate` reads the cache (`speculation.costs_cache`) or calibrates (with a progress bar) and writes
it; `redwood profile --for-policy` calls it ahead of time.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time

import torch

from redwood import envs
from redwood.engine.runner import StepRunner, time_ms
from redwood.progress import Progress, note
from redwood.speculation.costs import CostTable, ForwardCurve
from redwood.speculation.costs_cache import load_costs, save_costs
from redwood.version import __version__

TOKENS = (1, 2, 4, 8, 16, 32)
SHORT_CONTEXT = 16
LONG_CONTEXT = 1024
# On a GPU the long context is the engine's longest, up to this: a one-row forward over 1,024 slots reads ~29 MB
# of KV (1.5B, bf16), microseconds against a ~1 ms weight-bound forward, so the per-slot cost taken from it is a
# fixed overhead's step divided by 1,008 — on an H100 it predicted a 32-row step over 16K slots 20x too slow
# (docs/perf/auto-policy.md item 20). At 16K the same row reads ~0.5 GB: the slope is measured, not guessed.
LONG_CONTEXT_GPU = 32768
GPU_CACHE_SHARE = 0.25  # of the free device memory the calibration's one-row cache may take
METHOD = 2  # in the cache's key: a calibration taken another way (1: the GPU's long context at 1,024) is retaken
REPEATS, WARMUP, PASSES = 3, 1, 2


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu:{model}:isa={envs.get(envs.CPU_ISA)}:{torch.backends.cpu.get_cpu_capability()}"


def _model_key(model) -> dict:
    execution = getattr(model, "execution", None)
    return {
        "config": repr(model.config),
        "dtype": str(model.dtype),
        "weights": getattr(model, "weights", "float32"),
        "skinny_int8": getattr(model, "skinny_int8", None) is not None,
        "backend": type(getattr(model, "backend", None)).__name__,
        "execution": None if execution is None else repr(dataclasses.asdict(execution)),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def cost_key(model, draft_model=None, threads: int | None = None, tensor_parallel: int = 1) -> dict:
    """What the forward times depend on (the cache's key)."""
    return {
        "device": device_name(model.device),
        "target": _model_key(model),
        "draft": None if draft_model is None else _model_key(draft_model),
        "threads": torch.get_num_threads() if threads is None else threads,
        "tensor_parallel": tensor_parallel,
        "version": __version__,
        "method": METHOD,
    }


def long_context(model, limit: int) -> int:
    """The calibration's long context: LONG_CONTEXT on a CPU; on a GPU the engine's longest (`limit`) up to
    LONG_CONTEXT_GPU, as far as GPU_CACHE_SHARE of the free memory holds a one-row cache of it."""
    if model.device.type != "cuda":
        return min(LONG_CONTEXT, limit)
    free, _ = torch.cuda.mem_get_info(model.device)
    fits = int(GPU_CACHE_SHARE * free // max(model.kv_slot_bytes, 1))
    return max(min(LONG_CONTEXT_GPU, limit, fits), min(LONG_CONTEXT, limit))


@torch.inference_mode()
def forward_curve(model, max_context: int, progress: Progress | None = None, tokens=TOKENS) -> ForwardCurve:
    """Times of one-row forwards of `tokens` new tokens at SHORT_CONTEXT and at `long_context` (within room)."""
    limit = min(max_context, model.config.max_position_embeddings) - max(tokens)
    hi = max(long_context(model, limit), SHORT_CONTEXT + 1)
    lo = SHORT_CONTEXT
    cache = model.new_cache(1, hi + max(tokens))
    runner = StepRunner(model, cache, use_graphs=model.device.type == "cuda")
    device = model.device
    out = {ctx: [math.inf] * len(tokens) for ctx in (lo, hi)}
    for _ in range(PASSES):
        for ctx in (lo, hi):
            cache.lengths.fill_(ctx)  # (the keys' values do not change a forward's time)
            for i, n in enumerate(tokens):
                ids = torch.zeros(1, n, dtype=torch.long, device=device)
                positions = (ctx + torch.arange(n, device=device))[None]
                t = time_ms(lambda: runner.forward(ids, positions), device, REPEATS, WARMUP, reduce=min) / 1e3
                out[ctx][i] = min(out[ctx][i], t)
                if progress is not None:
                    progress.update()
    return ForwardCurve(list(tokens), lo, hi, out[lo], out[hi]).monotone()


def calibrate(model, draft_model=None, max_context: int = 4096, show: bool = True) -> CostTable:
    n = len(TOKENS) * 2 * PASSES * (1 if draft_model is None else 2)
    with Progress(n, "calibrating the speculation cost model", enabled=show) as bar:
        target = forward_curve(model, max_context, bar)
        draft = None if draft_model is None else forward_curve(draft_model, max_context, bar)
    return CostTable(target, draft)


def load_or_calibrate(
    model, draft_model=None, max_context: int = 4096, show: bool = True, root=None, tp=None
) -> CostTable:
    """The cached table for this setup, or a fresh calibration (saved, and said on stderr). Times are taken at
    the current thread count (the key records it).

    tp: under tensor parallelism this rank's group (`model` is its shard): rank 0 reads the cache (keyed by the
    tensor-parallel size: a TP=2 step costs what TP=2 measures, all-reduces included); when it has no table
    every rank calibrates together — the same forwards in the same order, their collectives in lockstep — and
    rank 0's table (the one that plans) is every rank's."""
    lead = tp is None or tp.rank == 0
    key = cost_key(model, draft_model, tensor_parallel=1 if tp is None else tp.world)
    table, why = load_costs(key, root) if lead else (None, "")
    if tp is not None:
        table = tp.broadcast_object(table)  # (None: the ranks calibrate, all of them)
    if table is not None:
        return table
    if lead:
        note(f"{why}: calibrating the speculation cost model (`redwood profile --for-policy` does this ahead)")
    t0 = time.perf_counter()
    table = calibrate(model, draft_model, max_context, show and lead)
    if tp is not None:
        table = tp.broadcast_object(table if lead else None)
    if lead:
        path = save_costs(key, table, root)
        note(f"calibrated in {time.perf_counter() - t0:.1f} s; saved {path}")
    return table
