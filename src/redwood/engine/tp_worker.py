"""The engine under tensor parallelism: lockstep replicas on every rank, driven by rank 0.

Every rank runs a whole `Engine` — scheduler, block pool, executor, sampler, output — over its shard of the
models. Rank 0 is the driver (`LLM`, the CLI; the server next): each engine call that changes state
(`add_request`, `abort`, `step`) is sent to the other ranks over the group's control channel (`Driver.send`, a
pickled call) before rank 0 runs it itself; the other ranks replay the calls in order (`serve`). Inside a step
the model's collectives (the all-reduces after o_proj and down_proj, the embedding's, the logits' all-gather)
keep the ranks together.

Why lockstep replicas rather than vLLM's executor / worker split (rank 0 schedules and sends each step's batch to
workers that only run forwards):
- the scheduler, block pool and output processor are deterministic and hold no tensors: the same calls in the
  same order give every rank the same schedule, slots, block tables and stops, so a step's message is one word
  ("step"), not the batch, its block tables, the plan and the sampler's state serialized every step;
- the executor's device state (slots, page tables, random streams, draft KV selections, the commit) follows
  from the engine's calls already: a split would need a second protocol for each, and a second code path
  through the executor that TP=1 does not run;
- every rank sees the whole logits (the vocab-parallel head's all-gather) and the all-reduce leaves the same bits
  on every rank (gloo and NCCL reduce each chunk once and copy it out), so every rank samples, verifies and
  commits the same tokens — with the same seeds, since a request's random stream depends on its seed and
  positions only.
What may not differ between ranks are decisions taken from clocks or from one rank's view: the automatic
speculation policy plans from measured times, so rank 0's plan is every rank's (`share_plan`, one small
broadcast a step; its costs are calibrated by all ranks together and cached per tensor-parallel size,
`engine.calibrate.load_or_calibrate`); the CPU's adaptive thread count only changes speed (it runs where a
step's bits do not depend on it). Requests arriving at a server reach rank 0 only — forwarded like `LLM`'s.
"""

from __future__ import annotations

import atexit

from redwood.config import EngineConfig
from redwood.errors import ConfigError, RankFailure

# the engine calls the driver forwards (the others read state only); "rebuild" replaces the engine on every rank
# (`Engine.rebuild`: a benchmark's AR and speculative engines over one load), "prompt_logits" is a forward outside
# the engine's pool (a benchmark's look at a greedy parting) that every rank must join
CALLS = ("add_request", "abort", "step", "rebuild", "prompt_logits")

_DRIVERS: dict[int, "Driver"] = {}  # id(group) → its driver: one per group, whichever engine it serves now


class Driver:
    """Rank 0's side: forwards engine calls to the other ranks; `close` (also at exit) releases them. One per
    group (`Driver.of`), serving one engine at a time (`claim` / `release`)."""

    def __init__(self, group):
        self.group = group
        self.closed = False
        self.serving = False  # an engine holds this driver now
        atexit.register(self.close)

    @classmethod
    def of(cls, group) -> "Driver":
        driver = _DRIVERS.get(id(group))
        if driver is None or driver.group is not group:
            driver = _DRIVERS[id(group)] = cls(group)
        return driver

    def claim(self) -> "Driver":
        """For a new engine on rank 0 (→ self); an error while another engine still serves the group."""
        if self.serving:
            raise ConfigError(
                "models sharded over tensor-parallel ranks serve one engine at a time; this one has it already "
                "(Engine.rebuild replaces it on every rank)"
            )
        self.serving = True
        return self

    def release(self) -> None:
        """The engine that claimed this driver is closed: the next may claim it."""
        self.serving = False

    def send(self, call: str, *args) -> None:
        if call not in CALLS:
            raise ValueError(f"not a forwarded engine call: {call}")
        if self.closed:
            if call == "abort":
                return  # (cleanup after an error: nothing left to tell)
            raise RankFailure("the tensor-parallel ranks were stopped after an error on rank 0")
        self.group.broadcast_object((call, args))

    def abandon(self) -> None:
        """A call failed on rank 0 midway (an error, Ctrl-C): the other ranks may wait inside a collective it left,
        so nothing more is sent; the ranks this process spawned are stopped (torchrun stops its own when rank 0
        exits non-zero)."""
        from redwood.parallel.launch import stop

        self.closed = True
        stop(self.group.procs)

    def check(self) -> None:
        """While idle (a server waiting for requests): a `RankFailure` naming a rank that ended meanwhile; the
        ranks this process spawned are stopped then."""
        if self.closed:
            return
        try:
            self.group.check_alive()
        except RankFailure:
            self.abandon()
            raise

    def close(self) -> None:
        """Tell the other ranks to return from `serve` (once; nothing when the group already failed)."""
        if self.closed or self.group.broken is not None:
            return
        self.closed = True
        try:
            self.group.broadcast_object(("stop", ()))
        except RankFailure:
            return  # (a rank already gone: nothing to release)
        self.group.close()  # (the process group's threads end here, not in the interpreter's teardown)


def close_drivers() -> None:
    """Release every group's other ranks now (what `Driver.close` does at exit) — before a process ends without
    the interpreter's teardown (`redwood.__main__` under torchrun)."""
    for driver in list(_DRIVERS.values()):
        driver.close()


def share_plan(group, policy, plan):
    """The automatic policy's plan for this step, rank 0's on every rank (→ a `policy.Plan`).

    The policy scores plans by measured seconds, which differ between ranks; every rank still runs its `plan`
    (the draftless scorers read each step's proposals there, deterministically), then takes rank 0's choice:
    its candidate's index among the policy's candidates (the same list on every rank), whether it probes, and
    what it expected — a few numbers over the control channel, not the drafter."""
    from redwood.speculation.policy import Plan

    if group.rank == 0:
        msg = (policy.candidates.index(plan.candidate), plan.probe, plan.expected_tokens, plan.predicted_s)
        group.broadcast_object(msg)
        return plan
    index, probe, expected, predicted = group.broadcast_object(None)
    return Plan(policy.candidates[index], probe=probe, expected_tokens=expected, predicted_s=predicted)


def serve(engine, group) -> None:
    """A rank > 0: replay rank 0's engine calls until it says stop (a dead rank 0 is a `RankFailure` here);
    "rebuild" swaps in the engine `Engine.rebuild` returns, as on rank 0."""
    while True:
        call, args = group.broadcast_object(None)
        if call == "stop":
            return
        if call not in CALLS:
            raise ConfigError(f"tensor-parallel rank {group.rank}: unknown engine call {call!r} from rank 0")
        if call == "rebuild":
            speculate, tree, verifier, fields = args
            engine = engine.rebuild(speculate=speculate, tree=tree, verifier=verifier, **fields)
        else:
            getattr(engine, call)(*args)


def run_rank(models, config: EngineConfig, group) -> None:
    """A rank > 0's life after loading its shards: its engine (the same config as rank 0's), then `serve`."""
    from redwood.engine.engine import Engine

    serve(Engine(models, config), group)


def spawned_rank(group, payload: dict) -> None:
    """The entry of a rank spawned by rank 0's `LLM` (`parallel.launch.spawn`): load this rank's shards with
    rank 0's arguments, meet rank 0 at the barrier, run the engine (`run_rank`)."""
    from redwood.engine.loaded import LoadedModels

    config = payload["engine"]
    models = LoadedModels.load(**payload["load"], max_model_len=config.max_model_len, tp=group)
    group.barrier()  # (every rank loaded: a rank that failed to is named at rank 0's LLM(), not mid-generate)
    run_rank(models, config, group)
