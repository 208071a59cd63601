"""Starting a tensor-parallel group, two ways:

- under `torchrun --nproc_per_node N …` (`join`): every process is a rank; torchrun's environment (RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) says which and where rank 0's store listens;
- spawned by redwood (`spawn`): this process is rank 0 and starts ranks 1 … N−1 itself (`multiprocessing`'s
  spawn: fresh interpreters, no forked torch state) over a free loopback port; each runs
  `worker(group, payload)` and exits when it returns. Rank 0 watches them while they join: one that dies first
  is a `RankFailure` at once, not a wait for the timeout.

gloo on the CPU, NCCL on CUDA (one GPU a rank: LOCAL_RANK's); every wait bounded by `group.timeout_s`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from redwood.errors import ConfigError, RankFailure
from redwood.parallel.group import TPGroup, exit_words, timeout_s


def torchrun_world() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _check_free() -> None:
    if dist.is_initialized():
        raise ConfigError(
            "this process already belongs to a torch.distributed group: one tensor-parallel model per process"
        )


def join(device: torch.device) -> TPGroup:
    """This process's rank of the group torchrun started."""
    _check_free()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
    try:
        dist.init_process_group(backend_for(dev), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s()))
    except RuntimeError as e:
        raise RankFailure(f"tensor-parallel rank {rank} could not join the group of {world}: {e}") from None
    return TPGroup(rank, world, dev)


def free_port() -> int:
    """A TCP port free on the loopback now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, device: torch.device, worker, payload) -> TPGroup:
    """Start ranks 1 … world−1 (each runs `worker(group, payload)`), join them as rank 0 → rank 0's group."""
    import multiprocessing as mp

    _check_free()
    seconds = timeout_s()
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=True, timeout=timedelta(seconds=seconds), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    procs = {}
    with _main_hidden():
        for rank in range(1, world):
            p = ctx.Process(
                target=_spawned_main,
                args=(rank, world, port, str(device), worker, payload),
                daemon=True,
                name=f"tp{rank}",
            )
            p.start()
            procs[rank] = p
    keys = [f"redwood/up/{r}" for r in procs]
    deadline = time.monotonic() + seconds
    while not store.check(keys):  # (polled: a rank that dies while starting is named now, not at the timeout)
        for r, p in procs.items():
            if p.exitcode is not None:
                stop(procs)
                raise RankFailure(f"tensor-parallel rank {r} (pid {p.pid}) {exit_words(p.exitcode)} while starting")
        if time.monotonic() > deadline:
            stop(procs)
            raise RankFailure(f"tensor-parallel ranks did not start within {seconds:g} s")
        time.sleep(0.02)
    dev = _rank_device(device, 0)
    dist.init_process_group(backend_for(dev), store=store, rank=0, world_size=world, timeout=timedelta(seconds=seconds))
    return TPGroup(0, world, dev, procs)


@contextlib.contextmanager
def _main_hidden():
    """While ranks start: the user's `__main__` hidden from multiprocessing's spawn, which would run it again in
    every rank (a script calling `LLM(tensor_parallel_size=N)` at top level, without an `if __name__ ==
    "__main__"` guard, would spawn ranks from each rank). A rank needs only redwood's modules: `worker` and its
    payload are redwood's."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def follow_rank0_signals() -> None:
    """A rank > 0 leaves Ctrl-C (SIGINT, which a terminal sends to every rank at once) to rank 0: rank 0 decides
    — a server drains its running requests, then releases the ranks; `generate` stops them — and a rank whose
    rank 0 is gone still ends with a `RankFailure`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _spawned_main(rank: int, world: int, port: int, device: str, worker, payload) -> None:
    """A spawned rank: join rank 0's store, run `worker`, exit (non-zero, one line on stderr, on a failure)."""
    follow_rank0_signals()
    from redwood.errors import RedwoodError
    from redwood.progress import set_quiet

    set_quiet(True)  # (rank 0 shows the progress)
    code = 0
    try:
        seconds = timeout_s()
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=seconds))
        store.set(f"redwood/up/{rank}", "1")
        dev = _rank_device(torch.device(device), rank)
        dist.init_process_group(
            backend_for(dev), store=store, rank=rank, world_size=world, timeout=timedelta(seconds=seconds)
        )
        worker(TPGroup(rank, world, dev), payload)
    except RedwoodError as e:
        print(f"redwood: error: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except RuntimeError as e:  # (a collective outside TPGroup's wrappers: the store, joining)
        print(f"redwood: error: tensor-parallel rank {rank}: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (no interpreter teardown: gloo's threads and a dead peer's sockets cannot hold the exit)


def stop(procs: dict, grace_s: float = 2.0) -> None:
    """End spawned ranks: SIGTERM, then SIGKILL after `grace_s`."""
    for p in procs.values():
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(1.0)
