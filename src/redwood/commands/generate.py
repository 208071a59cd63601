"""`redwood generate`: one prompt through a model, streamed to the terminal or printed as JSON."""

from __future__ import annotations

import json
import sys

from redwood.commands.options import (add_engine_args, add_model_args, add_offload_args, add_sampling_args,
                                      add_speculative_args, engine_kwargs, graphs_kwargs, offload_kwargs,
                                      sampling_params_from_args, speculative_config_from_args, threads_kwargs)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate text for one prompt. Prints the text as it is generated, "
                                   "then one stats line; --json prints one JSON object instead. With "
                                   "--draft-model M or --self-speculate it decodes speculatively (lossless: the "
                                   "same tokens when greedy, the same distribution when sampling) and the "
                                   "stats include acceptance and draft / verify time.")
    add_model_args(p)
    add_offload_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(p)
    add_speculative_args(p)
    add_engine_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids, stats (with speculation stats), model, draft")
    p.set_defaults(func=run)


def stats_line(stats: dict, finish_reason: str) -> str:
    line = (f"[{stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated "
            f"({finish_reason}); prefill {stats['prefill_s']:.3f} s; "
            f"decode {stats['decode_tokens_per_s']:.2f} tokens/s")
    spec = stats.get("speculative")
    if spec:
        nodes = spec.get("drafted_per_step", spec["gamma"])
        # A chain drafts gamma tokens per step; a branching tree more nodes than its depth (gamma).
        shape = (f"gamma {spec['gamma']}" if nodes == spec["gamma"]
                 else f"tree {nodes + 1} nodes, depth {spec['gamma']}")
        line += (f"; speculative {shape}: {spec['steps']} steps, acceptance "
                 f"{spec['acceptance_rate']:.3f} ({spec['accepted']}/{spec['drafted']}), mean accepted length "
                 f"{spec['mean_accepted_length']:.2f} tokens/step, ")
        if spec["draft_s"] or spec["verify_s"]:
            line += f"draft {spec['draft_s']:.3f} s / verify {spec['verify_s']:.3f} s"
        else:  # each step ran as one CUDA graph: only the whole step is timed
            line += f"steps {spec.get('step_s', 0.0):.3f} s"
    return line + "]"


def run(args) -> int:
    from redwood.engine.engine import check_max_model_len, check_prompt_ids, encode_prompt
    from redwood.llm import LLM
    from redwood.loading import inspect_model

    params = sampling_params_from_args(args)  # validate before the (slow) model load
    spec = speculative_config_from_args(args)
    offload = offload_kwargs(args)
    threads = threads_kwargs(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    # The prompt's checks need only the tokenizer: made before the weights load (the LLM reuses it).
    info = inspect_model(args.model)
    ids = encode_prompt(info.tokenizer, prompt, args.chat, str(args.model))
    check_prompt_ids(ids, info.config.vocab_size,
                     check_max_model_len(args.max_model_len, info.config.max_position_embeddings))
    llm = LLM(info, dtype=args.dtype, device=args.device,
              weights=args.weights, speculative=spec, **offload, **graphs_kwargs(args),
              **threads, **engine_kwargs(args))
    if args.json:
        out = llm.generate([prompt], params, chat=args.chat)[0]
        obj = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
               "stats": out.stats, "model": llm.model_name}
        if spec is not None:
            obj["draft"] = llm.draft_name
        print(json.dumps(obj, ensure_ascii=False))
        return 0
    last = None
    for last in llm.stream([prompt], params, chat=args.chat):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    print()
    if spec is not None:
        print(f"[draft: {llm.draft_name}]")
    print(stats_line(last.stats, last.finish_reason))
    return 0
