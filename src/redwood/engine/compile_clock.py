"""Seconds this process has spent in Triton JIT compiles — one-time costs, like CUDA-graph captures.

A Triton kernel compiles (or loads from Triton's disk cache) the first time it meets a new specialization:
new constexprs (a row-count bucket's BLOCK_M), or an integer argument newly divisible by 16. Steps that run
eagerly meet new ones long after the warm-up — a draft model's catch-up prefill over however many tokens other
plans committed. On an H100 (batch 1, the 0.5B draft, HumanEval) the automatic policy measured its catch-ups
at 927× their prediction, the run's decoding took ~1 s more than its plans' measured steps account for, and the
policy, taking that for what a catch-up costs, stopped choosing the draft (auto 0.58× AR). The executor subtracts
what `seconds()` grew by during such work and books it as a one-time cost, as it does graph captures.

The clock is Triton's pair of runtime hooks (`triton.knobs.runtime.jit_cache_hook`, called before a compile,
and `jit_post_compile_hook`, after it — both in the GPU machine's Triton 3.6, read from its wheel, and in 3.9),
chained to any hooks already set. The pre-compile hook must not return a true value (Triton would then skip the
compile): it returns what the hook it wraps returned. Without triton, or with a Triton that has no such hooks,
`seconds()` stays 0.0 (no compile is ever booked).
"""

from __future__ import annotations

import time

from redwood.kernels.triton_import import triton

_state = {"installed": False, "total": 0.0, "start": None}


def install() -> bool:
    """Hook Triton's compiles (idempotent; the executor calls it on a CUDA device); → whether the clock runs."""
    if _state["installed"]:
        return True
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    try:
        return _hook(runtime)
    except Exception:  # (a Triton whose knobs refuse the assignment: no clock, nothing booked — never a failure)
        return False


def _hook(runtime) -> bool:
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_compile_start(*args, **kwargs):
        _state["start"] = time.perf_counter()
        return before(*args, **kwargs) if before is not None else None

    def on_compile_end(*args, **kwargs):
        start, _state["start"] = _state["start"], None
        if start is not None:
            _state["total"] += time.perf_counter() - start
        return after(*args, **kwargs) if after is not None else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_compile_start, on_compile_end
    _state["installed"] = True
    return True


def seconds() -> float:
    """Seconds spent compiling Triton kernels since `install` (0.0 if it never ran)."""
    return _state["total"]
