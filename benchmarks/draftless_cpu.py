"""Draftless speculation (ngram prompt lookup, suffix trees) against plain decoding on the CPU, side by side in one process.

Prompt kinds where answers copy their context (issue 37's goal: draftless ≥ 1.5× AR there):
- code-edit: a file of three HumanEval solutions (the registry's `humaneval` set: prompt + canonical solution),
  asked to rename one function and return the whole file;
- summarize: a ~1K-token window of the essays set, asked to summarize it quoting its key sentences.
Each prompt runs through a fresh engine per configuration over the same loaded target, interleaved (AR, ngram,
suffix…, AR, ngram, suffix… per repeat), batch 1, greedy. Configurations: "ar"; "ngram" (a chain of --gamma);
"suffix-SHAPE" for each --suffix-trees SHAPE ("default": `speculation.suffix.DEFAULT_TREE`; a breadth-first
branching like 3,2,1,1,1; or a tree spec like chain:6). The table gives decode tokens/s (prefill excluded), the
ratio to AR, the acceptance, tokens per step and whether the tokens equal AR's.

    PYTHONPATH=src python benchmarks/draftless_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--prompts 3]
        [--new-tokens 96] [--gamma 4] [--configs ar ngram suffix] [--suffix-trees default 3,2,1,1,1]
        [--repeats 1] [--threads N] [--out results.json]
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
from redwood.speculation.suffix import DEFAULT_TREE, SuffixDrafter
from redwood.speculation.trees import Tree, resolve_tree


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


def suffix_tree(shape: str) -> Tree:
    if shape == "default":
        return DEFAULT_TREE
    if shape.replace(",", "").isdigit():
        return Tree.from_branching([int(c) for c in shape.split(",")])
    return resolve_tree(shape)


def configurations(args, vocab: int) -> dict:
    """name → a function giving Engine.build's drafter / tree arguments (fresh drafter state per run)."""
    out = {}
    if "ar" in args.configs:
        out["ar"] = lambda: {}
    if "ngram" in args.configs:
        out["ngram"] = lambda: dict(drafter=NgramDrafter(vocab, *args.ngram), tree=Tree.chain(args.gamma))
    if "suffix" in args.configs:
        for shape in args.suffix_trees:
            tree = suffix_tree(shape)
            out[f"suffix-{shape}"] = lambda tree=tree: dict(drafter=SuffixDrafter(vocab, *args.ngram), tree=tree)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--ngram", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"))
    ap.add_argument("--configs", nargs="+", default=["ar", "ngram", "suffix"], choices=["ar", "ngram", "suffix"])
    ap.add_argument("--suffix-trees", nargs="+", default=["default", "3,2,1,1,1"], metavar="SHAPE")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kinds", nargs="+", default=["code-edit", "summarize"], choices=["code-edit", "summarize"])
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: redwood's choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if "ar" not in args.configs:
        ap.error("--configs needs ar (the reference)")

    llm = LLM(args.model, threads=args.threads)
    configs = configurations(args, llm.config.vocab_size)
    widest = max([args.gamma + 1] + [suffix_tree(s).size for s in args.suffix_trees])
    kinds = {"code-edit": code_edit_prompts, "summarize": summarize_prompts}
    rows, t0 = [], time.perf_counter()
    for kind in args.kinds:
        for i, text in enumerate(kinds[kind](args.prompts)):
            ids = llm.encode(text, chat=True)
            longest = len(ids) + args.new_tokens + widest
            res = {name: [] for name in configs}
            for _ in range(args.repeats):
                for name, make in configs.items():
                    engine = Engine.build(llm.model, llm.tokenizer, max_num_seqs=1, max_model_len=longest, **make())
                    res[name].append(run(engine, ids, args.new_tokens))
            ar = statistics.median(r["decode_tokens_per_s"] for r in res["ar"])
            row = {"kind": kind, "prompt": i, "prompt_tokens": len(ids), "ar_tokens_per_s": ar, "configs": {}}
            for name, runs in res.items():
                tps = statistics.median(r["decode_tokens_per_s"] for r in runs)
                row["configs"][name] = {
                    "tokens_per_s": tps,
                    "speedup": tps / ar,
                    "spread": [r["decode_tokens_per_s"] for r in runs],
                    "acceptance_rate": runs[0]["acceptance_rate"],
                    "mean_accepted_length": runs[0]["mean_accepted_length"],
                    "equal": all(r["tokens"] == res["ar"][0]["tokens"] for r in runs),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
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
    names = [n for n in configs if n != "ar"]
    print(f"\n{'kind':<10} {'#':>2} {'prompt':>6} {'AR tok/s':>9}" + "".join(f"  {n:>28}" for n in names))
    print(" " * 30 + "".join(f"  {'tok/s  ×AR  acc tok/st eq':>28}" for _ in names))
    for r in rows:
        line = f"{r['kind']:<10} {r['prompt']:>2} {r['prompt_tokens']:>6} {r['ar_tokens_per_s']:>9.2f}"
        for n in names:
            c = r["configs"][n]
            acc = c["acceptance_rate"] if c["acceptance_rate"] is not None else float("nan")
            mal = c["mean_accepted_length"] or float("nan")
            line += f"  {c['tokens_per_s']:>8.2f} {c['speedup']:>5.2f} {acc:>4.2f} {mal:>6.2f} {'y' if c['equal'] else 'N':>2}"
        print(line)
    for kind in args.kinds:
        for n in names:
            ratios = [r["configs"][n]["speedup"] for r in rows if r["kind"] == kind]
            print(f"{kind}: median {n} / AR {statistics.median(ratios):.2f}× over {len(ratios)} prompts")


if __name__ == "__main__":
    main()
