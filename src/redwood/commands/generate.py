"""`redwood generate`: one prompt through a model, streamed to the terminal or printed as JSON."""

from __future__ import annotations

import dataclasses
import json
import sys

from redwood.commands.options import (
    add_engine_args,
    add_model_args,
    add_offload_args,
    add_sampling_args,
    add_speculative_args,
    engine_kwargs,
    llm_from_args,
    load_kwargs,
    sampling_params_from_args,
    speculative_config_from_args,
)


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt. Prints the text as it is generated, "
        "then one stats line; --json prints one JSON object instead. With "
        "--draft-model M or --self-speculate it decodes speculatively (lossless: the "
        "same tokens when greedy, the same distribution when sampling) and the "
        "stats include acceptance and draft / verify time.",
    )
    add_model_args(p)
    add_offload_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(p)
    add_speculative_args(p)
    add_engine_args(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, stats (with speculation stats), model, draft",
    )
    p.add_argument(
        "--compare-ar",
        type=int,
        nargs="?",
        const=DEFAULT_COMPARE_AR,
        default=None,
        metavar="N",
        help=f"with a drafter: after the speculative answer, decode the same prompt autoregressively "
        f"for N tokens (default {DEFAULT_COMPARE_AR}; at most the answer's length) with the same "
        f"weights, and report AR vs speculation decode tokens/s and the speedup",
    )
    p.set_defaults(func=run)


DEFAULT_COMPARE_AR = 64


def stats_line(stats: dict, finish_reason: str) -> str:
    line = (
        f"[{stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated "
        f"({finish_reason}); prefill {stats['prefill_s']:.3f} s; "
        f"decode {stats['decode_s']:.3f} s, {stats['decode_tokens_per_s']:.2f} tokens/s"
    )
    spec = stats.get("speculative")
    if spec:
        nodes = spec.get("drafted_per_step", spec["gamma"])
        # A chain drafts gamma tokens per step; a branching tree more nodes than its depth (gamma).
        shape = f"gamma {spec['gamma']}" if nodes == spec["gamma"] else f"tree {nodes + 1} nodes, depth {spec['gamma']}"
        if spec.get("policy") == "auto":
            shape = "auto"
        line += (
            f"; speculative {shape}: {spec['steps']} steps, acceptance "
            f"{spec['acceptance_rate']:.3f} ({spec['accepted']}/{spec['drafted']}), mean accepted length "
            f"{spec['mean_accepted_length']:.2f} tokens/step, "
        )
        if spec["draft_s"] or spec["verify_s"]:
            line += f"draft {spec['draft_s']:.3f} s / verify {spec['verify_s']:.3f} s"
        else:  # each step ran as one CUDA graph: only the whole step is timed
            line += f"steps {spec.get('step_s', 0.0):.3f} s"
        if spec.get("policy") == "auto":
            plans = ", ".join(f"{name} {n}" for name, n in spec.get("plans", {}).items())
            line += f"; plans: {plans} ({spec.get('probes', 0)} probes)"
    return line + "]"


def compare_ar(llm, prompt_ids: list[int], params, n: int, spec_ids: list[int], spec_stats: dict) -> dict:
    """Decode `prompt_ids` autoregressively for n tokens (EOS and stop strings ignored) through an Engine
    over the LLM's own target (same weights, no drafter) → AR and speculative decode tokens/s, the
    speedup, and for greedy decoding whether speculation's first n tokens equal AR's (where not: the gap
    between AR's two most likely tokens there — a tie rounds either way, see DESIGN.md invariant 1)."""
    from redwood.engine.engine import Engine

    greedy = params.temperature == 0
    engine = Engine.build(
        llm.model, llm.tokenizer, max_num_seqs=1, max_model_len=len(prompt_ids) + n, cuda_graphs=llm.engine.use_graphs
    )
    engine.add_request(
        prompt_ids,
        dataclasses.replace(params, max_new_tokens=n, ignore_eos=True, stop=(), logprobs=2 if greedy else None),
    )
    ids, logprobs, stats = [], [], None
    while engine.has_unfinished():
        for d in engine.step():
            ids += d.token_ids
            logprobs += d.logprobs or []
            stats = d.stats or stats
    ar_tps, spec_tps = stats["decode_tokens_per_s"], spec_stats["decode_tokens_per_s"]
    out = {
        "tokens": n,
        "prefill_s": stats["prefill_s"],
        "decode_s": stats["decode_s"],
        "ar_decode_tokens_per_s": ar_tps,
        "spec_decode_tokens_per_s": spec_tps,
        "speedup": round(spec_tps / ar_tps, 3) if ar_tps else None,
    }
    if greedy:
        diff = next((i for i, (a, b) in enumerate(zip(ids, spec_ids)) if a != b), None)
        out["greedy_equal"] = diff is None
        out["first_difference"] = diff
        if diff is not None and diff < len(logprobs) and len(logprobs[diff].top) == 2:
            (_, a), (_, b) = logprobs[diff].top
            out["ar_top2_gap"] = round(a - b, 6)  # (a logprob gap is the logit gap)
    return out


