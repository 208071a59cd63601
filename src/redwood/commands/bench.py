"""`redwood bench …`: benchmark commands (each prints a short table; `--output DIR` writes a report)."""

from __future__ import annotations

import json

from redwood.commands.options import (
    add_draft_kv_args,
    add_draft_weights_arg,
    add_model_args,
    add_offload_args,
    llm_from_args,
)

_SPEC_HELP = {
    "baseline": (
        "autoregressive tokens/s on long-text prompts (the speculative benches' baseline)",
        "Autoregressive decoding speed on windows of exactly --prefix-len tokens cut from long real "
        "text (essays by default, or --prompts-file): exactly --gen-len tokens per row, EOS ignored. "
        "Several --batch-size / --prefix-len values sweep; one row per combination.",
    ),
    "standalone": (
        "speculation with a small draft model vs. autoregressive, same prompts, same run",
        "MagicDec with a standalone draft model (--draft-model, same tokenizer as --model) whose "
        "KV cache is read through --draft-kv. For every (batch size, prefix length) the "
        "autoregressive baseline and then speculation at each --gamma run on the same prompts; "
        "prints tokens/s, speedup, acceptance and whether greedy outputs are identical.",
    ),
    "selfspec": (
        "self-speculation (the target drafts from a compressed KV view) vs. autoregressive",
        "MagicDec self-speculation: the target drafts for itself reading a compressed view of its own "
        "KV cache (--draft-kv streaming or snapkv, --draft-budget K; default streaming, budget 256). "
        "For every (batch size, prefix length) the autoregressive baseline and then speculation at "
        "each --gamma run on the same prompts; prints tokens/s, speedup, acceptance and whether greedy outputs are identical.",
    ),
}


def _add_prompt_and_sampling_args(p, seed_help: str) -> None:
    """The long-text prompt source (--dataset / --prompts-file / --prompt-seed) and --temperature /
    --top-p / --seed, shared by the benches that cut prompts from long text."""
    src = p.add_argument_group("prompts")
    src.add_argument(
        "--dataset",
        default=None,
        metavar="NAME",
        help="cut prompts from this dataset's concatenated text (`redwood data list`; default essays)",
    )
    src.add_argument(
        "--prompts-file", default=None, metavar="FILE", help="cut prompts from this text file instead of a dataset"
    )
    src.add_argument("--prompt-seed", type=int, default=0, help="seed of the window offsets (default 0)")
    smp = p.add_argument_group("sampling")
    smp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    smp.add_argument("--top-p", type=float, default=1.0)
    smp.add_argument("--seed", type=int, default=None, help=seed_help)


