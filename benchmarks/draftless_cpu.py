"""Draftless (ngram / prompt-lookup) speculation against plain decoding on the CPU, side by side in one process.

Prompt kinds where answers copy their context (issue 37's goal: draftless ≥ 1.5× AR there):
- code-edit: a file of three HumanEval solutions (the registry's `humaneval` set: prompt + canonical solution),
  asked to rename one function and return the whole file;
- summarize: a ~1K-token window of the essays set, asked to summarize it quoting its key sentences.
Each prompt runs through a fresh AR engine and a fresh ngram engine over the same loaded target, interleaved
(AR, ngram, AR, ngram, … per repeat), batch 1, greedy; the table gives decode tokens/s (prefill excluded),
the ratio, the acceptance and whether the tokens equal AR's.

    PYTHONPATH=src python benchmarks/draftless_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--prompts 3]
        [--new-tokens 96] [--gamma 4] [--repeats 1] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from redwood import LLM, Engine, SamplingParams
from redwood.data.recipes import load_dataset
from redwood.speculation.draftless import NgramDrafter
from redwood.speculation.trees import Tree


def code_edit_prompts(n: int) -> list[str]:
    docs = [d for d in load_dataset("humaneval") if d.get("canonical_solution")]
    out = []
    for i in range(n):
        group = docs[3 * i : 3 * i + 3]
        source = "\n\n".join(d["prompt"] + d["canonical_solution"] for d in group)
        name = group[1]["entry_point"]
        out.append(
            f"Here is a Python file:\n\n```python\n{source}\n```\n\nRename the function `{name}` to "
            f"`{name}_v2` (and every call of it). Reply with the whole updated file in one code block."
        )
    return out


def summarize_prompts(n: int, words: int = 750) -> list[str]:
    text = " ".join(d["text"] for d in load_dataset("essays")).split()
    out = []
    for i in range(n):
        window = " ".join(text[i * 5000 : i * 5000 + words])
        out.append(f"{window}\n\nSummarize the text above in a few sentences, quoting its key sentences verbatim.")
    return out


def run(engine: Engine, ids: list[int], new_tokens: int) -> dict:
    engine.add_request(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    tokens, stats = [], None
    while engine.has_unfinished():
        for d in engine.step():
            tokens += d.token_ids
            stats = d.stats or stats
    spec = stats.get("speculative") or {}
    return {
        "tokens": tokens,
        "decode_tokens_per_s": stats["decode_tokens_per_s"],
        "prefill_s": stats["prefill_s"],
        "acceptance_rate": spec.get("acceptance_rate"),
        "mean_accepted_length": spec.get("mean_accepted_length"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--ngram", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kinds", nargs="+", default=["code-edit", "summarize"], choices=["code-edit", "summarize"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    llm = LLM(args.model)
    kinds = {"code-edit": code_edit_prompts, "summarize": summarize_prompts}
    rows, t0 = [], time.perf_counter()
    for kind in args.kinds:
        for i, text in enumerate(kinds[kind](args.prompts)):
            ids = llm.encode(text, chat=True)
            longest = len(ids) + args.new_tokens + args.gamma + 1
            res = {"ar": [], "ngram": []}
            for _ in range(args.repeats):
                for name in ("ar", "ngram"):
                    spec = {}
                    if name == "ngram":
                        spec = dict(
                            drafter=NgramDrafter(llm.config.vocab_size, *args.ngram), tree=Tree.chain(args.gamma)
                        )
                    engine = Engine.build(llm.model, llm.tokenizer, max_num_seqs=1, max_model_len=longest, **spec)
                    res[name].append(run(engine, ids, args.new_tokens))
            ar = statistics.median(r["decode_tokens_per_s"] for r in res["ar"])
            ng = statistics.median(r["decode_tokens_per_s"] for r in res["ngram"])
            rows.append(
                {
                    "kind": kind,
                    "prompt": i,
                    "prompt_tokens": len(ids),
                    "ar_tokens_per_s": ar,
                    "ngram_tokens_per_s": ng,
                    "speedup": ng / ar,
                    "spread": [r["decode_tokens_per_s"] for r in res["ngram"]],
                    "ar_spread": [r["decode_tokens_per_s"] for r in res["ar"]],
                    "acceptance_rate": res["ngram"][0]["acceptance_rate"],
                    "mean_accepted_length": res["ngram"][0]["mean_accepted_length"],
                    "equal": all(r["tokens"] == res["ar"][0]["tokens"] for r in res["ar"] + res["ngram"]),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    report = {
        "model": args.model,
        "weights": llm.model.weights,
        "machine": platform.processor() or platform.machine(),
        "args": vars(args),
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\n{'kind':<10} {'#':>2} {'prompt':>6} {'AR tok/s':>9} {'ngram':>7} {'ratio':>6} {'accept':>6} {'eq':>3}")
    for r in rows:
        acc = r["acceptance_rate"] if r["acceptance_rate"] is not None else float("nan")
        print(
            f"{r['kind']:<10} {r['prompt']:>2} {r['prompt_tokens']:>6} {r['ar_tokens_per_s']:>9.2f} "
            f"{r['ngram_tokens_per_s']:>7.2f} {r['speedup']:>6.2f} {acc:>6.2f} {'y' if r['equal'] else 'N':>3}"
        )
    for kind in args.kinds:
        ratios = [r["speedup"] for r in rows if r["kind"] == kind]
        print(f"{kind}: median ngram / AR {statistics.median(ratios):.2f}× over {len(ratios)} prompts")


if __name__ == "__main__":
    main()