def compare_line(c: dict) -> str:
    line = (
        f"[compare-ar: AR {c['ar_decode_tokens_per_s']:.2f} tokens/s over {c['tokens']} tokens (prefill "
        f"{c['prefill_s']:.3f} s, decode {c['decode_s']:.3f} s), speculation {c['spec_decode_tokens_per_s']:.2f} "
        f"tokens/s (decode), speedup {c['speedup']:.2f}×"
    )
    if c.get("greedy_equal"):
        line += "; greedy tokens equal AR's"
    elif "greedy_equal" in c:
        line += f"; greedy tokens leave AR's at token {c['first_difference']}"
        if "ar_top2_gap" in c:
            line += (
                f", where AR's two most likely tokens' logits differ by {c['ar_top2_gap']:.3g} (verify and "
                f"decode forwards round differently: at a tie either token is the target's greedy choice)"
            )
    return line + "]"


def run(args) -> int:
    from redwood.engine.tokenization import check_max_model_len, check_prompt_ids, encode_prompt
    from redwood.errors import ConfigError
    from redwood.loading import inspect_model

    params = sampling_params_from_args(args)  # validate before the (slow) model load
    spec = speculative_config_from_args(args)
    if args.compare_ar is not None and spec is None:
        raise ConfigError(
            "--compare-ar compares speculation with autoregressive decoding: add --draft-model M or --self-speculate"
        )
    if args.compare_ar is not None and args.compare_ar < 2:
        raise ConfigError(
            f"--compare-ar N must be >= 2 (the first token comes from the prefill; decode speed needs "
            f"more), got {args.compare_ar}"
        )
    load_kwargs(args)  # (the load flags' errors before reading the prompt)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    # The prompt's checks need only the tokenizer: made before the weights load (the LLM reuses it).
    info = inspect_model(args.model)
    ids = encode_prompt(info.tokenizer, prompt, args.chat, str(args.model))
    context = info.config.max_position_embeddings
    check_prompt_ids(ids, info.config.vocab_size, check_max_model_len(args.max_model_len, context))
    # One request: one batch slot, and KV pages for this prompt and answer only (the pool is zero-filled, so
    # all of it is resident: for 256 slots × the whole context it was the whole 4 GiB CPU budget).
    engine = {"max_num_seqs": 1, "max_model_len": min(context, len(ids) + args.max_new_tokens), **engine_kwargs(args)}
    llm = llm_from_args(args, info, speculative=spec, **engine)
    if args.json:
        out = llm.generate([prompt], params, chat=args.chat)[0]
        obj = {
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "stats": out.stats,
            "model": llm.model_name,
        }
        if spec is not None:
            obj["draft"] = llm.draft_name
            if spec.auto:
                obj["policy"] = llm.engine.policy.report()
        if args.compare_ar is not None and (n := min(args.compare_ar, len(out.token_ids))) >= 2:
            obj["compare_ar"] = compare_ar(llm, ids, params, n, out.token_ids, out.stats)
        print(json.dumps(obj, ensure_ascii=False))
        return 0
    last, token_ids = None, []
    for last in llm.stream([prompt], params, chat=args.chat):
        sys.stdout.write(last.text)
        sys.stdout.flush()
        token_ids += last.token_ids
    print()
    if spec is not None:
        print(f"[draft: {llm.draft_name}]")
    print(stats_line(last.stats, last.finish_reason), flush=True)
    if args.compare_ar is not None:
        n = min(args.compare_ar, len(token_ids))
        if n < 2:
            print(f"[compare-ar: the answer has {len(token_ids)} token(s); nothing to compare]")
        else:
            print(compare_line(compare_ar(llm, ids, params, n, token_ids, last.stats)))
    return 0