def _add_spec_bench(bench, kind: str) -> None:
    help_, description = _SPEC_HELP[kind]
    p = bench.add_parser(kind, help=help_, description=description)
    add_model_args(p, tensor_parallel=True)
    if kind == "standalone":
        p.add_argument("--draft-model", default=None, metavar="D", help="the draft model (required)")
        add_draft_weights_arg(p)
    p.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1],
        metavar="B",
        help="rows per batch; several values sweep (default 1)",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        nargs="+",
        default=[1024],
        metavar="L",
        help="prompt tokens per row; several values sweep (default 1024)",
    )
    p.add_argument("--gen-len", type=int, default=64, metavar="N", help="tokens generated per row (default 64)")
    add_offload_args(p)
    if kind != "baseline":
        add_draft_kv_args(p, sweep=True)
        p.add_argument(
            "--tree",
            nargs="+",
            default=None,
            metavar="T",
            help="token trees to measure too (chain:G, chains:KxL, a tree JSON file or a shipped "
            "name); without --gamma only these are measured",
        )
    _add_prompt_and_sampling_args(p, seed_help="sampling seed (row b uses seed + b)")
    p.add_argument("--output", default=None, metavar="DIR", help="write report.json (and plots) into this folder")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_spec_bench, bench_kind=kind)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (ar, baseline, standalone, selfspec, report)")
    bench = p.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.required = True

    ar = bench.add_parser(
        "ar",
        help="autoregressive prefill time and decode tokens/s",
        description="Autoregressive decoding speed: greedy, EOS ignored, exactly --gen-len "
        "tokens per row. --compare-hf runs Hugging Face transformers' generate "
        "on the same weights and prompts in the same process.",
    )
    add_model_args(ar, tensor_parallel=True)
    ar.add_argument("--batch-size", type=int, default=1)
    ar.add_argument("--prompt-len", type=int, default=128)
    ar.add_argument("--gen-len", type=int, default=64)
    ar.add_argument(
        "--dataset", default=None, help="cut prompts from this dataset (`redwood data list`); default: random token ids"
    )
    ar.add_argument("--seed", type=int, default=0)
    ar.add_argument("--repeats", type=int, default=1, help="timed runs; the best is reported")
    ar.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate")
    ar.add_argument("--output", default=None, help="write report.json (and plots) into this folder")
    ar.add_argument("--json", action="store_true", help="print the result as JSON")
    ar.set_defaults(func=run_ar)

    for kind in ("baseline", "standalone", "selfspec"):
        _add_spec_bench(bench, kind)

    from redwood.commands.options import add_engine_args, add_speculative_args

    tp = bench.add_parser(
        "throughput",
        help="a stream of requests through the Engine: speculation vs. autoregressive",
        description="Serving throughput and latency: --num-requests prompts of --prompt-len tokens cut from "
        "long text, each generating a length uniform in [--min-new-tokens, --max-new-tokens] (EOS "
        "ignored), arriving as a Poisson process at each --request-rate (requests/s; inf = all at "
        "once) through the continuous-batching Engine — autoregressive and speculative (--draft-model "
        "D or --self-speculate) on the same prompts, lengths and arrivals. Reports output tokens/s, "
        "TTFT, inter-token latency, TPOT, end-to-end latency (p50/p99) and KV blocks in use.",
    )
    add_model_args(tp, tensor_parallel=True)
    tp.add_argument("--num-requests", type=int, default=64, metavar="N", help="requests in the stream (default 64)")
    tp.add_argument(
        "--prompt-len", type=int, default=1024, metavar="L", help="prompt tokens per request (default 1024)"
    )
    tp.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="S",
        help="the first S prompt tokens are one window shared by every request (a long document "
        "or system prompt many requests ask about), the rest each request's own; with "
        "--enable-prefix-caching the shared blocks are computed once (default 0: none shared)",
    )
    tp.add_argument(
        "--min-new-tokens", type=int, default=64, metavar="N", help="fewest tokens a request generates (default 64)"
    )
    tp.add_argument(
        "--max-new-tokens", type=int, default=256, metavar="N", help="most tokens a request generates (default 256)"
    )
    tp.add_argument(
        "--request-rate",
        nargs="+",
        default=["inf"],
        metavar="R",
        help="requests/s of Poisson arrivals, or inf (all at t=0; default); several values: one measurement each",
    )
    tp.add_argument(
        "--workload-seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the output lengths and the arrival times (default 0)",
    )
    tp.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="measure AR and speculation N times each, interleaved (AR, spec, AR, spec, …); each reports its median "
        "run, with every repeat's tokens/s and speedup (default 1)",
    )
    tp.add_argument("--no-spec", action="store_true", help="measure autoregressive decoding only")
    tp.add_argument(
        "--compare-fixed",
        type=int,
        default=None,
        metavar="GAMMA",
        help="with --speculative auto and a model drafter (--draft-model / --self-speculate): also measure that "
        "drafter's fixed chain of GAMMA drafts in this process, on the same prompts (AR, fixed, auto, … per repeat) "
        "— one AR run serves both comparisons",
    )
    add_speculative_args(tp)
    add_offload_args(tp)
    add_engine_args(tp)
    _add_prompt_and_sampling_args(tp, seed_help="sampling seed (request i uses seed + i)")
    tp.add_argument(
        "--output", default=None, metavar="DIR", help="write report.json and throughput.png into this folder"
    )
    tp.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    tp.set_defaults(func=run_throughput)

    _add_serve_bench(bench)

    try:
        from redwood.bench.report import add_report_parser
    except ImportError:
        pass
    else:
        add_report_parser(bench)


