"""How many threads torch's CPU kernels use (`torch.set_num_threads`): `--threads N`, `LLM(threads=)`.

Order of precedence: an explicit `threads` → the OMP_NUM_THREADS environment variable (left as the user
set it: torch already read it) → `default_threads()`, the rule measured in benchmarks/NOTES.md
("Session 11: CPU threads", re-measured with packed weights in "Session 13: CPU"): one thread on a machine
of at most two cores, torch's own default (its physical cores, as llama.cpp's) above that, where nothing
was measured. On the 2-core machine, idle, two threads decode 1.4–1.7× faster; with one other busy
process, 2.2× slower (speculation > 20×). A run-time choice was not made: decode and verify steps are
bit-identical at 1 and 2 threads, but prefill chunks of ≥ 128 rows (oneDNN's gemm) are not, so the output
would depend on the machine's load. The setting is process-wide
(torch has one intra-op pool), so the last Engine built sets it for every model in the process.
"""

from __future__ import annotations

import os

import torch

from redwood.errors import ConfigError

# Measured on the 2-core machine (benchmarks/cpu_threads.py): with both cores given to torch, any other
# work on the machine (a second process, the OS, this process's own Python thread) stalls OpenMP's
# barrier-synchronised matmuls, and decoding ran 1.8-3.5x slower than on one thread (NOTES.md).
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


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads per `resolve_threads`; → the count in effect."""
    n = resolve_threads(threads)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()
