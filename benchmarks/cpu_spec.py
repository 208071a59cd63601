"""Speculation against plain decoding through the Engine on the CPU, per weight format of the target and
of the draft (issue 20: does the cheaper verify of packed weights make speculation pay on this machine).

Usage: PYTHONPATH=src python benchmarks/cpu_spec.py [--plan int8:int8/int4 int4:int4 gguf:int4/gguf]
    [--gammas 3 5] [--new-tokens 64] [--code-prompts 1] [--chat] [--threads 1 2]
--threads: torch's thread count for each measurement (default: as torch starts, e.g. OMP_NUM_THREADS); with
several, every AR and speculative measurement runs at each count in turn (1, 2, 1, 2, …: interleaved, so a
load from elsewhere lands on both alike), and each speculative row is against the AR of its own count.
A plan entry is TARGET:DRAFT1/DRAFT2…; each target loads once (`load_model(weights=)`), runs AR (after a
short warm-up) and then greedy chains of each γ with each draft format over the same prompts: --code-prompts
128-token code windows (HumanEval problems 100+, 1024 tokens apart) and, with --chat, the main job's chat
prompt (scripts/run.sh). Prints decode tokens/s (over all prompts: their tokens over their decode seconds),
the speedup over AR, acceptance, tokens per step, and for how many prompts the speculative tokens equal AR's
(they must, up to numerical ties: DESIGN.md invariant 1; a packed format's logits come out of a bfloat16 LM
head, so exact ties do occur — docs/perf/cpu.md session 12).
"""

from __future__ import annotations

import argparse
import gc

import torch
from cpu_weights import held_out_texts

from redwood import Engine, SamplingParams
from redwood.engine.tokenization import encode_prompt
from redwood.kv.policies import FullPolicy
from redwood.loading import load_model
from redwood.speculation.drafters import ModelDrafter
from redwood.speculation.trees import Tree

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CHAT = "Write a Python function that checks whether a number is prime."  # scripts/run.sh's prompt


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], dict]:
    """One request alone → (its token ids, its stats)."""
    engine.add_request(prompt, params)
    ids, stats = [], None
    while engine.has_unfinished():
        for d in engine.step():
            ids += d.token_ids
            stats = d.stats or stats
    return ids, stats


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], dict]:
    """Each prompt alone, one after the other → (token ids per prompt, totals: decode tokens/s over all
    prompts, acceptance and tokens per step over all steps)."""
    outs, tokens, seconds, acc, drafted, steps = [], 0, 0.0, 0, 0, 0
    for p in prompts:
        ids, st = run(engine, p, params)
        outs.append(ids)
        tokens += st["generated_tokens"] - 1  # (the first token comes from the prefill)
        seconds += st["decode_s"]
        sp = st.get("speculative")
        if sp:
            acc, drafted, steps = acc + sp["accepted"], drafted + sp["drafted"], steps + sp["steps"]
    total = {"decode_tokens_per_s": tokens / seconds}
    if steps:
        total.update(acceptance_rate=acc / drafted, mean_accepted_length=(acc + steps) / steps)
    return outs, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", nargs="+", default=["int8:int8/int4", "int4:int4"])
    ap.add_argument("--gammas", nargs="+", type=int, default=[3, 5])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--code-prompts", type=int, default=1, help="128-token code windows (default 1)")
    ap.add_argument("--chat", action="store_true", help="also the main job's chat prompt (scripts/run.sh)")
    ap.add_argument("--threads", nargs="+", type=int, default=[torch.get_num_threads()])
    args = ap.parse_args()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for entry in args.plan:
        tk, drafts = entry.split(":")
        target = load_model(TARGET, weights=tk)
        code = held_out_texts(target.tokenizer, 1024 * args.code_prompts)["code"]
        prompts = [code[i * 1024 : i * 1024 + 128] for i in range(args.code_prompts)]
        if args.chat:
            prompts.append(encode_prompt(target.tokenizer, CHAT, chat=True))
        engine = Engine.build(target.model, target.tokenizer, max_num_seqs=1, max_model_len=512)
        run(engine, prompts[0][:16], SamplingParams(max_new_tokens=4))  # warm-up
        ar, ar_ids = {}, {}
        for n in args.threads:
            torch.set_num_threads(n)
            ar_ids[n], ar[n] = run_all(engine, prompts, params)
            print(
                f"AR {tk}, {n} thread(s): {ar[n]['decode_tokens_per_s']:.2f} tok/s"
                + ("" if ar_ids[n] == ar_ids[args.threads[0]] else " (tokens differ from the first count's)"),
                flush=True,
            )
        del engine
        for dk in drafts.split("/"):
            draft = load_model(DRAFT, weights=dk)
            for g in args.gammas:
                drafter = ModelDrafter(draft.model, FullPolicy(), target.config.vocab_size)
                engine = Engine.build(
                    target.model,
                    target.tokenizer,
                    drafter=drafter,
                    tree=Tree.chain(g),
                    max_num_seqs=1,
                    max_model_len=512,
                )
                for n in args.threads:
                    torch.set_num_threads(n)
                    ids, st = run_all(engine, prompts, params)
                    a = ar[n]["decode_tokens_per_s"]
                    row = (
                        tk,
                        dk,
                        g,
                        n,
                        a,
                        st["decode_tokens_per_s"],
                        st["acceptance_rate"],
                        st["mean_accepted_length"],
                        f"{sum(x == y for x, y in zip(ids, ar_ids[n]))}/{len(ids)}",
                    )
                    rows.append(row)
                    print(
                        f"  {tk} target, {dk} draft, γ {g}, {n} thread(s): {row[5]:.2f} tok/s = {row[5] / a:.2f}× AR, "
                        f"acceptance {row[6]:.2f}, {row[7]:.2f} tokens/step, prompts with tokens == AR: {row[8]}",
                        flush=True,
                    )
                del engine
            del draft
            gc.collect()
        del target
        gc.collect()
    print(
        "\n| target | draft | γ | threads | AR tok/s | spec tok/s | × AR | acceptance | tokens/step | prompts == AR |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tk, dk, g, n, a, s, acc, mal, same in rows:
        print(f"| {tk} | {dk} | {g} | {n} | {a:.2f} | {s:.2f} | {s / a:.2f} | {acc:.2f} | {mal:.2f} | {same} |")


if __name__ == "__main__":
    main()