def _positive(name: str, value: int) -> None:
    from redwood.errors import ConfigError

    if value < 1:
        raise ConfigError(f"--{name} must be >= 1, got {value}")


def run_ar(args) -> int:
    from redwood.bench.ar import format_result, run_ar_bench

    for name in ("batch_size", "prompt_len", "gen_len", "repeats"):
        _positive(name.replace("_", "-"), getattr(args, name))
    llm = llm_from_args(args)
    result = run_ar_bench(
        llm,
        args.batch_size,
        args.prompt_len,
        args.gen_len,
        compare_hf=args.compare_hf,
        dataset=args.dataset,
        seed=args.seed,
        repeats=args.repeats,
    )
    result.update(model=llm.model_name, dtype=args.dtype, device=args.device)
    if args.output:
        from redwood.bench.report import write_report

        write_report(
            args.output,
            {
                "kind": "ar",
                "models": {"target": llm.model_name},
                "config": {k: result[k] for k in ("batch_size", "prompt_len", "gen_len", "dtype", "device")},
                "runs": [
                    {
                        "engine": "redwood",
                        "batch_size": args.batch_size,
                        "prefix_len": args.prompt_len,
                        "tokens_per_s": result["redwood"]["decode_tokens_per_s"],
                        **result["redwood"],
                    }
                ]
                + (
                    [
                        {
                            "engine": "hf",
                            "batch_size": args.batch_size,
                            "prefix_len": args.prompt_len,
                            "tokens_per_s": result["hf"]["decode_tokens_per_s"],
                            **result["hf"],
                        }
                    ]
                    if "hf" in result
                    else []
                ),
                "aggregate": {k: result[k] for k in ("speedup_vs_hf", "hf_same_tokens") if k in result},
                **({"floor": result["floor"]} if "floor" in result else {}),
            },
        )
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


SELFSPEC_DEFAULT_BUDGET = 256


