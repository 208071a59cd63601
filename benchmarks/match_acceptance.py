"""Acceptance of the `match` verifier against rejection sampling, on the CPU with the real registry pair.

A chain of γ draft tokens per step from the 0.5B draft, verified by the 1.5B target (Qwen2.5-Coder
instruct), at each temperature, three ways:

- sampling / sampled drafts: speculative rejection sampling, the draft tokens drawn from the draft's q;
- match / coupled drafts: the target draws its token at each position by inverse CDF with the seed's
  number there, the draft proposes inverse_cdf(q, the same number) (`draw_children`'s "coupled" rule);
- match / top-k drafts: the same verifier, the draft proposes its argmax (the engine has no switch for
  this — coupled is match's rule — so the script swaps `redwood.engine.decode.child_rule` for it).

With --expected, a second table needs no sampling noise: along each AR output at T > 0 (teacher-forced:
target and draft scored over prompt + output), the exact probability that one draft token is accepted at
each position, averaged — rejection sampling Σ min(p, q); match with a coupled draft Σ_x |I_p(x) ∩ I_q(x)|
(I(x) a token's inverse-CDF interval of [0, 1), in token-id order); match with the draft's argmax
p(argmax q) — the per-token acceptance α the tokens/step above come from (α + α² + … + α^γ + 1 at a
constant α), at every position of the text instead of the ~350 draws a run takes.

Prompts: HumanEval and MT-Bench first turns in the chat template (`redwood.data`), all in one batch,
one seed per prompt (the same seeds for every method). At temperature 0 the three coincide (greedy
verification of the draft's argmax), a check of the harness. With --check-ar an autoregressive run at
each T > 0 gives the tokens the match runs must equal (the same seeds: plain sampling is keyed by position
as well); "== AR" counts the prompts whose tokens do.

    PYTHONPATH=src python benchmarks/match_acceptance.py [--prompts 3] [--new-tokens 64] [--gamma 3]
        [--temperatures 0.7 0] [--top-p 1.0] [--threads 1] [--check-ar] [--expected]
        [--methods sampling coupled topk] [--out results.json]

--prompts is per dataset (3 → 3 HumanEval + 3 MT-Bench). The table's columns: tokens per step (accepted
drafts + 1, over all steps of all prompts), acceptance (accepted / drafted tokens), decode tokens/s
(the batch's generated tokens over its decode seconds: noisy on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import redwood.engine.decode as decode
from redwood import Engine, SamplingParams
from redwood.data.prompts import chat_prompts
from redwood.engine.loaded import LoadedModels
from redwood.kv.policies import FullPolicy
from redwood.sample.sampler import probabilities
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.drafters import ModelDrafter
from redwood.speculation.trees import Tree
from redwood.tuning.measure import _logits_at

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
# key → (label, verifier, match's child rule: None → the engine's)
METHODS = {
    "sampling": ("sampling / sampled drafts", "sampling", None),
    "coupled": ("match / coupled drafts", "match", None),
    "topk": ("match / top-k drafts", "match", "topk"),
}


def engine_for(models: LoadedModels, verifier: str | None, gamma: int, batch: int) -> Engine:
    """A fresh engine over the loaded models: AR (verifier None) or a chain of γ from the draft model."""
    if verifier is None:
        return Engine.build(models.model, models.tokenizer, max_num_seqs=batch)
    drafter = ModelDrafter(models.drafter.own_model, FullPolicy(), models.config.vocab_size)
    return Engine.build(
        models.model, models.tokenizer, drafter=drafter, tree=Tree.chain(gamma), verifier=verifier, max_num_seqs=batch
    )


def run_batch(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """All prompts at once → their tokens and the batch's totals (speculation counts, decode seconds)."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    tokens = {i: [] for i in ids}
    stats = {}
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            if d.stats is not None:
                stats[d.request_id] = d.stats
    spec = [stats[i].get("speculative") or {} for i in ids]
    generated = sum(stats[i]["generated_tokens"] - 1 for i in ids)  # (the first tokens come from prefills)
    decode_s = max(stats[i]["decode_s"] for i in ids)  # (one batch: the requests decode together)
    out = {"tokens": [tokens[i] for i in ids], "decode_tokens_per_s": generated / decode_s}
    if any(spec):
        accepted, drafted, steps = (sum(s.get(k, 0) for s in spec) for k in ("accepted", "drafted", "steps"))
        out.update(accepted=accepted, drafted=drafted, steps=steps)
        out.update(tokens_per_step=(accepted + steps) / steps, acceptance=accepted / drafted)
    return out


def with_child_rule(rule: str | None):
    """Context: match's children drawn by `rule` (None: the engine's own choice)."""
    original = decode.child_rule

    class Swap:
        def __enter__(self):
            if rule is not None:
                decode.child_rule = lambda kind: rule if kind == "match" else original(kind)

        def __exit__(self, *exc):
            decode.child_rule = original

    return Swap()


