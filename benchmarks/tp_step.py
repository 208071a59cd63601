"""Tensor parallelism's step times: one forward (decode, or a verify of T tokens) of a model of a real shape with
random weights (a step's time does not depend on the weights' values), on 1 rank or on every rank torchrun starts,
and the collectives it runs by themselves — so a TP=N step splits into compute and communication.

Usage (CPU: gloo; --device cuda: NCCL, one GPU a rank):
    PYTHONPATH=src python benchmarks/tp_step.py --shape 0.5b [--tokens 1 4 16] [--batch 1] [--context 512]
    PYTHONPATH=src torchrun --nproc_per_node 2 benchmarks/tp_step.py --shape 0.5b …
Options: --dtype (float32 on the CPU, bfloat16 on CUDA by default), --weights (CPU: the projections packed in a
CPU format — w8a8, q4k, int8 …: the formats the CPU runs; the random float32 model by default), --layers L (the first L layers only: a
quicker CPU run; the per-layer costs are what count), --no-graphs (CUDA: eager steps; by default each step is
one CUDA graph, the all-reduces captured inside it), --repeats, --json FILE (rank 0 writes its rows).
Rank 0 prints one row a token count, the short table last:
    tokens  step ms  all-reduce ms (one)  collectives ms (2 L + 1 all-reduces + the logits' gather)  share
Each rank holds 1/N of the projections and of the KV heads (`redwood.models.shard`); every rank times the same
forwards (their collectives keep them in step). Shapes: 0.5b / 1.5b (Qwen2.5-Coder), 8b (Llama-3.1-8B), 7b
(Qwen2.5-7B).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from redwood.config import ModelConfig
from redwood.engine.runner import time_ms

QWEN_1_5B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
}
SHAPES = {
    "1.5b": QWEN_1_5B,
    "0.5b": {
        **QWEN_1_5B,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
    },
    "7b": {
        **QWEN_1_5B,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
}


def group_and_device(device: str):
    """(this rank's TPGroup or None, its device): torchrun's ranks join one group."""
    from redwood.parallel import launch

    dev = torch.device(device)
    if (launch.torchrun_world() or 1) > 1:
        group = launch.join(dev)
        return group, group.device
    return None, dev


def random_shard(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, group, weights: str = "float32", plain: bool = False
):
    """This rank's shard of a model of `cfg`, random weights of the shard's own shapes (no rank builds the
    whole model), its projections then packed in the CPU format `weights` (`Transformer.quantize_cpu`); plain: run
    the plain layers (the reference backend) as a tensor-parallel shard does, not the device's fused paths."""
    from redwood.models.transformer import Transformer, build_model

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg, tp=group).state_dict().items()}
    g = torch.Generator(device=device).manual_seed(0 if group is None else group.rank)
    state = {k: torch.randn(s, device=device, generator=g, dtype=dtype) * 0.02 for k, s in shapes.items()}
    model = build_model(cfg, state, dtype, device, tp=group)
    model.set_execution()
    model.quantize_cpu(weights)
    if plain:  # (what a tensor-parallel shard runs: `backends._tensor_parallel`)
        from redwood.models.backends.reference import ReferenceBackend

        model.backend = ReferenceBackend(model.execution)
    return model


def skip_collectives(group) -> None:
    """The model's all-reduces and logits gather made local no-ops (wrong sums, the right shapes): each rank's
    compute alone, all ranks running at once — a TP step less this is its collectives plus the ranks waiting for
    one another at each of them."""
    group.all_reduce = lambda x: x
    group.all_gather_last = lambda x, full: torch.cat([x] * group.world, dim=-1)[..., :full]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--weights", default="float32", help="CPU: the projections' packed format (w8a8, q4k, int8, …; float32: none)"
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="TP=1 through the plain layers tensor parallelism runs (not the CPU's fused C++ layer / packed paths, "
        "nor the CUDA backend's kernels): what TP itself adds",
    )
    p.add_argument(
        "--skip-collectives",
        action="store_true",
        help="TP>1: the forward's collectives made no-ops (wrong logits): each rank's compute alone, timed",
    )
    p.add_argument("--layers", type=int, default=None, help="only the first L layers (quicker on the CPU)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16], help="new tokens a row per forward")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="keys already in each row's cache")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-graphs", action="store_true", help="CUDA: eager steps")
    p.add_argument("--json", default=None, metavar="FILE", help="rank 0 writes its rows here")
    args = p.parse_args()

    group, device = group_and_device(args.device)
    world, rank = (1, 0) if group is None else (group.world, group.rank)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    cfg = ModelConfig.from_hf_dict(shape)
    if args.skip_collectives and group is not None:
        skip_collectives(group)
    model = random_shard(cfg, dtype, device, group, args.weights, args.plain)

    from redwood.engine.runner import StepRunner

    B, C = args.batch, args.context
    cache = model.new_cache(B, C + max(args.tokens))
    runner = StepRunner(model, cache, use_graphs=device.type == "cuda" and not args.no_graphs)
    rows = []
    with torch.inference_mode():
        for T in args.tokens:
            cache.lengths.fill_(C)  # (the keys' values do not change a forward's time)
            ids = torch.zeros(B, T, dtype=torch.long, device=device)
            positions = (C + torch.arange(T, device=device))[None].expand(B, T)
            step = time_ms(lambda: runner.forward(ids, positions), device, args.repeats, warmup=2)
            reduce_ms = gather_ms = 0.0
            if group is not None and not args.skip_collectives:  # the step's collectives by themselves, same sizes
                x = torch.zeros(B * T, cfg.hidden_size, dtype=dtype, device=device)
                reduce_ms = time_ms(lambda: group.all_reduce(x), device, args.repeats, warmup=2)
                piece = torch.zeros(B, T, -(-cfg.vocab_size // world), dtype=torch.float32, device=device)
                gather_ms = time_ms(
                    lambda: group.all_gather_last(piece, cfg.vocab_size), device, args.repeats, warmup=2
                )
            comm = (2 * cfg.num_layers + 1) * reduce_ms + gather_ms
            rows.append(
                {
                    "shape": args.shape,
                    "layers": cfg.num_layers,
                    "world": world,
                    "device": str(device.type),
                    "dtype": str(dtype).removeprefix("torch."),
                    "weights": args.weights,
                    "backend": type(model.backend).__name__,
                    "collectives_skipped": bool(args.skip_collectives),
                    "threads": torch.get_num_threads(),
                    "batch": B,
                    "context": C,
                    "tokens": T,
                    "step_ms": round(step, 3),
                    "all_reduce_ms": round(reduce_ms, 4),
                    "gather_ms": round(gather_ms, 4),
                    "collectives_ms": round(comm, 3),
                }
            )
    if rank == 0:
        head = (
            f"{args.shape} ({cfg.num_layers} layers) on {world} rank(s), {device.type} {rows[0]['dtype']} "
            f"({args.weights} projections, {type(model.backend).__name__}"
            f"{', collectives skipped' if args.skip_collectives else ''}), batch {B}, context {C}, {torch.get_num_threads()} thread(s) a rank"
        )
        print(head)
        print(f"{'tokens':>6} {'step ms':>9} {'all-reduce ms':>14} {'collectives ms':>15} {'share':>6}")
        for r in rows:
            share = r["collectives_ms"] / r["step_ms"] if r["step_ms"] else 0.0
            print(
                f"{r['tokens']:>6} {r['step_ms']:>9.2f} {r['all_reduce_ms']:>14.3f} {r['collectives_ms']:>15.2f} {share:>6.0%}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    if group is not None:
        group.barrier()
        group.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
