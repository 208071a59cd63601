"""Speculation against plain decoding through the Engine on the CPU, per weight format of the target and
of the draft (issue 20: does the cheaper verify of packed weights make speculation pay on this machine).

Usage: OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/cpu_spec.py [--plan int8:int8/int4 int4:int4]
    [--gammas 3 5] [--new-tokens 64]
A plan entry is TARGET:DRAFT1/DRAFT2…; each target loads once (`load_model(weights=)`), runs AR (after a
short warm-up) and then greedy chains of each γ with each draft format over the same 128-token code prompt
(HumanEval problems 100+). Prints decode tokens/s, the speedup over AR, acceptance, tokens per step, and
whether the speculative tokens equal AR's (they must, up to numerical ties: DESIGN.md invariant 1).
"""

from __future__ import annotations

import argparse
import gc

from cpu_weights import held_out_texts
from redwood import Engine, SamplingParams
from redwood.kv.policies import FullPolicy
from redwood.loading import load_model
from redwood.speculation.drafters import ModelDrafter
from redwood.speculation.trees import Tree

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], dict]:
    """One request alone → (its token ids, its stats)."""
    engine.add_request(prompt, params)
    ids, stats = [], None
    while engine.has_unfinished():
        for d in engine.step():
            ids += d.token_ids
            stats = d.stats or stats
    return ids, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", nargs="+", default=["int8:int8/int4", "int4:int4"])
    ap.add_argument("--gammas", nargs="+", type=int, default=[3, 5])
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for entry in args.plan:
        tk, drafts = entry.split(":")
        target = load_model(TARGET, weights=tk)
        prompt = held_out_texts(target.tokenizer, 128)["code"][:128]
        engine = Engine.build(target.model, target.tokenizer, max_num_seqs=1, max_model_len=512)
        run(engine, prompt[:16], SamplingParams(max_new_tokens=4))  # warm-up
        ar_ids, ar = run(engine, prompt, params)
        del engine
        print(f"AR {tk}: {ar['decode_tokens_per_s']:.2f} tok/s", flush=True)
        for dk in drafts.split("/"):
            draft = load_model(DRAFT, weights=dk)
            for g in args.gammas:
                drafter = ModelDrafter(draft.model, FullPolicy(), target.config.vocab_size)
                engine = Engine.build(target.model, target.tokenizer, drafter=drafter, tree=Tree.chain(g),
                                      max_num_seqs=1, max_model_len=512)
                ids, st = run(engine, prompt, params)
                del engine
                sp = st["speculative"]
                row = (tk, dk, g, ar["decode_tokens_per_s"], st["decode_tokens_per_s"], sp["acceptance_rate"],
                       sp["mean_accepted_length"], ids == ar_ids)
                rows.append(row)
                print(f"  {tk} target, {dk} draft, γ {g}: {row[4]:.2f} tok/s = {row[4] / row[3]:.2f}× AR, "
                      f"acceptance {row[5]:.2f}, {row[6]:.2f} tokens/step, tokens == AR: {row[7]}", flush=True)
            del draft
            gc.collect()
        del target
        gc.collect()
    print("\n| target | draft | γ | AR tok/s | spec tok/s | × AR | acceptance | tokens/step | == AR |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tk, dk, g, a, s, acc, mal, same in rows:
        print(f"| {tk} | {dk} | {g} | {a:.2f} | {s:.2f} | {s / a:.2f} | {acc:.2f} | {mal:.2f} | {same} |")


if __name__ == "__main__":
    main()