def run_spec_bench(args) -> int:
    """`redwood bench baseline|standalone|selfspec`: validate everything, load once, sweep, report."""
    import sys

    from redwood.bench.speculative import (
        DEFAULT_DATASET,
        PromptSource,
        check_sizes,
        format_result,
        run_bench,
        to_report,
    )
    from redwood.commands.options import check_draft_kv_args, check_draft_weights_arg, make_speculative_config
    from redwood.errors import ConfigError
    from redwood.sampling_params import SamplingParams

    kind = args.bench_kind
    speculating = kind != "baseline"
    trees = (getattr(args, "tree", None) or []) if speculating else []
    args.tree = None  # the bench sweeps its trees itself; the shared config below is built without one
    gammas = (args.gamma or ([] if trees else [4])) if speculating else []
    check_sizes(args.batch_size, args.prefix_len, args.gen_len, gammas)
    if trees:
        from redwood.speculation.trees import resolve_tree

        for t in trees:
            resolve_tree(t)  # a bad tree fails before any model loads
    SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)  # validates them
    if args.dataset and args.prompts_file:
        raise ConfigError("--dataset and --prompts-file are alternatives; give one")
    source = PromptSource(
        dataset=None if args.prompts_file else (args.dataset or DEFAULT_DATASET), prompts_file=args.prompts_file
    )
    source.check()
    spec = None
    if speculating:
        if kind == "standalone" and not args.draft_model:
            raise ConfigError("bench standalone needs --draft-model D (for self-speculation use bench selfspec)")
        if kind == "selfspec" and args.draft_kv is None:
            # A self-draft over the full cache is the target itself: default to MagicDec's StreamingLLM draft.
            args.draft_kv = "streaming"
            if args.draft_budget is None and args.window is None:
                args.draft_budget = SELFSPEC_DEFAULT_BUDGET
        check_draft_kv_args(args)
        check_draft_weights_arg(args)
        configs = [
            make_speculative_config(
                args, draft_model=getattr(args, "draft_model", None), self_speculate=kind == "selfspec", gamma=g
            )
            for g in gammas or [4]
        ]
        spec = configs[0]  # the draft shape varies per run; everything else is shared
    llm = llm_from_args(args, speculative=spec)
    progress = None if args.json else (lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    result = run_bench(
        llm,
        kind,
        args.batch_size,
        args.prefix_len,
        args.gen_len,
        source,
        gammas,
        trees=trees,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        prompt_seed=args.prompt_seed,
        verifier=spec.verifier if spec else "auto",
        progress=progress,
    )
    if args.output:
        from redwood.bench.report import write_report

        extra = {"prompt_seed": args.prompt_seed}
        if spec is not None:
            extra.update(
                draft_kv=spec.draft_kv,
                draft_budget=spec.draft_budget,
                sinks=spec.sinks,
                window=spec.window,
                pool_kernel=spec.pool_kernel,
                draft_policy=spec.make_policy().describe(),
                draft_weights=spec.draft_weights,
            )
        path = write_report(args.output, to_report(result, extra))
        if not args.json:
            print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def run_throughput(args) -> int:
    """`redwood bench throughput`: validate everything, load the models once, stream AR then spec, report."""
    import sys

    from redwood.bench import throughput as tput
    from redwood.bench.speculative import DEFAULT_DATASET, PromptSource, make_prompts
    from redwood.commands.options import engine_kwargs, speculative_config_from_args
    from redwood.errors import ConfigError
    from redwood.sampling_params import SamplingParams

    tput.check_workload(
        args.num_requests, args.prompt_len, args.min_new_tokens, args.max_new_tokens, args.max_model_len
    )
    if not 0 <= args.shared_prefix_len < args.prompt_len:
        raise ConfigError(
            f"--shared-prefix-len must be in [0, --prompt-len {args.prompt_len}) (the last prompt "
            f"token is each request's own), got {args.shared_prefix_len}"
        )
    rates = tput.parse_rates(args.request_rate)
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    engine_args = engine_kwargs(args)
    for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
        if name in engine_args and engine_args[name] < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {engine_args[name]}")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        raise ConfigError(f"--kv-cache-memory must be > 0 GiB, got {args.kv_cache_memory}")
    engine_args.setdefault("max_num_seqs", tput.DEFAULT_MAX_NUM_SEQS)
    SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)  # validates them
    if args.dataset and args.prompts_file:
        raise ConfigError("--dataset and --prompts-file are alternatives; give one")
    source = PromptSource(
        dataset=None if args.prompts_file else (args.dataset or DEFAULT_DATASET), prompts_file=args.prompts_file
    )
    source.check()
    if args.no_spec:
        if args.draft_model or args.self_speculate or args.draft:
            raise ConfigError(
                "--no-spec measures autoregressive decoding only: drop --draft-model / --self-speculate / --draft"
            )
        spec = speculative_config_from_args(args)  # (errors for speculation flags without a drafter)
    else:
        if not (args.draft_model or args.self_speculate or args.draft or args.speculative == "auto"):
            raise ConfigError(
                "bench throughput compares speculation with autoregressive decoding: give "
                "--draft-model D, --self-speculate, --draft ngram or --speculative auto (or --no-spec for "
                "autoregressive only)"
            )
        if args.self_speculate and args.draft_kv is None:
            # as bench selfspec: a self-draft over the full cache is the target itself
            args.draft_kv = "streaming"
            if args.draft_budget is None and args.window is None:
                args.draft_budget = SELFSPEC_DEFAULT_BUDGET
        spec = speculative_config_from_args(args)
    fixed_tree = None
    if args.compare_fixed is not None:
        if spec is None or spec.policy != "auto" or not (args.draft_model or args.self_speculate):
            raise ConfigError(
                "--compare-fixed GAMMA measures a model drafter's fixed chain beside the automatic policy: give it "
                "with --speculative auto and --draft-model D or --self-speculate"
            )
        if args.compare_fixed < 1:
            raise ConfigError(f"--compare-fixed must be at least 1 draft, got {args.compare_fixed}")
        if getattr(args, "tensor_parallel_size", 1) not in (None, 1):
            raise ConfigError("--compare-fixed runs on one device (no --tensor-parallel-size)")
        from redwood.speculation.trees import Tree

        fixed_tree = Tree.chain(args.compare_fixed)
    # The LLM only loads the models (its own engine is kept minimal and dropped); the bench builds its own.
    llm = llm_from_args(
        args,
        speculative=spec,
        max_num_seqs=1,
        kv_cache_memory=engine_args.get("kv_cache_memory"),
    )
    target, tokenizer, drafter, tree = llm.model, llm.tokenizer, llm.drafter, llm.tree
    auto_drafters = llm.models.auto_drafters
    model_name, draft_name = llm.model_name, llm.draft_name
    contexts = [("the model", target.config.max_position_embeddings)]
    own = getattr(drafter, "own_model", None)
    if own is not None:
        contexts.append(("the draft model", own.config.max_position_embeddings))
    # Sharded models serve one engine at a time, rebuilt per mode on every rank (`Engine.rebuild`); one process
    # builds its engines from the models (the LLM's own, never built, leaves the memory to them).
    base = llm.engine if llm.tp is not None else None
    llm.engine = None
    del llm
    tput.check_context(contexts, args.prompt_len, args.max_new_tokens)
    prompts = tput.shared_prefix_prompts(
        lambda n, length, seed: make_prompts(tokenizer, source, n, length, seed),
        args.num_requests,
        args.prompt_len,
        args.shared_prefix_len,
        args.prompt_seed,
    )
    lengths = tput.output_lengths(args.num_requests, args.min_new_tokens, args.max_new_tokens, args.workload_seed)
    workload = tput.make_workload(prompts, lengths, args.temperature, args.top_p, args.seed)
    result = tput.run_bench(
        target,
        tokenizer,
        workload,
        rates,
        drafter=drafter,
        tree=tree,
        auto_drafters=auto_drafters,
        verifier=spec.verifier if spec else "auto",
        spec=spec is not None,
        engine_args=engine_args,
        model_name=model_name,
        cuda_graphs=None if args.cuda_graphs else False,
        workload_seed=args.workload_seed,
        progress=not args.json,
        repeats=args.repeats,
        base=base,
        fixed_tree=fixed_tree,
    )
    result.update(
        draft=draft_name,
        tree=(args.tree or f"chain:{spec.num_draft_tokens}") if spec else None,
        verifier=spec.verifier if spec else None,
    )
    result["settings"] = {
        "prompts": source.label,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "shared_prefix_len": args.shared_prefix_len,
        "min_new_tokens": args.min_new_tokens,
        "max_new_tokens": args.max_new_tokens,
        "request_rates": result["request_rates"],
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "prompt_seed": args.prompt_seed,
        "workload_seed": args.workload_seed,
        "repeats": args.repeats,
        "compare_fixed": args.compare_fixed,
        "ignore_eos": True,
        "dtype": args.dtype,
        "device": str(target.device),
        **(
            {
                "draft_kv": spec.draft_kv,
                "draft_budget": spec.draft_budget,
                "sinks": spec.sinks,
                "window": spec.window,
                "gamma": spec.num_draft_tokens,
                "draft_weights": spec.draft_weights,
            }
            if spec
            else {}
        ),
    }
    if args.output:
        from pathlib import Path

        from redwood.bench.report import write_report

        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        tput.write_plot(out / tput.PLOT_FILE, result)
        cli = {
            k: v
            for k, v in vars(args).items()
            if k != "func" and isinstance(v, (str, int, float, bool, list, type(None)))
        }
        path = write_report(out, tput.to_report(result, cli))
        tput.add_plot_to_report(path, tput.PLOT_FILE)
        if not args.json:
            print(f"wrote {path} and {out / tput.PLOT_FILE}", file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else tput.format_result(result))
    return 0


