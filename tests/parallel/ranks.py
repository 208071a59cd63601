"""Running a function on N ranks spawned by a test (torchrun's environment, gloo on the CPU), each bounded in time;
and the functions the tests run there (module-level: the spawned processes import them by name)."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[2] / "src")
ROOT = str(Path(__file__).resolve().parents[2])


def subprocess_env(**extra) -> dict:
    """The environment for a redwood subprocess of a test: this checkout first on the path, one thread a rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, ROOT, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_ranks(fn, world: int, *args, timeout: float = 60.0) -> list:
    """fn(group, *args) on `world` spawned ranks (torchrun's environment, `parallel.launch.join`) → each rank's
    return value, in rank order. A rank that raises, or the whole run outliving `timeout`, fails the test."""
    from redwood.parallel.launch import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
    return [results[r] for r in range(world)]


def _rank_main(rank, world, port, fn, args, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.setdefault("REDWOOD_TP_TIMEOUT", "30")
    torch.set_num_threads(1)
    try:
        from redwood.parallel import launch

        group = launch.join(torch.device("cpu"))
        value = fn(group, *args)
        queue.put((rank, True, _plain(value)))
        group.close()
    except BaseException:  # noqa: BLE001 -- reported to the test
        queue.put((rank, False, traceback.format_exc()))


def _plain(value):
    """Tensors as numpy arrays (pickled by value: a rank may exit before the test reads its queue)."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------- rank functions
def model_info(path):
    """The model at `path` (a folder, or a GGUF test file: no tokenizer)."""
    from pathlib import Path

    from redwood.loading import ModelInfo, inspect_model
    from redwood.loading.gguf import read_gguf_config

    path = Path(path)
    if path.is_dir():
        return inspect_model(path)
    return ModelInfo(config=read_gguf_config(path), tokenizer=None, source=str(path), path=path)


def sharded_checks(group, models: list[tuple[str, str]], steps: list[list[int]]) -> dict:
    """The collectives on known inputs (`collective_pieces`), then for each (model path, weight format) the logits
    of this rank's shard for each forward in `steps` (a prompt, then one token at a time) over one cache row."""
    from redwood.loading import load_model

    out = {"collectives": collective_pieces(group)}
    for path, weights in models:
        out[path] = run_forwards(load_model(model_info(path), weights=weights, tp=group).model, steps)
    return out


def run_forwards(model, steps: list[list[int]]) -> list[torch.Tensor]:
    cache = model.new_cache(1, 64)
    out, pos = [], 0
    with torch.inference_mode():
        for ids in steps:
            t = torch.tensor([ids])
            positions = torch.arange(pos, pos + len(ids))[None]
            out.append(model(t, positions, cache).clone())
            cache.commit(torch.tensor([len(ids)]))
            pos += len(ids)
    return out


def collective_pieces(group) -> dict:
    """The group's collectives on known inputs: all_reduce, the padded all_gather, broadcast_object."""
    x = torch.full((2, 3), float(group.rank + 1))
    reduced = group.all_reduce(x.clone())
    piece = torch.full((2, 2), float(group.rank))
    gathered = group.all_gather_last(piece, 3)  # [2, 2·world] cut to 3
    obj = group.broadcast_object({"from": group.rank} if group.rank == 0 else None)
    return {"reduced": reduced, "gathered": gathered, "obj": obj}


def _modes():
    from redwood.kv.policies import FullPolicy, SnapKVPolicy, StreamingPolicy
    from redwood.speculation.drafters import ModelDrafter, SelfDrafter
    from redwood.speculation.trees import Tree, resolve_tree

    return {
        "ar": lambda t, d: (None, None),
        "chain-draft-full": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), Tree.chain(3)),
        # (the draft whole on every rank: `sharded_engine_tokens` passes it, rank 0's proposal broadcast)
        "chain-draft-replicated": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), Tree.chain(3)),
        "chain-self-streaming": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), Tree.chain(3)),
        "chain-self-snapkv": lambda t, d: (SelfDrafter(t, SnapKVPolicy(16, window=4)), Tree.chain(3)),
        "tree-self-streaming": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), resolve_tree("generic-16")),
        "tree-draft-full": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), resolve_tree("chains:2x3")),
        # (the draft sharded over ranks 0 … K−1 alone, a `RemoteDraft` on the others: `sharded_engine_tokens`)
        "chain-draft-subset": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), Tree.chain(3)),
        "chain-draft-subset-snapkv": lambda t, d: (ModelDrafter(d, SnapKVPolicy(16, window=4), 320), Tree.chain(3)),
        "tree-draft-subset": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), resolve_tree("chains:2x3")),
    }


