"""How many threads torch's CPU kernels use (`torch.set_num_threads`): `--threads N`, `LLM(threads=)`.

Order of precedence: an explicit `threads` → the OMP_NUM_THREADS environment variable (left as the user
set it: torch already read it) → `default_threads()`, the rule measured in docs/perf/cpu.md
("Session 11: CPU threads", re-measured with packed weights in "Session 13: CPU"): one thread on a machine
of at most two cores, torch's own default (its physical cores, as llama.cpp's) above that, where nothing
was measured. On the 2-core machine two threads decode faster while it is idle and much slower while one
other process is busy (OpenMP's barriers wait for the descheduled thread). So where the count is left to
redwood on such a machine, the Engine's decode steps choose 1 or 2 as they run (`AdaptiveThreads`) for models
whose decode steps are bit-identical at any count (kquant kinds: every forward through the C++ layers, whichever
build of them runs: `cpu_kernels.kquant`). Prefill chunks of such models run at the wide count (the C++ layers take
them at any length, as exact: `Executor.prefill_wide`); otherwise, and while loading, the one thread (≥ 128-row
prefill chunks through oneDNN's gemm round differently at another count), so the output never depends on the
machine's load. The setting is process-wide
(torch has one intra-op pool), so the last Engine built sets it for every model in the process.
"""

from __future__ import annotations

import os

import torch

from redwood.errors import ConfigError

# On the 2-core machine, with both cores given to torch, any other work on the machine (a second process,
# the OS, this process's own Python thread) stalls OpenMP's barrier-synchronised matmuls, and decoding ran
# slower than on one thread (docs/perf/cpu.md, "Session 11: CPU threads").
SMALL_MACHINE_CORES = 2
_TORCH_DEFAULT = torch.get_num_threads()  # what torch chose at import (its physical cores, or the user's)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on Linux)
        return os.cpu_count() or 1


def default_threads(cores: int | None = None) -> int:
    """The thread count used when neither `threads` nor OMP_NUM_THREADS says: 1 on a machine of at most
    SMALL_MACHINE_CORES cores, else torch's own default (unmeasured here: left as torch picks it)."""
    cores = usable_cores() if cores is None else cores
    return 1 if cores <= SMALL_MACHINE_CORES else _TORCH_DEFAULT


def check_threads(threads) -> None:
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ConfigError(f"threads must be a positive integer, got {threads!r}")


def resolve_threads(threads: int | None, env: dict | None = None) -> int | None:
    """The count to set: `threads` if given; None (leave torch as it is) when OMP_NUM_THREADS is set;
    else the default rule."""
    check_threads(threads)
    if threads is not None:
        return threads
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    return default_threads()


def set_threads(n: int) -> None:
    """torch's intra-op thread count, set only when it changes (the Engine calls this every step)."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads per `resolve_threads`; → the count in effect."""
    n = resolve_threads(threads)
    if n is not None:
        set_threads(n)
    return torch.get_num_threads()


class AdaptiveThreads:
    """The thread count of each decode step on a small machine, chosen by measuring both counts as it runs.

    Why: on the 2-core machine two threads decode faster than one while the machine is idle and much slower while
    another process holds a core (each of a step's OpenMP regions waits for the descheduled thread; the figures:
    docs/perf/cpu.md, session 17), and which of the two holds changes as other work comes and goes. So decode steps
    start at `wide` and time themselves: at the first step of a new shape `key`, right after a step took 1.5× its
    average, and every PROBE_EVERY steps — an interval that doubles (to MAX_INTERVAL) each time a probe loses, so a
    lasting state costs few slow probe steps — one step runs at the other count; the faster count (by MARGIN,
    against noise) is kept. Prefill chunks run at `wide` where every forward goes through the C++ layers, else at
    `base` (their gemm paths may round differently at another thread count: `Executor.prefill_wide`); a decode step computes the same bits at any count for the models this is used with (`engine.Engine`:
    kquant-kind models, whose layer and kernel rows are thread-count exact — tested), so the output never depends on
    the choice.
    """

    PROBE_EVERY = 32
    MAX_INTERVAL = 512
    MARGIN = 1.15
    JUMP = 1.5

    def __init__(self, base: int, wide: int):
        self.base, self.wide, self.current = base, wide, wide
        self.ema: dict[tuple[int, object], float] = {}  # (count, key) -> seconds a step (the current count: an
        # average; the other: its last probe)
        self.since_probe = 0
        self.interval = self.PROBE_EVERY
        self.probe_next = False

    def other(self) -> int:
        return self.base if self.current == self.wide else self.wide

    def for_step(self, key) -> int:
        """The count to run this decode step of shape `key` at."""
        self.since_probe += 1
        probe = (
            self.probe_next
            or self.since_probe >= self.interval
            or (self.current, key) not in self.ema
            or (self.other(), key) not in self.ema
        )
        if probe and (self.current, key) not in self.ema:
            return self.current  # (measure the current count first)
        return self.other() if probe else self.current

    def record(self, count: int, key, seconds: float) -> None:
        """A decode step of shape `key` at `count` threads took `seconds`."""
        prev = self.ema.get((count, key))
        if count == self.current:
            self.ema[(count, key)] = seconds if prev is None else 0.5 * (prev + seconds)
            self.probe_next = prev is not None and seconds > self.JUMP * prev
        else:  # a probe
            self.ema[(count, key)] = seconds
            self.probe_next, self.since_probe = False, 0
        mine, theirs = self.ema.get((self.current, key)), self.ema.get((self.other(), key))
        if mine is not None and theirs is not None and theirs * self.MARGIN < mine:
            self.current, self.probe_next = self.other(), False  # (the other count was just measured)
            self.interval = self.PROBE_EVERY
        elif count != self.current:
            self.interval = min(2 * self.interval, self.MAX_INTERVAL)  # the probe lost


def adaptive_threads(
    threads: int | None, env: dict | None = None, cores: int | None = None, enabled: bool = True
) -> AdaptiveThreads | None:
    """The decode-step policy where the count is left to redwood (no `threads`, no OMP_NUM_THREADS) on a machine
    of 2..SMALL_MACHINE_CORES cores (where the default is one thread), unless turned off (`enabled`:
    ExecutionConfig.adaptive_threads, `--no-adaptive-threads`)."""
    env = os.environ if env is None else env
    cores = usable_cores() if cores is None else cores
    if not enabled or threads is not None or env.get("OMP_NUM_THREADS", "").strip():
        return None
    if not 1 < cores <= SMALL_MACHINE_CORES:
        return None
    return AdaptiveThreads(base=default_threads(cores), wide=cores)