def _add_serve_bench(bench) -> None:
    """`redwood bench serve`: the load generator for OpenAI-compatible servers (redwood.bench.serving)."""
    sv = bench.add_parser(
        "serve",
        help="load an OpenAI-compatible server (redwood serve, vLLM, llama-server): TTFT, ITL, tokens/s",
        description="An async load generator for any OpenAI-compatible server: --num-requests streaming "
        "requests (prompts cut from long text as bench throughput cuts them, or chat questions) to "
        "/v1/completions or /v1/chat/completions, arriving as a Poisson process at each "
        "--request-rate (requests/s; inf = all at once), optionally at most --max-concurrency in "
        "flight. Reports output tokens/s, request throughput, TTFT, inter-token latency (per token "
        "and per streamed chunk), TPOT and end-to-end latency (mean, p50, p99) and errors; --output "
        "writes report.json and serve.png (latency vs throughput). --compare A B … plots saved "
        "reports on one figure (e.g. speculation vs none) instead of measuring.",
    )
    sv.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)",
    )
    sv.add_argument(
        "--endpoint",
        default="completions",
        metavar="{completions,chat}",
        help="/v1/completions with the prompt text (default) or /v1/chat/completions with one user message",
    )
    sv.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the model name sent with each request (default: the first of GET /v1/models)",
    )
    sv.add_argument("--api-key", default=None, metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    sv.add_argument(
        "--tokenizer",
        default=None,
        metavar="T",
        help="zoo name, HF folder or .gguf whose tokenizer cuts prompts of exactly --prompt-len "
        "tokens (default: the model name, when it is a local path or a pulled zoo model)",
    )
    sv.add_argument("--label", default=None, help="this run's name in the report and plots (default: the model)")
    sv.add_argument("--num-requests", type=int, default=64, metavar="N", help="requests per run (default 64)")
    sv.add_argument(
        "--prompt-len",
        type=int,
        default=1024,
        metavar="L",
        help="prompt tokens per request for long-text and document datasets (default 1024)",
    )
    sv.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="S",
        help="the first S of each long-text prompt's tokens are one window common to every request "
        "(many users asking about one document: what a server's prefix cache serves; default 0)",
    )
    sv.add_argument("--max-tokens", type=int, default=256, metavar="N", help="max_tokens of each request (default 256)")
    sv.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="draw each request's max_tokens uniformly from [N, --max-tokens] (seeded)",
    )
    sv.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM / llama.cpp / redwood extension) so every request generates max_tokens",
    )
    sv.add_argument(
        "--request-rate",
        nargs="+",
        default=["inf"],
        metavar="R",
        help="requests/s of Poisson arrivals, or inf (all at t=0; default); several values: one run each",
    )
    sv.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=None,
        metavar="C",
        help="at most C requests in flight (several values: one run each, for every rate)",
    )
    sv.add_argument(
        "--workload-seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the arrival times and output lengths (default 0)",
    )
    sv.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="send N short requests (at most 16 tokens) first, untimed (default 0)",
    )
    sv.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds without data from the server before a request counts as failed (default 300)",
    )
    _add_prompt_and_sampling_args(sv, seed_help="seed sent with request i as seed + i (default: none sent)")
    sv.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="REPORT",
        help="plot these bench serve reports (report.json files or their folders) on one figure and "
        "print their runs with ratios to the first; no requests are sent",
    )
    sv.add_argument("--output", default=None, metavar="DIR", help="write report.json and serve.png into this folder")
    sv.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    sv.set_defaults(func=run_serve)