def engine_tokens(target, draft, mode: str, prompts, arrivals, max_new: int, replicas=None) -> list[list[int]]:
    """Tokens of every prompt through an Engine running `mode` over `target` / `draft` (whole models, or this rank's
    shards: then every rank runs this same call sequence, in lockstep), requests arriving at the steps `arrivals`
    (continuous batching: joining while others run, leaving as they finish). Greedy, or seeded sampling for a mode
    ending in "-seeded" (temperature 0.8, a seed per prompt; the verifier "auto" picks: `match`, whose numbers are
    keyed by position) or "-sampling" (the same requests, rejection sampling: its numbers and the draft's children's
    come from each row's counter)."""
    from redwood.sampling_params import SamplingParams
    from tests.engine.driver import greedy, run_engine

    seeded = mode.endswith(("-seeded", "-sampling"))
    verifier = "sampling" if mode.endswith("-sampling") else "auto"
    drafter, tree = _modes()[mode.removesuffix("-seeded").removesuffix("-sampling")](target, draft)
    if replicas is not None:
        drafter.replicas = replicas
    params = greedy(max_new)
    if seeded:
        params = [
            SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0.8, seed=i)
            for i in range(len(prompts))
        ]
    _, states, _ = run_engine(
        target, None, prompts, params, drafter=drafter, tree=tree, verifier=verifier, max_num_seqs=2, arrivals=arrivals
    )
    return [list(s.output_ids) for s in states]


def sharded_engine_tokens(group, target: str, draft: str, modes: list[str], prompts, arrivals, max_new: int) -> dict:
    """`engine_tokens` of each mode over this rank's shards of the target and the draft ("-subset" modes: the draft
    on ranks 0 … world/2 − 1 alone)."""
    from redwood.loading import load_model

    t, d = load_model(target, tp=group).model, load_model(draft, tp=group).model
    whole = load_model(draft, weights="float32").model if any("replicated" in m for m in modes) else None
    subset = subset_draft(group, draft, group.world // 2) if any("subset" in m for m in modes) else None
    out = {}
    for mode in modes:
        if "replicated" in mode:  # (the whole draft on this rank, rank 0's proposals every rank's)
            out[mode] = engine_tokens(t, whole, mode, prompts, arrivals, max_new, replicas=group)
        elif "subset" in mode:  # (rank 0's proposals every rank's, as for a replicated draft)
            out[mode] = engine_tokens(t, subset, mode, prompts, arrivals, max_new, replicas=group)
        else:
            out[mode] = engine_tokens(t, d, mode, prompts, arrivals, max_new)
    return out


def subset_draft(group, draft: str, size: int):
    """The draft as `LoadedModels.load` places it on ranks 0 … size−1 (`draft_tensor_parallel=size`): this rank's
    shard over their sub-group (the whole model when size is 1), a `RemoteDraft` on a rank outside them."""
    from redwood.engine.loaded import draft_group
    from redwood.loading import load_model
    from redwood.speculation.drafters import RemoteDraft

    sub = draft_group(group, size)
    if sub is not None and not sub.member:
        return RemoteDraft(model_info(draft).config.vocab_size)
    shard = load_model(draft, weights="float32", tp=sub).model
    assert (shard.shard is None) == (size == 1) and (sub is None or sub.world == size)  # (no rank holds it whole)
    return shard
