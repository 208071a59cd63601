"""One tensor-parallel process group: its rank, its collectives (each bounded by a timeout) and one clear error
when a rank fails.

Two groups over the same processes (vLLM's device group / CPU group split):
- `device` — the model's collectives (all-reduce after o_proj and down_proj, the vocab-parallel embedding's
  all-reduce, the logits' all-gather): gloo on the CPU, NCCL on CUDA, every call bounded by `timeout_s`
  (`REDWOOD_TP_TIMEOUT`): a rank that hangs makes the others fail within it.
- `control` — gloo on the CPU, for pickled objects: rank 0's engine calls to the other ranks
  (`redwood.engine.tp_worker`). A worker waits there for the user's next call, which may come much later, so its
  timeout is long; a rank that dies still ends the wait at once (gloo sees its sockets close).

A collective that fails raises `RankFailure` naming the rank that died where this process can tell (the ranks
on this host: their pids are exchanged at start; ranks this process spawned: their exit codes), e.g.
"tensor-parallel rank 1 (pid 4242) died (killed by SIGKILL); rank 0 stops: all_reduce failed".

A sub-group (`TPGroup.subgroup`): ranks 0 … K−1 with the same interface — their own `device` and `control`
groups, failures reported as the whole group's — for a draft model sharded over fewer ranks than the target
(MagicDec's `--draft_rank_group`); a rank outside it holds a `NotMember`.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from redwood import envs
from redwood.errors import ConfigError, RankFailure

# how long a failed collective looks for the rank that died (its sockets close a moment before it is gone)
DEATH_GRACE_S = 2.0
# the control group waits for the user's next call: a long bound (a dead rank still ends the wait at once)
CONTROL_TIMEOUT = timedelta(days=7)


def timeout_s() -> float:
    """The collectives' bound in seconds (`REDWOOD_TP_TIMEOUT`)."""
    value = envs.get(envs.TP_TIMEOUT)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{envs.TP_TIMEOUT} must be a positive number of seconds, got {value!r}")
    return seconds


