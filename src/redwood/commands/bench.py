"""`redwood bench …`: benchmark commands (each prints a short table; `--output DIR` writes a report)."""

from __future__ import annotations

import json

from redwood.commands.generate import add_model_args


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (ar, report)")
    bench = p.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.required = True

    ar = bench.add_parser("ar", help="autoregressive prefill time and decode tokens/s",
                          description="Autoregressive decoding speed: greedy, EOS ignored, exactly --gen-len "
                                      "tokens per row. --compare-hf runs Hugging Face transformers' generate "
                                      "on the same weights and prompts in the same process.")
    add_model_args(ar)
    ar.add_argument("--batch-size", type=int, default=1)
    ar.add_argument("--prompt-len", type=int, default=128)
    ar.add_argument("--gen-len", type=int, default=64)
    ar.add_argument("--dataset", default=None,
                    help="cut prompts from this dataset (`redwood data list`); default: random token ids")
    ar.add_argument("--seed", type=int, default=0)
    ar.add_argument("--repeats", type=int, default=1, help="timed runs; the best is reported")
    ar.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate")
    ar.add_argument("--output", default=None, help="write report.json (and plots) into this folder")
    ar.add_argument("--json", action="store_true", help="print the result as JSON")
    ar.set_defaults(func=run_ar)

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
    from redwood.llm import LLM

    for name in ("batch_size", "prompt_len", "gen_len", "repeats"):
        _positive(name.replace("_", "-"), getattr(args, name))
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    result = run_ar_bench(llm, args.batch_size, args.prompt_len, args.gen_len, compare_hf=args.compare_hf,
                          dataset=args.dataset, seed=args.seed, repeats=args.repeats)
    result.update(model=llm.model_name, dtype=args.dtype, device=args.device)
    if args.output:
        from redwood.bench.report import write_report

        write_report(args.output, {
            "kind": "ar", "models": {"target": llm.model_name},
            "config": {k: result[k] for k in ("batch_size", "prompt_len", "gen_len", "dtype", "device")},
            "runs": [{"engine": "redwood", "batch_size": args.batch_size, "prefix_len": args.prompt_len,
                      "tokens_per_s": result["redwood"]["decode_tokens_per_s"], **result["redwood"]}]
                    + ([{"engine": "hf", "batch_size": args.batch_size, "prefix_len": args.prompt_len,
                         "tokens_per_s": result["hf"]["decode_tokens_per_s"], **result["hf"]}]
                       if "hf" in result else []),
            "aggregate": {k: result[k] for k in ("speedup_vs_hf", "hf_same_tokens") if k in result},
        })
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0
