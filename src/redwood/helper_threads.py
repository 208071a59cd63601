"""Named helper threads for host work that runs beside the device's (a GPU step's main thread waits on the device):
one worker per name, started on first use and shared by every engine of the process — each caller waits for its
own job (`Future.result()`), so jobs of different callers only queue behind each other."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

_THREADS: dict[str, ThreadPoolExecutor] = {}


def helper_thread(name: str) -> ThreadPoolExecutor:
    """The one-worker pool named `name` (its thread is called `name`_0)."""
    pool = _THREADS.get(name)
    if pool is None:
        pool = _THREADS[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    return pool
