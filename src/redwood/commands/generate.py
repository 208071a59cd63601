"""`redwood generate`: one prompt through a model, streamed to the terminal or printed as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from redwood.llm import DEFAULT_MODEL


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model / --dtype / --device, shared by every command that loads a model."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"zoo name, Hugging Face folder or .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def sampling_params_from_args(args):
    from redwood.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, seed=args.seed, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate text for one prompt. Prints the text as it is generated, "
                                   "then one stats line; --json prints one JSON object instead.")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(func=run)


def stats_line(stats: dict, finish_reason: str) -> str:
    return (f"[{stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated "
            f"({finish_reason}); prefill {stats['prefill_s']:.3f} s; decode {stats['decode_tokens_per_s']:.2f} tokens/s]")


def run(args) -> int:
    from redwood.llm import LLM

    params = sampling_params_from_args(args)  # validate before the (slow) model load
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    if args.json:
        out = llm.generate([prompt], params, chat=args.chat)[0]
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": out.stats, "model": llm.model_name}, ensure_ascii=False))
        return 0
    last = None
    for last in llm.stream([prompt], params, chat=args.chat):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    print()
    print(stats_line(last.stats, last.finish_reason))
    return 0
