"""Loading models for an engine, sharded over tensor-parallel ranks when its config asks (`LLM` and
`Engine.from_pretrained` both load through `load_models`, so `redwood generate`, `bench ar` and `serve` share it).

Two launch forms:
- `torchrun --nproc_per_node N -m redwood …` (or any script under torchrun): every process is a rank; N is
  torchrun's (`tensor_parallel_size` may be left out, or must say the same);
- one process (`--tensor-parallel-size N`, `LLM(tensor_parallel_size=N)`): it is rank 0 and spawns ranks
  1 … N−1, each loading its shards with the same arguments (`tp_worker.spawned_rank`).
Either way every rank loads only its shards, meets the others at a barrier, and ranks > 0 then replay rank 0's
engine calls (`tp_worker.run_rank`) until rank 0 ends: `load_models` returns on rank 0 only.
"""

from __future__ import annotations

import os
import sys

from redwood.config import EngineConfig
from redwood.engine.loaded import LoadedModels
from redwood.errors import ConfigError
from redwood.loading import parse_device


def with_torchrun_size(engine_args: dict) -> dict:
    """`engine_args` with tensor_parallel_size set to torchrun's WORLD_SIZE when this process is a torchrun rank
    (the size left out, or 1 from a flag's default: torchrun's processes are the ranks)."""
    from redwood.parallel import launch

    world = launch.torchrun_world()
    if world is not None and world > 1 and engine_args.get("tensor_parallel_size") in (None, 1):
        return {**engine_args, "tensor_parallel_size": world}
    return engine_args


def load_models(model, load: dict, config: EngineConfig) -> LoadedModels:
    """The models `load` (`LoadedModels.load`'s keywords) names — this rank's shards when
    `config.tensor_parallel_size` > 1 (then `.tp` is rank 0's group; ranks > 0 never return: they serve rank
    0's engine, then end the process with rank 0's)."""
    group = _start(model, load, config)
    models = LoadedModels.load(model, max_model_len=config.max_model_len, tp=group, **load)
    if group is None:
        return models
    group.barrier()  # (every rank has its shards: a rank that failed to load is named here, not mid-generate)
    if group.rank != 0:  # a torchrun rank > 0
        from redwood.engine.tp_worker import run_rank

        run_rank(models, config, group)
        _end_rank()
    return models


def _start(model, load: dict, config: EngineConfig):
    """This process's `TPGroup` when the config asks for several ranks (torchrun's, or rank 0 of ranks spawned
    now), else None. Everything tensor parallelism refuses is refused first, before any rank starts."""
    from redwood.parallel import launch

    world = config.tensor_parallel_size
    torchrun = launch.torchrun_world()
    if world == 1:
        if torchrun is not None and torchrun > 1:
            raise ConfigError(f"tensor_parallel_size 1 under torchrun's {torchrun} processes: give the same")
        return None
    from redwood.engine.loaded import check_draft_tensor_parallel, check_tensor_parallel
    from redwood.loading import check_sharded_format, inspect_model

    if torchrun is not None and torchrun != world:
        raise ConfigError(f"tensor_parallel_size {world} under torchrun's {torchrun} processes: give the same")
    info = inspect_model(model)
    device = parse_device(load.get("device", "cpu"))
    check_tensor_parallel(world, info.config, load.get("offload", False))
    check_sharded_format(info, load.get("weights", "auto"), device, world)
    spec = load.get("speculative")
    if spec is not None and spec.draft_model:  # (sharded over the same ranks, a subset of them, or whole)
        check_draft_tensor_parallel(spec, inspect_model(spec.draft_model), world, device)
    if torchrun is not None:
        group = launch.join(device)
        if group.rank != 0:
            import signal

            from redwood.progress import set_quiet

            set_quiet(True)  # (rank 0 shows the progress)
            launch.follow_rank0_signals()
            # (torchrun's SIGTERM reaches every rank at once: these follow rank 0's shutdown — a server's drain
            # — and end when it releases them, or with a RankFailure when it is gone)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return group
    from redwood.engine.tp_worker import spawned_rank

    payload = {"load": {"model": str(info.path), **load}, "engine": config}
    return launch.spawn(world, device, spawned_rank, payload)


def _end_rank() -> None:
    """A torchrun rank > 0 whose rank 0 said stop: exit now, status 0 (no interpreter teardown: gloo's threads,
    still held by the process group, would abort it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
