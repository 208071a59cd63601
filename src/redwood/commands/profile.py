"""`redwood profile`: measure target / draft forward latencies on this device for `redwood tree-search --profile`."""

from __future__ import annotations

import argparse
import sys
import time

from redwood.commands.options import (
    DEFAULT_POOL_KERNEL,
    add_draft_cache_args,
    add_graphs_arg,
    add_offload_args,
    add_threads_arg,
    apply_threads_arg,
    check_draft_cache_args,
    check_draft_weights_arg,
    offload_kwargs,
)
from redwood.errors import ConfigError


def register(subparsers) -> None:
    from redwood.llm import DEFAULT_MODEL
    from redwood.tuning.profile import DEFAULT_TOKENS, DEFAULT_WIDTHS

    p = subparsers.add_parser(
        "profile",
        help="measure forward latencies on this device (for tree-search --profile)",
        description="Target forward latency against the number of new tokens (a tree-shaped mask, after a "
        "prefill of --context tokens), draft forward latency against width, and the per-step "
        "sampling/verification overhead; median of --repeats runs after warm-up. Writes a "
        "redwood.profile/1 JSON file.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--draft-model", default=None, metavar="D", help="draft model (default: time the target itself as the draft)"
    )
    p.add_argument("--batch-size", type=int, default=1, metavar="B", help="rows per forward (default 1)")
    p.add_argument("--context", type=int, default=256, metavar="L", help="tokens prefilled first (default 256)")
    p.add_argument(
        "--tokens",
        default=",".join(map(str, DEFAULT_TOKENS)),
        metavar="N1,N2,...",
        help="target sizes: new tokens per forward, must include 1 (default %(default)s)",
    )
    p.add_argument(
        "--widths",
        default=",".join(map(str, DEFAULT_WIDTHS)),
        metavar="W1,W2,...",
        help="draft widths: nodes per draft forward, must include 1 (default %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=5, metavar="R", help="timed runs per size; median (default 5)")
    p.add_argument("--warmup", type=int, default=2, metavar="K", help="untimed runs per size first (default 2)")
    p.add_argument("--no-overhead", action="store_true", help="skip the sampling/verification overhead")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.6,
        help="overhead: sampling temperature (default 0.6; 0 = greedy verification)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="overhead: nucleus threshold (default 1.0)")
    p.add_argument(
        "--verifier",
        default=None,
        metavar="{sequoia,specinfer,topk,greedy}",
        help="overhead: verifier timed (default: greedy at temperature 0, else sequoia)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    from redwood.commands.options import add_draft_weights_arg, add_weights_arg

    add_weights_arg(p)
    add_draft_weights_arg(p)
    add_graphs_arg(p)
    add_threads_arg(p)  # (latencies on the CPU depend on it: profile with the threads you will run with)
    p.add_argument("--output", "-o", default=None, metavar="FILE", help="write the profile here (JSON)")
    p.add_argument(
        "--for-policy",
        action="store_true",
        help="instead: calibrate the cost model of `--speculative auto` for this model (and --draft-model), "
        "weights, threads and device, into the cache a later run reads (REDWOOD_HOME/costs); --output not needed",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_offload_args(p)  # profile the target as an offloaded run streams it (the draft stays resident)
    add_draft_cache_args(
        p.add_argument_group(
            "draft KV (the draft forwards read the context through it, as a compressed draft runs: e.g. "
            "MagicDec self-speculation with --draft-kv streaming --draft-budget 256)"
        )
    )
    p.set_defaults(func=_run)


def _for_policy(args: argparse.Namespace) -> int:
    """Load the models as `generate --speculative auto` with the same flags would, and build the engine: its
    calibration lands in the cache (or is found there already)."""
    from redwood.commands.options import llm_from_args
    from redwood.speculation.config import SpeculativeConfig

    if args.output is not None:
        raise ConfigError("--for-policy writes the cost-model cache, not a profile: drop --output")
    check_draft_weights_arg(args)
    spec = SpeculativeConfig(draft_model=args.draft_model, draft_weights=args.draft_weights or "auto", policy="auto")
    t0 = time.perf_counter()
    llm = llm_from_args(args, speculative=spec, max_num_seqs=1)
    engine = llm.engine  # (built now: the calibration runs, or the cache is read)
    table = engine.policy.costs.table
    print(f"cost model for {llm.model_name}" + (f" + {args.draft_model}" if args.draft_model else ""))
    for name, curve in (("target", table.target), ("draft", table.draft)):
        if curve is not None:
            ms = "  ".join(f"{n}: {t * 1e3:.3f}" for n, t in zip(curve.tokens, curve.lo_s))
            print(f"{name} ms by new tokens (context {curve.lo_ctx}): {ms}")
    print(f"cache {engine.policy.costs_path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.for_policy:
        return _for_policy(args)
    if args.output is None:
        raise ConfigError("--output FILE is required (or --for-policy)")
    from redwood.sample.tree_verify import VERIFIERS
    from redwood.tuning.profile import measure_profile, parse_sizes
    from redwood.tuning.tree_search import save_profile

    tokens = parse_sizes(args.tokens, "--tokens")
    widths = parse_sizes(args.widths, "--widths")
    for name in ("batch_size", "context", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.verifier is not None and args.verifier not in VERIFIERS:
        raise ConfigError(f"--verifier must be one of {', '.join(VERIFIERS)}, got {args.verifier!r}")
    if args.verifier == "greedy" and args.temperature > 0:
        raise ConfigError("--verifier greedy is exact only at --temperature 0")
    check_draft_cache_args(args)
    from redwood.kv.policies import make_policy

    policy = make_policy(
        args.draft_kv or "full",
        budget=args.draft_budget,
        sinks=args.sinks,
        window=args.window,
        kernel=DEFAULT_POOL_KERNEL if args.pool_kernel is None else args.pool_kernel,
    )
    check_draft_weights_arg(args)  # (--draft-weights int8 on CUDA: the one-token forwards on int8 copies)

    from redwood.loading import load_draft_model, load_model

    offload = offload_kwargs(args)
    apply_threads_arg(args)
    t0 = time.perf_counter()
    target = load_model(
        args.model,
        dtype=args.dtype,
        device="cpu" if offload["offload"] else args.device,
        weights="float32" if offload["offload"] else args.weights,
    )
    if offload["offload"]:  # as LLM(offload=True): layers in (pinned) host memory, the rest on the device
        from redwood.models.offload import offload_layers

        offload_layers(target.model, args.device, prefetch=offload["offload_prefetch"])
    draft = (
        load_draft_model(
            args.draft_model, dtype=args.dtype, device=args.device, draft_weights=args.draft_weights or "auto"
        )
        if args.draft_model
        else None
    )
    say = None if args.quiet else (lambda msg: print(f"profiling: {msg}", file=sys.stderr, flush=True))
    prof = measure_profile(
        target.model,
        draft.model if draft else None,
        target_name=target.source,
        draft_name=draft.source if draft else None,
        tokens=tokens,
        widths=widths,
        batch=args.batch_size,
        context=args.context,
        repeats=args.repeats,
        warmup=args.warmup,
        overhead=not args.no_overhead,
        temperature=args.temperature,
        top_p=args.top_p,
        verifier=args.verifier,
        dtype=args.dtype,
        progress=say,
        cuda_graphs=args.cuda_graphs,
        draft_policy=None if policy.name == "full" else policy,
    )
    save_profile(prof, args.output)
    print(f"device: {prof.device}, {args.dtype}, batch {prof.batch}, context {prof.context}")
    print("target ms by tokens: " + "  ".join(f"{n}: {ms:.3f}" for n, ms in zip(prof.target_tokens, prof.target_ms)))
    who = ("draft" if draft else "draft (= target)") + ("" if policy.name == "full" else f", {policy.describe()}")
    print(f"{who} ms by width: " + "  ".join(f"{w}: {ms:.3f}" for w, ms in zip(prof.draft_width, prof.draft_ms)))
    if prof.overhead_tokens is not None:
        print(
            "overhead ms by tokens: "
            + "  ".join(f"{n}: {ms:.3f}" for n, ms in zip(prof.overhead_tokens, prof.overhead_ms))
        )
    print(f"wrote {args.output} in {time.perf_counter() - t0:.1f} s")
    return 0