def one_token_acceptance(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
    """p, q: [N, V] target / draft distributions at N positions → each method's probability [N] that one
    draft token is accepted there."""
    p64, q64 = p.double(), q.double()
    cp, cq = p64.cumsum(-1), q64.cumsum(-1)  # [N, V]: each token's interval is [c − prob, c)
    overlap = (torch.minimum(cp, cq) - torch.maximum(cp - p64, cq - q64)).clamp(min=0).sum(-1)
    return {
        "sampling": torch.minimum(p64, q64).sum(-1),  # rejection sampling: 1 − TV(p, q)
        "coupled": overlap,  # both drawn by inverse CDF with one uniform
        "topk": p64.gather(1, q64.argmax(-1, keepdim=True))[:, 0],  # the target samples the draft's argmax
    }


@torch.inference_mode()
def expected_acceptance(models: LoadedModels, prompts, outputs, temperature: float, top_p: float) -> dict:
    """Teacher-forced along each prompt + output: the mean of `one_token_acceptance` over every output
    position (the distributions that predicted the output's tokens), and the number of positions."""
    draft, V = models.drafter.own_model, models.config.vocab_size
    shared = min(V, draft.config.vocab_size)
    per = {k: [] for k in METHODS}
    for prompt, out in zip(prompts, outputs):
        ids = list(prompt) + list(out)
        at = torch.arange(len(prompt) - 1, len(ids) - 1)  # the positions predicting out[0], out[1], …
        n = len(at)
        settings = (torch.full((n,), temperature), torch.zeros(n, dtype=torch.long), torch.full((n,), top_p))
        p = probabilities(_logits_at(models.model, ids, at).cpu(), *settings)
        q = probabilities(_logits_at(draft, ids, at)[:, :shared].cpu(), *settings)
        q = torch.cat([q, q.new_zeros(n, V - shared)], dim=1)
        for k, a in one_token_acceptance(p, q).items():
            per[k].append(a)
    return {k: float(torch.cat(v).mean()) for k, v in per.items()} | {"positions": sum(len(o) for o in outputs)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return f"{model} ({'AVX-512' if 'avx512f' in flags else 'no AVX-512'}{', VNNI' if 'avx512_vnni' in flags else ''})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="per dataset (HumanEval, MT-Bench)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 0.0])
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-ar", action="store_true", help="an AR run per T > 0: match's tokens must equal it")
    ap.add_argument("--expected", action="store_true", help="exact one-token acceptance along the AR outputs")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS), help="engine runs")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    models = LoadedModels.load(TARGET, speculative=SpeculativeConfig(draft_model=DRAFT, num_draft_tokens=args.gamma))
    print(f"loaded {TARGET} + {DRAFT} in {time.perf_counter() - t_load:.0f} s; CPU: {cpu_name()}", flush=True)
    tok = models.tokenizer
    prompts = chat_prompts(tok, "humaneval", args.prompts) + chat_prompts(tok, "mt-bench", args.prompts)
    run_batch(engine_for(models, None, args.gamma, 1), [prompts[0][:16]], [SamplingParams(max_new_tokens=2)])  # warm-up
    rows, expected = [], []
    for t in args.temperatures:
        params = [
            SamplingParams(
                max_new_tokens=args.new_tokens, ignore_eos=True, temperature=t, top_p=args.top_p, seed=1000 + i
            )
            for i in range(len(prompts))
        ]
        ar = None
        if (args.check_ar or args.expected) and t > 0:
            ar = run_batch(engine_for(models, None, args.gamma, len(prompts)), prompts, params)
            print(f"T={t} AR: {ar['decode_tokens_per_s']:.2f} tok/s", flush=True)
        if args.expected and t > 0:
            e = expected_acceptance(models, prompts, ar["tokens"], t, args.top_p)
            expected.append(dict(temperature=t, **e))
            print(f"T={t} expected one-token acceptance: {e}", flush=True)
        for label, verifier, rule in (METHODS[k] for k in args.methods):
            t0 = time.perf_counter()
            with with_child_rule(rule):
                r = run_batch(engine_for(models, verifier, args.gamma, len(prompts)), prompts, params)
            same = None if ar is None else sum(a == b for a, b in zip(r["tokens"], ar["tokens"]))
            row = dict(temperature=t, method=label, **{k: v for k, v in r.items() if k != "tokens"})
            row.update(equal_to_ar=same, prompts=len(prompts), wall_s=time.perf_counter() - t0)
            rows.append(row)
            print(
                f"T={t} {label}: {r['tokens_per_step']:.2f} tokens/step, acceptance {r['acceptance']:.3f}, "
                f"{r['decode_tokens_per_s']:.2f} tok/s" + ("" if same is None else f", == AR {same}/{len(prompts)}"),
                flush=True,
            )
    if args.out:
        meta = dict(target=TARGET, draft=DRAFT, gamma=args.gamma, new_tokens=args.new_tokens, top_p=args.top_p)
        meta.update(prompts=len(prompts), threads=args.threads, cpu=cpu_name())
        with open(args.out, "w") as f:
            json.dump({"settings": meta, "rows": rows, "expected": expected}, f, indent=1)
    print(f"\n{TARGET} target, {DRAFT} draft, chain γ={args.gamma}, {len(prompts)} prompts × {args.new_tokens} tokens")
    print("| T | method | tokens/step | acceptance | decode tok/s | == AR |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        same = "" if r["equal_to_ar"] is None else f"{r['equal_to_ar']}/{r['prompts']}"
        print(
            f"| {r['temperature']:g} | {r['method']} | {r['tokens_per_step']:.2f} | {r['acceptance']:.3f} | "
            f"{r['decode_tokens_per_s']:.2f} | {same} |"
        )

    if expected:
        print("\nexpected acceptance of one draft token, teacher-forced along the AR outputs (exact, no sampling)")
        print("| T | positions | sampling / sampled drafts | match / coupled drafts | match / top-k drafts |")
        print("|---|---|---|---|---|")
        for e in expected:
            print(
                f"| {e['temperature']:g} | {e['positions']} | {e['sampling']:.3f} | {e['coupled']:.3f} | {e['topk']:.3f} |"
            )


if __name__ == "__main__":
    main()