class TPGroup:
    """This process's place in a tensor-parallel group of `world` ranks (world ≥ 2; TP=1 has no group).

    procs: rank → the `multiprocessing.Process` of a rank this process spawned (its exit code names a failure)."""

    member = True  # (this rank belongs to the group; a `NotMember` stands for a sub-group it is outside)

    def __init__(self, rank: int, world: int, device: torch.device, procs: dict | None = None):
        self.rank, self.world, self.device = rank, world, device
        self.procs = dict(procs or {})
        self.timeout_s = timeout_s()
        self.broken: RankFailure | None = None  # the first failure: every later collective raises it again
        self.peers: list[tuple[str, int]] = []  # rank → (host, pid)
        self.pg = None  # the model's collectives' process group (None: torch's default group, every rank)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        peers: list = [None] * world
        me = (socket.gethostname(), os.getpid())
        self._run("all_gather_object", lambda: dist.all_gather_object(peers, me, group=self.control))
        self.peers = peers

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def subgroup(self, size: int) -> "TPGroup | NotMember":
        """Ranks 0 … size−1 as a group of their own (1 < size < world): a `SubGroup` on those ranks, a `NotMember`
        on the others. Every rank must call it, in the same order (torch.distributed.new_group's rule: each rank
        builds every group, its own or not)."""
        if not 1 < size < self.world:
            raise ConfigError(
                f"a sub-group of {self.world} tensor-parallel ranks holds 2 … {self.world - 1}, not {size}"
            )
        ranks = list(range(size))
        pg = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout_s))  # (the default backend: gloo / NCCL)
        control = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
        if self.rank >= size:
            return NotMember(size)
        return SubGroup(self, size, pg, control)

    # ------------------------------------------------------------------ the model's collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits: gloo and NCCL reduce each chunk
        once, then copy it to every rank) → x."""
        self._run("all_reduce", lambda: dist.all_reduce(x, group=self.pg))
        return x

    def all_gather_last(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """Every rank's x [..., n] (n: the largest shard; a smaller one is zero-padded by the caller) concatenated
        along the last dim, cut to `full` → [..., full]: the vocab-parallel head's logits."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._run("all_gather", lambda: dist.all_gather(parts, x, group=self.pg))
        return torch.cat(parts, dim=-1)[..., :full]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s x on every rank, in place → x (rank 0's draft tokens and distributions, when the draft is
        replicated or on a subset of the ranks)."""
        self._run("broadcast", lambda: dist.broadcast(x, src=src, group=self.pg))
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (sizes every rank must agree on: the KV pages)."""
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run("all_reduce", lambda: dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.pg))
        return int(x.item())

    def barrier(self) -> None:
        """Wait for every rank (an all-reduce of one number on the device group: bounded by the timeout, on
        gloo and NCCL alike)."""
        self.all_reduce(torch.zeros(1, device=self.device))

    # ------------------------------------------------------------------ control (pickled objects)
    def broadcast_object(self, obj=None, src: int = 0):
        """rank `src`'s object on every rank (the others pass None)."""
        box = [obj]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=src, group=self.control))
        return box[0]

    # ------------------------------------------------------------------ failures
    def _run(self, op: str, fn):
        if self.broken is not None:
            raise self.broken
        try:
            return fn()
        except RuntimeError as e:  # (DistBackendError, DistNetworkError, gloo's "Connection closed by peer")
            failure = RankFailure(self.describe_failure(op, e))
            self.broken = failure
            raise failure from None

    def describe_failure(self, op: str, error: BaseException) -> str:
        """One line: which rank died (where this process can tell) and what failed here."""
        detail = str(error).strip().splitlines()[-1][:200] if str(error).strip() else type(error).__name__
        dead = self.dead_peers()
        deadline = time.monotonic() + DEATH_GRACE_S
        while not dead and time.monotonic() < deadline:  # (a killed peer's sockets close before its exit ends)
            time.sleep(0.05)
            dead = self.dead_peers()
        if dead:
            who = "; ".join(f"tensor-parallel rank {r} (pid {pid}) {how}" for r, pid, how in dead)
            return f"{who}; rank {self.rank} stops ({op} failed: {detail})"
        return (
            f"tensor-parallel rank {self.rank}: {op} failed — another rank is gone or stuck "
            f"(collectives time out after {self.timeout_s:g} s, {envs.TP_TIMEOUT}): {detail}"
        )

    def check_alive(self) -> None:
        """Between calls (nothing in flight to fail): a `RankFailure` naming any rank known to have ended."""
        if self.broken is not None:
            raise self.broken
        dead = self.dead_peers()
        if dead:
            who = "; ".join(f"tensor-parallel rank {r} (pid {pid}) {how}" for r, pid, how in dead)
            self.broken = RankFailure(f"{who}; rank {self.rank} stops")
            raise self.broken

    def dead_peers(self) -> list[tuple[int, int, str]]:
        """(rank, pid, how) of the ranks known to have ended: spawned by this process, or on this host."""
        out = []
        host = socket.gethostname()
        for r in range(self.world):
            if r == self.rank:
                continue
            proc = self.procs.get(r)
            if proc is not None:
                if proc.exitcode is not None:
                    out.append((r, proc.pid, exit_words(proc.exitcode)))
            elif r < len(self.peers) and self.peers[r][0] == host and not pid_alive(self.peers[r][1]):
                out.append((r, self.peers[r][1], "died"))
        return out

    def close(self) -> None:
        """Leave the group (the process's default group with it)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class SubGroup(TPGroup):
    """Ranks 0 … world−1 of `parent` (`TPGroup.subgroup`): the same collectives over those ranks only (a rank's
    number is its number in the parent: rank 0 is the parent's). A failure here is the parent's — `broken` is
    shared, and the rank that died is looked for among all the parent's ranks."""

    def __init__(self, parent: TPGroup, world: int, pg, control):
        self.parent = parent
        self.rank, self.world, self.device = parent.rank, world, parent.device
        self.procs, self.peers, self.timeout_s = parent.procs, parent.peers, parent.timeout_s
        self.pg, self.control = pg, control

    @property
    def broken(self) -> RankFailure | None:
        return self.parent.broken

    @broken.setter
    def broken(self, failure: RankFailure | None) -> None:
        self.parent.broken = failure

    def dead_peers(self) -> list[tuple[int, int, str]]:
        return self.parent.dead_peers()

    def close(self) -> None:
        """Nothing of its own to end: the parent's `close` ends every group of the process."""


@dataclass(frozen=True)
class NotMember:
    """A rank's side of a sub-group it is outside (`TPGroup.subgroup`): the sub-group's size, no collectives."""

    world: int
    member = False


def exit_words(code: int) -> str:
    """A process exit code in words: 'exited with status 1', 'died (killed by SIGKILL)'."""
    if code < 0:
        try:
            return f"died (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited with status {code}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this host runs (a zombie — ended, not yet reaped — does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
