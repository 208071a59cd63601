"""`redwood acceptance`: measure a draft's per-rank acceptance vector against a target (Sequoia §6).

Writes a ``redwood.acceptance/1`` record that `redwood tree-search --acceptance` reads. See
`redwood.tuning.measure` for the two methods and for which slice of a dataset is used (held out from
evaluation prompts).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from redwood.commands.options import (
    DEFAULT_POOL_KERNEL,
    add_draft_cache_args,
    add_graphs_arg,
    add_threads_arg,
    apply_threads_arg,
    check_draft_cache_args,
    check_draft_weights_arg,
)
from redwood.errors import ConfigError


def register(subparsers) -> None:
    from redwood.llm import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

    p = subparsers.add_parser(
        "acceptance",
        help="measure a draft model's per-rank acceptance vector (for tree-search)",
        description="Per-rank acceptance of the draft's children: dynamic (real speculative generation with a "
        "depth-1 tree of width W; histogram of the accepted rank) or static (teacher-forced "
        "expected acceptance on real text). Measurement prompts are held out from evaluation "
        "prompts (the back of the dataset's seed-0 document order).",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="D",
        help=f"draft model sharing the target's tokenizer (default: {DEFAULT_DRAFT_MODEL})",
    )
    p.add_argument(
        "--self-speculate",
        action="store_true",
        help="the target drafts for itself through a compressed cache (MagicDec; --mode dynamic with "
        "--draft-kv streaming or snapkv)",
    )
    p.add_argument("--width", type=int, required=True, metavar="W", help="children of the root to rank")
    p.add_argument(
        "--mode",
        required=True,
        metavar="{dynamic,static}",
        help="dynamic: on-policy generation; static: teacher-forced expectation on real text",
    )
    p.add_argument("--temperature", type=float, required=True, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold (default 1.0 = off)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", metavar="NAME", help="a dataset (`redwood data list`)")
    src.add_argument("--prompts", metavar="FILE", help="a UTF-8 text file, one prompt per line")
    p.add_argument("--num-prompts", type=int, default=16, metavar="N", help="prompts / texts used (default 16)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=128,
        metavar="L",
        help="prompt tokens (default 128; chat datasets use the whole templated prompt)",
    )
    p.add_argument(
        "--gen-len",
        type=int,
        default=128,
        metavar="N",
        help="dynamic: tokens generated per prompt; static: continuation tokens scored (default 128)",
    )
    p.add_argument(
        "--verifier",
        default=None,
        metavar="{sequoia,specinfer,topk,greedy}",
        help="verifier whose acceptance is measured (default: greedy at temperature 0, else sequoia)",
    )
    p.add_argument(
        "--batch-size", type=int, default=1, metavar="B", help="dynamic: prompts generated together (default 1)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i; default 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    from redwood.commands.options import add_draft_weights_arg, add_weights_arg

    add_weights_arg(p)
    add_draft_weights_arg(p)
    add_graphs_arg(p)
    add_threads_arg(p)
    add_draft_cache_args(p.add_argument_group("draft KV (dynamic mode: the draft reads the context through it)"))
    p.add_argument("--output", "-o", required=True, metavar="FILE", help="write the vector here (JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_run)


def _check(args) -> str:
    from redwood.tuning.measure import MODES, check_settings, default_verifier

    if args.mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {args.mode!r}")
    if args.width < 1:
        raise ConfigError(f"--width must be at least 1, got {args.width}")
    for name in ("num_prompts", "prompt_len", "gen_len", "batch_size"):
        v = getattr(args, name)
        if v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if args.mode == "dynamic" and args.gen_len < 2:
        raise ConfigError("--gen-len must be at least 2 in dynamic mode (the first token comes from the prefill)")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    check_draft_cache_args(args)
    compressed = args.draft_kv not in (None, "full")
    if args.self_speculate and args.draft_model:
        raise ConfigError("--draft-model and --self-speculate are mutually exclusive; pick one drafter")
    check_draft_weights_arg(args, default_draft=True)  # (without --draft-model: the default draft model)
    if args.mode == "static" and (compressed or args.self_speculate):
        raise ConfigError(
            "a compressed draft cache (--draft-kv / --self-speculate) is measured in --mode dynamic "
            "(teacher-forced scoring has no draft cache)"
        )
    if args.self_speculate and not compressed:
        raise ConfigError(
            "--self-speculate needs --draft-kv streaming or snapkv: with the full cache the draft "
            "is the target and accepts everything"
        )
    verifier = args.verifier or default_verifier(args.temperature)
    try:
        check_settings(args.width, args.temperature, args.top_p, verifier)
    except ConfigError as e:
        raise ConfigError(f"--verifier: {e}" if "verifier" in str(e) else str(e)) from None
    if args.dataset:
        from redwood.data.recipes import get_recipe

        get_recipe(args.dataset)
    else:
        from redwood.tuning.measure import read_prompt_file

        read_prompt_file(args.prompts)
    return verifier


def _progress(quiet: bool, what: str):
    if quiet:
        return None

    def report(done: int, total: int, samples: int) -> None:
        print(
            f"\r{what}: {done}/{total} prompts, {samples} samples",
            end="" if done < total else "\n",
            file=sys.stderr,
            flush=True,
        )

    return report


def _run(args: argparse.Namespace) -> int:
    from redwood.llm import DEFAULT_DRAFT_MODEL
    from redwood.tuning.acceptance import save_acceptance
    from redwood.tuning.measure import (
        dataset_texts,
        file_texts,
        make_vector,
        measure_dynamic,
        measure_static,
        read_prompt_file,
        star_tree_spec,
    )

    verifier = _check(args)
    apply_threads_arg(args)  # (the static mode loads the models itself)
    if not args.self_speculate and not args.draft_model:
        args.draft_model = DEFAULT_DRAFT_MODEL
    static = args.mode == "static"
    t0 = time.perf_counter()

    if static:
        from redwood.loading import load_draft_model, load_model
        from redwood.speculation.drafters import check_compatible

        tgt = load_model(args.model, dtype=args.dtype, device=args.device, weights=args.weights)
        drf = load_draft_model(
            args.draft_model, dtype=args.dtype, device=args.device, draft_weights=args.draft_weights or "auto"
        )
        check_compatible(tgt.tokenizer, drf.tokenizer, tgt.config.vocab_size, drf.config.vocab_size)
        tokenizer, max_pos = tgt.tokenizer, min(tgt.config.max_position_embeddings, drf.config.max_position_embeddings)
        target_name, draft_name = tgt.source, drf.source
    else:
        from redwood.commands.options import llm_from_args
        from redwood.speculation.config import SpeculativeConfig

        spec = SpeculativeConfig(
            draft_model=args.draft_model,
            self_speculate=args.self_speculate,
            tree=star_tree_spec(args.width),
            verifier=verifier,
            draft_kv=args.draft_kv or "full",
            draft_budget=args.draft_budget,
            sinks=args.sinks,
            window=args.window,
            pool_kernel=DEFAULT_POOL_KERNEL if args.pool_kernel is None else args.pool_kernel,
            draft_weights=args.draft_weights or "auto",
        )
        llm = llm_from_args(args, speculative=spec)
        tokenizer, max_pos = llm.tokenizer, llm.config.max_position_embeddings
        target_name = llm.model_name
        draft_name = llm.model_name if args.self_speculate else args.draft_model
        if spec.draft_kv != "full":  # the draft is the model *and* the cache it reads
            draft_name += f" [{spec.make_policy().describe()}]"
    if tokenizer is None:
        raise ConfigError(f"{args.model} has no tokenizer, so text cannot be turned into prompts")

    if args.dataset:
        texts, split = dataset_texts(tokenizer, args.dataset, args.num_prompts, args.prompt_len, args.gen_len, static)
        dataset = args.dataset
    else:
        texts = file_texts(
            tokenizer, read_prompt_file(args.prompts), args.num_prompts, args.prompt_len, args.gen_len, static
        )
        split = "file order"
        dataset = f"file:{args.prompts}"
    longest = max(len(t.ids) for t in texts) + (0 if static else args.gen_len + args.width)
    if longest > max_pos:
        raise ConfigError(
            f"prompts of up to {max(len(t.ids) for t in texts)} tokens"
            + ("" if static else f" + {args.gen_len} generated + {args.width} tree nodes")
            + f" exceed the model's context of {max_pos} tokens; lower --prompt-len / --gen-len"
        )

    notes = {
        "verifier": verifier,
        "draft_kv": args.draft_kv or "full",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "num_prompts": len(texts),
        "seed": args.seed,
        "dtype": args.dtype,
        "device": args.device,
        "prompts": {"source": "dataset" if args.dataset else "file", "split": split, "ids": [t.source for t in texts]},
        "command": "redwood " + shlex.join(sys.argv[1:]) if sys.argv and "redwood" in sys.argv[0] else None,
    }
    if notes["command"] is None:
        del notes["command"]
    if static:
        res = measure_static(
            tgt.model,
            drf.model,
            [(t.ids, t.context) for t in texts],
            args.width,
            args.temperature,
            args.top_p,
            verifier,
            seed=args.seed,
            progress=_progress(args.quiet, "static"),
        )
        notes["expected_none"] = res.expected_none
        vec = make_vector(
            "static",
            res.values,
            target=target_name,
            draft=draft_name,
            temperature=args.temperature,
            top_p=args.top_p,
            dataset=dataset,
            samples=res.positions,
            p_none=None,
            notes=notes,
        )
        summary = f"{res.positions} positions"
    else:
        res = measure_dynamic(
            llm,
            [t.ids for t in texts],
            args.width,
            args.temperature,
            args.top_p,
            args.gen_len,
            seed=args.seed,
            batch_size=args.batch_size,
            progress=_progress(args.quiet, "dynamic"),
        )
        notes.update(
            {
                "counts": res.counts,
                "none": res.none,
                "generated_tokens": res.generated_tokens,
                "tree": star_tree_spec(args.width),
            }
        )
        vec = make_vector(
            "dynamic",
            res.values,
            target=target_name,
            draft=draft_name,
            temperature=args.temperature,
            top_p=args.top_p,
            dataset=dataset,
            samples=res.steps,
            p_none=res.p_none,
            notes=notes,
        )
        summary = f"{res.steps} steps, {res.generated_tokens} tokens"
    save_acceptance(vec, args.output)
    shown = ", ".join(f"{v:.4f}" for v in vec.values[:8]) + (" ..." if vec.width > 8 else "")
    none = vec.p_none if vec.p_none is not None else notes["expected_none"]
    print(
        f"{args.mode} acceptance ({verifier}, W={args.width}, T={args.temperature}, top-p={args.top_p}; "
        f"{summary} over {len(texts)} prompts):"
    )
    print(f"  p_1..p_{vec.width} = {shown}")
    print(f"  sum = {sum(vec.values):.4f}, none = {none:.4f}")
    print(f"wrote {args.output} in {time.perf_counter() - t0:.1f} s")
    return 0