def _output_folder(path: str):
    """--output DIR, created (a one-line error when it cannot be)."""
    from pathlib import Path

    from redwood.errors import ConfigError

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output {out}: cannot create the folder ({e.strerror or e})") from None
    return out


def run_serve(args) -> int:
    """`redwood bench serve`: validate the flags, find the model and prompts, run every load, report."""
    import asyncio
    import sys
    from pathlib import Path

    from redwood.bench import serving
    from redwood.bench import throughput as tput
    from redwood.bench.speculative import DEFAULT_DATASET, PromptSource
    from redwood.errors import ConfigError

    if args.compare:
        if args.base_url:
            raise ConfigError("--compare plots saved reports; it sends no requests: drop --base-url")
        reports = serving.load_reports(args.compare)
        if args.output:
            out = _output_folder(args.output)
            print(f"wrote {serving.write_plot(out / serving.PLOT_FILE, reports)}", file=sys.stderr)
        print(serving.format_comparison(reports))
        return 0
    if not args.base_url:
        raise ConfigError("bench serve needs --base-url URL (the server to load), or --compare REPORT… to plot")
    base_url = serving.normalize_base_url(args.base_url)
    endpoint = serving.parse_endpoint(args.endpoint)
    serving.check_settings(
        args.num_requests, args.max_tokens, args.min_tokens, args.temperature, args.top_p, args.timeout, args.warmup
    )
    if args.prompt_len < 1:
        raise ConfigError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if not 0 <= args.shared_prefix_len < args.prompt_len:
        raise ConfigError(
            f"--shared-prefix-len must be in [0, --prompt-len {args.prompt_len}) (the last prompt "
            f"token is each request's own), got {args.shared_prefix_len}"
        )
    rates = tput.parse_rates(args.request_rate)
    caps = serving.parse_concurrency(args.max_concurrency)
    if args.dataset and args.prompts_file:
        raise ConfigError("--dataset and --prompts-file are alternatives; give one")
    source = PromptSource(
        dataset=None if args.prompts_file else (args.dataset or DEFAULT_DATASET), prompts_file=args.prompts_file
    )
    source.check()
    out = _output_folder(args.output) if args.output else None  # (before any request: fail early)
    settings = serving.Settings(
        base_url=base_url,
        endpoint=endpoint,
        model=args.model or "",
        api_key=args.api_key,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
    )
    if not settings.model:

        async def first_model():
            async with serving.make_client(settings) as client:
                return await serving.server_model(client, settings)

        settings.model = asyncio.run(first_model())
    tokenizer = None
    tok_spec = args.tokenizer or serving.local_tokenizer_spec(settings.model)
    if args.tokenizer or (tok_spec and serving.needs_tokenizer(source)):
        tokenizer = serving.load_tokenizer(tok_spec)
    prompts = serving.text_prompts(
        source, args.num_requests, args.prompt_len, args.prompt_seed, tokenizer, shared_len=args.shared_prefix_len
    )
    lengths = (
        [args.max_tokens] * args.num_requests
        if args.min_tokens is None
        else tput.output_lengths(args.num_requests, args.min_tokens, args.max_tokens, args.workload_seed)
    )
    label = args.label or Path(settings.model).name or settings.model  # (a path's last part)
    result = asyncio.run(
        serving.run_bench(
            settings,
            prompts,
            lengths,
            rates,
            caps,
            label=label,
            workload_seed=args.workload_seed,
            warmup=args.warmup,
            count_tokens=serving.token_counter(tokenizer),
            progress=not args.json,
        )
    )
    result["settings"] = {
        "prompts": source.label,
        "token_exact": serving.needs_tokenizer(source),
        "prompt_len": args.prompt_len,
        "shared_prefix_len": args.shared_prefix_len,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "min_tokens": args.min_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "prompt_seed": args.prompt_seed,
        "workload_seed": args.workload_seed,
        "warmup": args.warmup,
        "timeout_s": args.timeout,
        "tokenizer": tok_spec if tokenizer is not None else None,
    }
    if out is not None:
        from redwood.bench.report import write_report

        serving.write_plot(out / serving.PLOT_FILE, [(label, result)])
        cli = {
            k: v
            for k, v in vars(args).items()
            if k not in ("func", "api_key") and isinstance(v, (str, int, float, bool, list, type(None)))
        }
        path = write_report(out, serving.to_report(result, cli))
        tput.add_plot_to_report(path, serving.PLOT_FILE)
        if not args.json:
            print(f"wrote {path} and {out / serving.PLOT_FILE}", file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else serving.format_result(result))
    return 0 if any(r["completed"] for r in result["runs"]) else 1
