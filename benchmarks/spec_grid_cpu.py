"""Issue 37's CPU measurement grid: every speculation configuration against plain decoding, per prompt kind,
temperature and batch, side by side in one process with the configurations interleaved.

Models load once (the 1.5B target and the 0.5B draft, the registry GGUFs of the main job, in the formats
the main job gives them: `--weights auto --draft-weights auto`); engines are built over those loaded models
(`LoadedModels`: nothing is loaded twice). ar, draft-g3, ngram and auto run in one engine — the automatic
policy's, whose drafters are the draft model and prompt lookup — with its policy set per run (`PolicyView`:
the fixed ones pin the plan as their own engines would), so a prompt is prefilled once for the four;
self-streaming has its own engine (`--separate-engines`: one each, as before):

    ar              plain decoding (no drafter)
    draft-g3        the 0.5B draft over its full cache, a chain of γ 3 (the main job's speculation)
    self-streaming  self-speculation: the target drafts for itself through a StreamingLLM view of its own
                    cache (sinks + recent window) of --self-budget tokens (256: a quarter of a ~1K-token
                    prompt — compressed enough to be a real MagicDec draft, while the recent window still
                    holds the question or instruction at the prompt's end and every generated token), γ 3
    ngram           draftless prompt lookup (n-grams 2-4), γ 4 (as benchmarks/draftless_cpu.py)
    auto            SpeculativeConfig(policy="auto") with the 0.5B draft configured: the policy picks per step
                    among AR and chains from the draft model or prompt lookup (`LoadedModels.auto_drafters`)

Prompt kinds: code-complete (HumanEval prompts as plain text to continue), code-edit (a file of three
HumanEval solutions in the prompt, asked to rename one function: draftless_cpu.py's builder), chat (MT-Bench
first turns through the chat template), summarize (~1K-token essay windows, asked alternately for a
summary — draftless_cpu.py's builder — and to answer a question quoting the text). Cells, as the issue lists
them: every kind at T = 0 and 0.7, batch 1; code-edit and chat also at batch 4 (the prompt set is padded to
a multiple of the batch with more prompts of the kind: 6 → 8, two groups of 4 through one engine).

Cells run grouped by kind; a kind's cells share its prompts and engines. Each repeat
runs the configurations in turn (AR, draft, self, ngram, auto, then again …) over the same prompts, each
prompt with a fixed sampling seed (--seed + its index). With --prefix-cache (the default) an engine's KV pool
has room for every prompt of its kind, so each engine prefills a prompt once for all of the kind's
cells, repeats and the configurations it runs (prefill is not measured, and on this CPU it costs several times the 96-token decode of a
~1K-token prompt); the decode rows still take the lowest slots, so a step runs at its batch's size. Decode
tokens/s counts only steps in which no prompt of the group was prefilling (each step timed around
`Engine.step()`; the first token of each request comes from its prefill and is not counted). Also
recorded: tokens per row-step (1.0 for AR), acceptance, and at T = 0 how many outputs equal AR's of the
same repeat (DESIGN.md invariant 1).

Goals (issue 37), on the median over repeats of the per-repeat ratios (a ratio pairs two configurations of
one repeat): auto ≥ 0.97× AR and ≥ 0.95× the best fixed configuration (the one with the highest median) in
every cell; ngram ≥ 1.5× AR on code-edit and summarize. A goal whose ratios spread wider (max − min over the
repeats) than its median's distance from the threshold is "re-run", not PASS / FAIL; its cell is flagged and
`--rerun-flagged REPORT.json` runs only flagged cells again and merges them into the report.

    PYTHONPATH=src python benchmarks/spec_grid_cpu.py --out out/grid        # the whole grid (~2 h: background)
    PYTHONPATH=src python benchmarks/spec_grid_cpu.py --estimate            # projected wall time (~5-10 min)
    PYTHONPATH=src python benchmarks/spec_grid_cpu.py --kinds code-edit --temps 0 --batches 1 --prompts 1 \\
        --new-tokens 8 --repeats 1 --configs ar ngram draft-g3 --out out/smoke               # a smoke run
    PYTHONPATH=src python benchmarks/spec_grid_cpu.py --rerun-flagged out/grid/report.json  # flagged cells
    python benchmarks/spec_grid_cpu.py --self-test                                          # the table code

Options: --kinds / --temps / --batches filter the issue's cells (--cells KIND:T:B … names cells
explicitly), --configs, --repeats (3), --prompts (6), --new-tokens (96), --threads (default: redwood's
own choice, as the main job: on the 2-core machine decode steps pick 1 or 2 threads as they run),
--out DIR (report.json with every run's raw numbers and the machine, report.md with the tables; both
rewritten after every run, so a stopped grid keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("code-complete", "code-edit", "chat", "summarize")
TEMPS = (0.0, 0.7)
BATCH_KINDS = ("code-edit", "chat")  # the kinds the issue also runs at batch 4
ISSUE_CELLS = [(k, t, 1) for k in KINDS for t in TEMPS] + [(k, t, 4) for k in BATCH_KINDS for t in TEMPS]
FIXED = ("ar", "draft-g3", "self-streaming", "ngram")
CONFIGS = FIXED + ("auto",)
AUTO_VS_AR, AUTO_VS_BEST, NGRAM_VS_AR = 0.97, 0.95, 1.5
NGRAM_GOAL_KINDS = ("code-edit", "summarize")
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"  # scripts/run.sh's pair
QUESTION = (
    "\n\nWhat is the author's main claim in the text above, and what reasons does the author give for it? "
    "Answer quoting the relevant sentences verbatim."
)


# ---------------------------------------------------------------------------------------------- configurations
def config_spec(name: str, args):
    """The SpeculativeConfig of a configuration (None: plain decoding)."""
    from redwood.speculation.config import SpeculativeConfig

    draft = dict(draft_model=args.draft_model, num_draft_tokens=3, draft_weights=args.draft_weights)
    table = {
        "ar": lambda: None,
        "draft-g3": lambda: SpeculativeConfig(**draft),
        "self-streaming": lambda: SpeculativeConfig(
            self_speculate=True, draft_kv="streaming", draft_budget=args.self_budget, num_draft_tokens=3
        ),
        "ngram": lambda: SpeculativeConfig(draftless="ngram", num_draft_tokens=args.ngram_gamma),
        "auto": lambda: SpeculativeConfig(
            draft_model=args.draft_model, draft_weights=args.draft_weights, policy="auto"
        ),
    }
    return table[name]()


def models_for(spec, base, draft_model, threads):
    """`LoadedModels` for a configuration over the already-loaded target (`base`) and draft model
    (`LoadedModels.with_speculation`: nothing loads again), each engine with its own per-step thread choice where
    its decode is thread-count exact (as `LoadedModels.load` decides)."""
    from redwood.engine.threads import adaptive_threads

    lm = base.with_speculation(spec, draft_model, None if spec is None else spec.draft_model)
    lm.thread_policy = adaptive_threads(threads) if lm.thread_exact_decode() else None
    return lm


# ---------------------------------------------------------------------------------------------- prompts
def kind_prompts(kind: str, n: int, tokenizer, seed: int) -> list[list[int]]:
    """n prompts (token ids) of a kind."""
    from draftless_cpu import code_edit_prompts, summarize_prompts

    from redwood.data.prompts import chat_prompts
    from redwood.engine.tokenization import encode_prompt

    if kind == "code-complete":
        return chat_prompts(tokenizer, "humaneval", n, seed, chat=False)
    if kind == "chat":
        return chat_prompts(tokenizer, "mt-bench", n, seed, chat=True)
    if kind == "code-edit":
        texts = code_edit_prompts(n)
    elif kind == "summarize":  # even: summarize; odd: a question over the same kind of window
        texts = [t if i % 2 == 0 else t.rsplit("\n\n", 1)[0] + QUESTION for i, t in enumerate(summarize_prompts(n))]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return [encode_prompt(tokenizer, t, chat=True) for t in texts]


# ---------------------------------------------------------------------------------------------- running
def run_group(engine, prompts: list[list[int]], params: list) -> dict:
    """Prompts at once through one engine → per request tokens and stats; decode time = steps with no
    prompt of the group prefilling (timed around `Engine.step()`), and the tokens those steps emitted."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens = {r: [] for r in rids}
    stats = {}
    decode_s = prefill_s = 0.0
    decode_tokens = row_steps = steps = 0
    while engine.has_unfinished():
        prefilling = engine.prefill_remaining(rids) > 0
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        if prefilling:
            prefill_s += dt
        else:
            decode_s += dt
            steps += 1
            decode_tokens += sum(len(d.token_ids) for d in deltas)
            row_steps += sum(1 for d in deltas if d.token_ids)
        for d in deltas:
            tokens[d.request_id] += d.token_ids
            if d.stats:
                stats[d.request_id] = d.stats
    return {
        "requests": [{"tokens": tokens[r], "stats": stats.get(r)} for r in rids],
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "decode_tokens": decode_tokens,
        "row_steps": row_steps,
        "steps": steps,
    }


def run_config(engine, prompts, batch: int, temperature: float, new_tokens: int, seed: int, threads) -> dict:
    """Every prompt, `batch` at a time → the configuration's numbers for one repeat."""
    from redwood import SamplingParams
    from redwood.engine.threads import apply_threads

    apply_threads(threads)  # (process-wide: an engine without a per-step choice runs at the default count)
    if isinstance(engine, PolicyView):
        engine.activate()
    t0 = time.perf_counter()
    groups = [
        run_group(
            engine,
            prompts[i : i + batch],
            [
                SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True, seed=seed + j)
                for j in range(i, min(i + batch, len(prompts)))
            ],
        )
        for i in range(0, len(prompts), batch)
    ]
    reqs = [r for g in groups for r in g["requests"]]
    decode_s = sum(g["decode_s"] for g in groups)
    decode_tokens = sum(g["decode_tokens"] for g in groups)
    row_steps = sum(g["row_steps"] for g in groups)
    specs = [r["stats"].get("speculative") for r in reqs if r["stats"]]
    drafted = sum(s["drafted"] for s in specs if s)
    accepted = sum(s["accepted"] for s in specs if s)
    plans: dict = {}  # steps per plan, where the stats name them (the auto policy's choices)
    for sp in specs:
        for k, v in ((sp or {}).get("plans") or {}).items():
            plans[k] = plans.get(k, 0) + v
    return {
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "prefill_s": sum(g["prefill_s"] for g in groups),
        "tokens_per_row_step": decode_tokens / row_steps if row_steps else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "steps": sum(g["steps"] for g in groups),
        "plans": plans,
        "wall_s": time.perf_counter() - t0,
        "requests": reqs,
    }


SHARED = ("ar", "draft-g3", "ngram", "auto")  # the configurations one engine runs (`PolicyView`)


class PolicyView:
    """One configuration run by an engine shared with others: `activate()` sets the engine's policy (the plan
    of every step) to this configuration's before its run. The shared engine is the automatic policy's — the
    draft model and prompt lookup, both drafters' state kept per slot — so plain decoding, the draft at γ 3
    and prompt lookup at γ 4 run exactly as their own engines would (the same drafters, verifier choice,
    thread policy), while each prompt's KV, the target's and the draft model's, is prefilled once for all four
    configurations instead of once each (prefill is most of the grid's time on this CPU)."""

    def __init__(self, engine, policy, draft_name: str | None):
        self.engine, self.policy, self.draft_name = engine, policy, draft_name

    def activate(self) -> None:
        self.engine.policy = self.engine.executor.policy = self.policy

    def __getattr__(self, name):
        return getattr(self.engine, name)


def build_engines(names, specs, base, draft_model, args, max_len: int, slots: int) -> dict:
    """The configurations' engines over the loaded models; `slots` batch slots (the KV pool holds that many
    full-length rows: with --prefix-cache, room for every prompt of the kind to stay cached). Plain decoding,
    draft-g3, ngram and auto share the automatic policy's engine (`PolicyView`) unless --separate-engines;
    self-streaming has its own (its drafter reads the target's cache through a StreamingLLM view)."""
    from redwood import Engine
    from redwood.config import EngineConfig
    from redwood.speculation.policy import FixedPolicy, family_of
    from redwood.speculation.trees import Tree

    config = EngineConfig(max_num_seqs=slots, max_model_len=max_len, enable_prefix_caching=args.prefix_cache)
    shared = [n for n in names if n in SHARED] if not args.separate_engines else []
    out = {}
    if shared:
        engine = Engine(models_for(config_spec("auto", args), base, draft_model, args.threads), config)
        auto = engine.policy
        by_family = {family_of(d): d for d in auto.drafters}
        draft, ngram = by_family["draft"], by_family["ngram"]
        policies = {
            "ar": (FixedPolicy(), None),
            "draft-g3": (FixedPolicy(draft, Tree.chain(3)), draft.name),
            "ngram": (FixedPolicy(ngram, Tree.chain(args.ngram_gamma)), ngram.name),
            "auto": (auto, engine.draft_name),
        }
        for n in shared:
            out[n] = PolicyView(engine, *policies[n])
    for n in names:
        if n not in out:
            out[n] = Engine(models_for(specs[n], base, draft_model, args.threads), config)
    return out


def warm_up(engines: dict, tokenizer, threads) -> None:
    """One short request through each engine (first-call costs out of the measured runs)."""
    from redwood import SamplingParams
    from redwood.data.prompts import encode
    from redwood.engine.threads import apply_threads

    ids = encode(tokenizer, "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
    for e in engines.values():
        apply_threads(threads)
        if isinstance(e, PolicyView):
            e.activate()
        run_group(e, [ids], [SamplingParams(max_new_tokens=6, ignore_eos=True)])


def cell_prompts(cell, prompts: int) -> int:
    """Prompts a cell runs: --prompts rounded up to a multiple of its batch (6 → 8 at batch 4)."""
    return math.ceil(prompts / cell[2]) * cell[2]


def by_kind(cells) -> dict:
    """The cells grouped by kind (first-appearance order): a kind's cells share its prompts and engines."""
    groups: dict = {}
    for c in cells:
        groups.setdefault(c[0], []).append(c)
    return groups


def kind_engines(kind, kcells, names, specs, base, draft_model, args, new_tokens):
    """The kind's prompts (as many as its largest cell runs) and its engines, warmed up."""
    n = max(cell_prompts(c, args.prompts) for c in kcells)
    bmax = max(c[2] for c in kcells)
    prompts = kind_prompts(kind, n, base.tokenizer, args.seed)
    max_len = min(max(map(len, prompts)) + new_tokens + 16, base.model.config.max_position_embeddings)
    slots = n + bmax if args.prefix_cache else bmax
    engines = build_engines(names, specs, base, draft_model, args, max_len, slots)
    warm_up(engines, base.tokenizer, args.threads)
    return prompts, engines


def run_cell(cell, engines, prompts, names, args, report, save, label) -> dict:
    """A cell's repeats, the configurations interleaved in each, over the kind's engines."""
    kind, temp, batch = cell
    prompts = prompts[: cell_prompts(cell, args.prompts)]
    out = {
        "kind": kind,
        "temperature": temp,
        "batch": batch,
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "configs": list(names),
        "drafters": {nm: e.draft_name for nm, e in engines.items()},
        "started": now(),
        "runs": [],
    }
    report["cells"].append(out)
    for r in range(args.repeats):
        for nm in names:
            res = run_config(engines[nm], prompts, batch, temp, args.new_tokens, args.seed, args.threads)
            res.update(repeat=r, config=nm)
            ar = next((x for x in out["runs"] if x["repeat"] == r and x["config"] == "ar"), None)
            if temp == 0 and ar is not None:
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(ar["requests"], res["requests"]))
                res["equal_ar"] = f"{same}/{len(prompts)}"
            out["runs"].append(res)
            ratio = f" = {res['decode_tokens_per_s'] / ar['decode_tokens_per_s']:.2f}× AR" if ar else ""
            acc = res["acceptance_rate"]
            print(
                f"[{label}] repeat {r + 1}/{args.repeats} {nm}: {res['decode_tokens_per_s']:.2f} tok/s{ratio}, "
                f"{res['tokens_per_row_step']:.2f} tok/step"
                + (f", acceptance {acc:.2f}" if acc is not None else "")
                + (f", = AR {res['equal_ar']}" if "equal_ar" in res else "")
                + f", prefill {res['prefill_s']:.0f} s ({res['wall_s']:.0f} s; {time.perf_counter() - T0:.0f} s in all)",
                flush=True,
            )
            save()
    out["ended"] = now()
    out["summary"] = summarize_cell(out["runs"], kind, names)
    save()
    return out


# ---------------------------------------------------------------------------------------------- tables and goals
def verdict(ratios: list[float], threshold: float) -> dict:
    """A goal over per-repeat ratios: the median against the threshold; "re-run" when the ratios spread
    wider (max − min) than the median's distance from the threshold."""
    med = statistics.median(ratios)
    spread = max(ratios) - min(ratios)
    if spread > abs(med - threshold):
        v = "re-run"
    else:
        v = "PASS" if med >= threshold else "FAIL"
    return {
        "threshold": threshold,
        "ratios": ratios,
        "median": med,
        "min": min(ratios),
        "max": max(ratios),
        "spread": spread,
        "verdict": v,
    }


def summarize_cell(runs: list[dict], kind: str, names) -> dict:
    """Per configuration: median / min / max tok/s over repeats, the spread (max − min over the median), the
    median of the per-repeat ratios to AR, tokens per step, acceptance, outputs equal to AR's; the best fixed
    configuration; the goals with their verdicts; whether the cell is flagged for a re-run."""
    by = {n: sorted((r for r in runs if r["config"] == n), key=lambda r: r["repeat"]) for n in names}
    by = {n: rs for n, rs in by.items() if rs}
    repeats = sorted({r["repeat"] for r in runs})

    def tps(n, rep):
        return next((r["decode_tokens_per_s"] for r in by[n] if r["repeat"] == rep), None)

    def paired(a, b):
        return [tps(a, rep) / tps(b, rep) for rep in repeats if tps(a, rep) and tps(b, rep)]

    configs = {}
    for n, rs in by.items():
        v = [r["decode_tokens_per_s"] for r in rs]
        med = statistics.median(v)
        acc = [r["acceptance_rate"] for r in rs if r.get("acceptance_rate") is not None]
        eq = [r["equal_ar"] for r in rs if "equal_ar" in r]
        configs[n] = {
            "tokens_per_s": v,
            "median": med,
            "min": min(v),
            "max": max(v),
            "spread": (max(v) - min(v)) / med if med else 0.0,
            "x_ar": statistics.median(paired(n, "ar")) if "ar" in by and paired(n, "ar") else None,
            "tokens_per_row_step": statistics.median(r["tokens_per_row_step"] for r in rs),
            "acceptance_rate": statistics.median(acc) if acc else None,
            "equal_ar": eq,
            "plans": {k: sum(r.get("plans", {}).get(k, 0) for r in rs) for r in rs for k in r.get("plans", {})},
        }
    fixed = [n for n in FIXED if n in configs]
    best = max(fixed, key=lambda n: configs[n]["median"]) if fixed else None
    goals = {}
    if "auto" in by and "ar" in by:
        goals["auto / AR"] = verdict(paired("auto", "ar"), AUTO_VS_AR)
    if "auto" in by and best is not None:
        goals[f"auto / best fixed ({best})"] = verdict(paired("auto", best), AUTO_VS_BEST)
    if kind in NGRAM_GOAL_KINDS and "ngram" in by and "ar" in by:
        goals["ngram / AR"] = verdict(paired("ngram", "ar"), NGRAM_VS_AR)
    return {
        "configs": configs,
        "best_fixed": best,
        "goals": goals,
        "flagged": any(g["verdict"] == "re-run" for g in goals.values()),
    }


def cell_label(cell) -> str:
    kind, temp, batch = cell
    return f"{kind}, T={temp:g}, batch {batch}"


def cell_markdown(c: dict, new_tokens: int) -> str:
    s = c.get("summary") or summarize_cell(c["runs"], c["kind"], c["configs"])
    reps = len({r["repeat"] for r in c["runs"]})
    pt = c["prompt_tokens"]
    lines = [
        f"### {cell_label((c['kind'], c['temperature'], c['batch']))}"
        + (" — **re-run**" if s["flagged"] else "")
        + (" (incomplete)" if "ended" not in c else "")
        + (f" (re-run; {len(c['previous'])} earlier run(s) in report.json)" if c.get("previous") else ""),
        "",
        f"{c['prompts']} prompts ({min(pt)}–{max(pt)} tokens) × {new_tokens} new tokens, {reps} repeat(s); "
        f"best fixed: {s['best_fixed']}",
        "",
        "| config | tok/s (median) | spread: min–max | × AR | tokens/step | acceptance | = AR (T=0) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, v in s["configs"].items():
        acc = "–" if v["acceptance_rate"] is None else f"{v['acceptance_rate']:.2f}"
        xar = "–" if v["x_ar"] is None else f"{v['x_ar']:.2f}"
        eq = ", ".join(v["equal_ar"]) if v["equal_ar"] else "–"
        lines.append(
            f"| {n} | {v['median']:.2f} | {v['min']:.2f}–{v['max']:.2f} ({100 * v['spread']:.1f}%) | {xar} | "
            f"{v['tokens_per_row_step']:.2f} | {acc} | {eq} |"
        )
    for n, v in s["configs"].items():
        if n == "auto" and v.get("plans"):
            total = sum(v["plans"].values())
            mix = ", ".join(f"{k} {100 * c / total:.0f}%" for k, c in sorted(v["plans"].items(), key=lambda x: -x[1]))
            lines += ["", f"auto's steps by plan (all repeats): {mix}"]
    if s["goals"]:
        lines += ["", "| goal | median | min–max (spread) | threshold | verdict |", "|---|---|---|---|---|"]
        for g, v in s["goals"].items():
            lines.append(
                f"| {g} | {v['median']:.3f} | {v['min']:.3f}–{v['max']:.3f} ({v['spread']:.3f}) | "
                f"≥ {v['threshold']} | {v['verdict']} |"
            )
    return "\n".join(lines)


def summary_markdown(cells: list[dict]) -> str:
    names = [n for n in CONFIGS if any(n in c["configs"] for c in cells)]
    head = ["cell", "AR tok/s"] + [f"{n} × AR" for n in names if n != "ar"] + ["goals", "flag"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        s = c.get("summary") or summarize_cell(c["runs"], c["kind"], c["configs"])
        cf = s["configs"]
        row = [cell_label((c["kind"], c["temperature"], c["batch"]))]
        row.append(f"{cf['ar']['median']:.2f}" if "ar" in cf else "–")
        for n in names:
            if n != "ar":
                row.append(f"{cf[n]['x_ar']:.2f}" if n in cf and cf[n]["x_ar"] is not None else "–")
        row.append("; ".join(f"{g} {v['median']:.2f} {v['verdict']}" for g, v in s["goals"].items()) or "–")
        row.append("re-run" if s["flagged"] else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def report_markdown(report: dict) -> str:
    m, a = report["machine"], report["args"]
    done = [c for c in report["cells"] if c.get("runs")]
    out = [
        "# Speculation grid on the CPU (issue 37)",
        "",
        f"{m['cpu']} ({m['cpu_class']}), {m['usable_cores']} cores, threads {m['threads']}; commit {m['git_commit']}"
        f"{' (dirty)' if m.get('git_dirty') else ''}; target {report['target']}, draft {report['draft']}.",
        f"Started {report['started']}, ended {report.get('ended', '(running)')}, wall {report.get('wall_s', 0):.0f} s. "
        f"{a['prompts']} prompts × {a['new_tokens']} new tokens, {a['repeats']} repeats per cell.",
    ]
    out += [f"Note: {n}" for n in report.get("notes", [])]
    for r in report.get("reruns", []):
        out.append(
            f"Re-run of the flagged cells: started {r['started']}, ended {r.get('ended', '(running)')}, "
            f"wall {r.get('wall_s', 0):.0f} s (commit {r['machine']['git_commit']})."
        )
    out += ["", "## Summary", "", summary_markdown(done), ""]
    for c in done:
        out += [cell_markdown(c, a["new_tokens"]), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- machine
def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_info(threads) -> dict:
    import torch

    from redwood.engine.threads import adaptive_threads, usable_cores

    flags, cpu = set(), platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and cpu in ("", platform.machine(), platform.processor()):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    if "avx512_vnni" in flags:
        cls = "avx512-vnni"
    elif "avx512f" in flags:
        cls = "avx512"
    elif "avx2" in flags:
        cls = "avx2"
    else:
        cls = "other"
    root = Path(__file__).resolve().parent.parent

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    adaptive = adaptive_threads(threads)
    return {
        "cpu": cpu,
        "cpu_class": cls,
        "avx512_flags": sorted(f for f in flags if f.startswith("avx512")),
        "usable_cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "threads": threads
        if threads is not None
        else (f"adaptive {adaptive.base}/{adaptive.wide}" if adaptive else torch.get_num_threads()),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


# ---------------------------------------------------------------------------------------------- estimate
def estimate(args, base, draft_model, names, specs, cells) -> None:
    """Project the grid's wall time from a short calibration: per kind and configuration one prompt cut to its
    last --estimate-prompt-tokens tokens, --estimate-tokens new tokens (batch 1, T = 0): prefill seconds per
    prompt token (scaled to the kind's prompt lengths) and decode tokens/s; per configuration 4 chat prompts at
    batch 4 and then one by one through one engine, for batch 4's per-row rate against batch 1's (applied to
    every kind). With --prefix-cache a prompt is prefilled once per configuration for all of its kind's cells
    and repeats."""
    t0 = time.perf_counter()
    groups = by_kind(cells)
    e_tok, cut = args.estimate_tokens, args.estimate_prompt_tokens
    cal, b4, lengths = {}, {}, {}
    for kind, kcells in groups.items():
        n = max(cell_prompts(c, args.prompts) for c in kcells)
        lengths[kind] = statistics.mean(map(len, kind_prompts(kind, n, base.tokenizer, args.seed)))
        prompts = [p[-cut:] for p in kind_prompts(kind, 1, base.tokenizer, args.seed)]
        eng = build_engines(names, specs, base, draft_model, args, len(prompts[0]) + e_tok + 16, 1)
        warm_up(eng, base.tokenizer, args.threads)
        for nm in names:
            r = run_config(eng[nm], prompts, 1, 0.0, e_tok, args.seed, args.threads)
            cal[(kind, nm)] = (r["prefill_s"] / len(prompts[0]), r["decode_tokens_per_s"])
            print(
                f"  {kind:<13} {nm:<15} prefill {r['prefill_s']:6.2f} s ({len(prompts[0])} tokens), "
                f"{r['decode_tokens_per_s']:6.2f} tok/s",
                flush=True,
            )
        del eng
    if any(c[2] > 1 for c in cells):
        prompts = [p[-cut:] for p in kind_prompts("chat", 4, base.tokenizer, args.seed)]
        eng = build_engines(names, specs, base, draft_model, args, max(map(len, prompts)) + e_tok + 16, 8)
        for nm in names:
            r4 = run_config(eng[nm], prompts, 4, 0.0, e_tok, args.seed, args.threads)
            r1 = run_config(eng[nm], prompts, 1, 0.0, e_tok, args.seed, args.threads)
            b4[nm] = r4["decode_tokens_per_s"] / 4 / r1["decode_tokens_per_s"]
            print(
                f"  chat, batch 4 {nm:<15} {r4['decode_tokens_per_s']:6.2f} tok/s vs batch 1 "
                f"{r1['decode_tokens_per_s']:6.2f}: {b4[nm]:.2f}× per row",
                flush=True,
            )
        del eng
    cal_s = time.perf_counter() - t0
    proxy = []  # configurations projected as another's time
    if "auto" in args.configs and "auto" not in names and "draft-g3" in names:
        proxy.append("draft-g3")
        print("  auto is not available yet: projected as draft-g3's time (it is built with the draft model)")
    every = names + proxy
    load = REPORT_LOAD_S

    def project(prompts: int, new_tokens: int, show: bool = False) -> float:
        """Seconds the grid would take (models loaded) at this many prompts and new tokens."""
        total = load
        for kind, kcells in groups.items():
            n = max(cell_prompts(c, prompts) for c in kcells)
            per_prompt = sum(cal[(kind, nm)][0] for nm in every) * lengths[kind]
            # with the prefix cache each engine prefills a prompt once: the shared engine once for its four
            prefill = [nm for nm in every if args.separate_engines or nm not in SHARED]
            if len(prefill) < len(every):
                prefill.append(max((nm for nm in every if nm in SHARED), key=lambda nm: cal[(kind, nm)][0]))
            pre = n * sum(cal[(kind, nm)][0] for nm in prefill) * lengths[kind] if args.prefix_cache else 0.0
            total += pre + len(every) * 5  # (+ engines, warm-up)
            if show:
                print(f"  {kind:<30} prefill {pre / 60:5.1f} min (once per prompt and engine)")
            for cell in kcells:
                p = cell_prompts(cell, prompts)
                sec = 0.0 if args.prefix_cache else args.repeats * p * per_prompt
                for nm in every:
                    tps = cal[(kind, nm)][1] * (b4.get(nm, 1.0) if cell[2] > 1 else 1.0)  # (per row)
                    sec += args.repeats * (p // cell[2]) * new_tokens / tps
                total += sec
                if show:
                    print(f"  {cell_label(cell):<30} decode  {sec / 60:5.1f} min")
        return total

    print(
        f"\nprojected ({args.prompts} prompts × {args.new_tokens} tokens, {args.repeats} repeats, "
        f"prefix cache {'on' if args.prefix_cache else 'off'}):"
    )
    total = project(args.prompts, args.new_tokens, show=True)
    print(
        f"  models load {load:.0f} s; total {total / 3600:.2f} h (calibration took {cal_s:.0f} s; T = 0.7 taken as "
        f"T = 0; tok/s over {e_tok} tokens, not {args.new_tokens}; a repeat's uncached prompt tail left out)"
    )
    budget = args.budget_h * 3600
    if total <= budget:
        print(f"  within the {args.budget_h:g} h budget")
        return
    print(f"  over the {args.budget_h:g} h budget by {(total - budget) / 60:.0f} min; smaller grids:")
    for p in range(args.prompts - 1, 0, -1):
        for nt in sorted({args.new_tokens, 64, 48} & set(range(args.new_tokens + 1)), reverse=True):
            t = project(p, nt)
            print(f"    --prompts {p} --new-tokens {nt}: {t / 3600:.2f} h" + (" (fits)" if t <= budget else ""))
            if t <= budget:
                return


# ---------------------------------------------------------------------------------------------- self-test
def self_test() -> None:
    """The goal and table code on made-up runs."""

    def runs(values):
        return [
            {
                "config": n,
                "repeat": r,
                "decode_tokens_per_s": v,
                "tokens_per_row_step": 1.0 if n == "ar" else 2.0,
                "acceptance_rate": None if n == "ar" else 0.5,
                **({"equal_ar": "6/6"} if n != "ar" else {}),
            }
            for n, vs in values.items()
            for r, v in enumerate(vs)
        ]

    # a clear pass everywhere: auto = the best fixed (ngram), ngram 2× AR
    s = summarize_cell(
        runs({"ar": [10, 10.2, 9.9], "ngram": [20, 20.1, 19.8], "auto": [19.9, 20.2, 19.8]}), "code-edit", CONFIGS
    )
    assert s["best_fixed"] == "ngram", s
    assert [g["verdict"] for g in s["goals"].values()] == ["PASS", "PASS", "PASS"], s["goals"]
    assert not s["flagged"]
    assert abs(s["configs"]["ngram"]["x_ar"] - 2.0) < 0.02
    # auto a clear fail against the best; the auto / AR ratio near its threshold with a wide spread: re-run
    s = summarize_cell(runs({"ar": [10, 10, 10], "draft-g3": [15, 15, 15], "auto": [9.5, 10.6, 9.8]}), "chat", CONFIGS)
    g = s["goals"]
    assert g["auto / AR"]["verdict"] == "re-run", g
    assert g["auto / best fixed (draft-g3)"]["verdict"] == "FAIL", g
    assert "ngram / AR" not in g and s["flagged"]
    # no auto: only the draftless goal, and only for its kinds
    assert list(summarize_cell(runs({"ar": [10], "ngram": [14]}), "summarize", CONFIGS)["goals"]) == ["ngram / AR"]
    assert summarize_cell(runs({"ar": [10], "ngram": [14]}), "chat", CONFIGS)["goals"] == {}
    assert verdict([1.2], 1.5)["verdict"] == "FAIL" and verdict([1.6], 1.5)["verdict"] == "PASS"
    cell = {"kind": "chat", "temperature": 0.0, "batch": 4, "prompts": 8, "prompt_tokens": [30, 60]}
    cell.update(configs=list(CONFIGS), runs=runs({"ar": [10, 10, 10], "draft-g3": [15, 15, 15]}), ended="x")
    md = cell_markdown(cell, 96)
    assert "| draft-g3 | 15.00 | 15.00–15.00 (0.0%) | 1.50 |" in md, md
    assert "chat, T=0, batch 4" in summary_markdown([cell])
    print("self-test passed")


# ---------------------------------------------------------------------------------------------- main
T0 = time.perf_counter()
REPORT_LOAD_S = 0.0


def parse_cells(args) -> list[tuple]:
    if args.cells:
        cells = []
        for c in args.cells:
            k, t, b = c.split(":")
            if k not in KINDS:
                sys.exit(f"unknown kind {k!r} in --cells; kinds: {', '.join(KINDS)}")
            cells.append((k, float(t), int(b)))
        return cells
    return [
        c
        for c in ISSUE_CELLS
        if c[0] in args.kinds and any(abs(c[1] - t) < 1e-9 for t in args.temps) and c[2] in args.batches
    ]


def main() -> None:
    global REPORT_LOAD_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--temps", nargs="+", type=float, default=list(TEMPS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--cells", nargs="+", default=None, metavar="KIND:T:B", help="explicit cells (over the filters)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None, help="default: redwood's choice (adaptive 1/2 here)")
    ap.add_argument("--seed", type=int, default=0, help="prompt choice; prompt i samples with seed + i")
    ap.add_argument("--model", default=TARGET)
    ap.add_argument("--draft-model", default=DRAFT)
    ap.add_argument("--weights", default="auto", help="the target's CPU format (main job: auto → kquant here)")
    ap.add_argument("--draft-weights", default="auto", help="the draft's (main job: auto → q4k here)")
    ap.add_argument("--self-budget", type=int, default=256, help="self-streaming's draft KV budget (tokens)")
    ap.add_argument("--ngram-gamma", type=int, default=4)
    ap.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each prompt's KV between a kind's cells and repeats: each configuration prefills a prompt once",
    )
    ap.add_argument(
        "--separate-engines",
        action="store_true",
        help="one engine per configuration (each prefills every prompt itself) instead of ar, draft-g3, ngram "
        "and auto sharing the auto engine (`PolicyView`)",
    )
    ap.add_argument("--out", default=None, help="folder for report.json and report.md")
    ap.add_argument("--rerun-flagged", default=None, metavar="REPORT.json")
    ap.add_argument("--estimate", action="store_true", help="project the grid's wall time, then stop")
    ap.add_argument("--estimate-tokens", type=int, default=32, help="new tokens per calibration run")
    ap.add_argument("--estimate-prompt-tokens", type=int, default=256, help="calibration prompts cut to their end")
    ap.add_argument("--budget-h", type=float, default=2.0)
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return

    previous = None
    if args.rerun_flagged:
        previous = json.loads(Path(args.rerun_flagged).read_text())
        keep = {"out": args.out or str(Path(args.rerun_flagged).parent), "rerun_flagged": args.rerun_flagged}
        args = argparse.Namespace(**{**vars(args), **previous["args"], **keep})
        cells = [
            (c["kind"], c["temperature"], c["batch"]) for c in previous["cells"] if c.get("summary", {}).get("flagged")
        ]
        print(f"re-running {len(cells)} flagged cell(s): {', '.join(map(cell_label, cells)) or 'none'}", flush=True)
        if not cells:
            return
    else:
        cells = parse_cells(args)
    notes = []
    names = list(dict.fromkeys(args.configs))
    if "ar" not in names:
        notes.append("no AR in the configurations: no ratios to AR, no goals against it")

    from redwood.engine.loaded import LoadedModels
    from redwood.speculation.config import SpeculativeConfig

    specs = {n: config_spec(n, args) for n in names}
    t_load = time.perf_counter()
    base = LoadedModels.load(
        args.model,
        weights=args.weights,
        threads=args.threads,
        speculative=SpeculativeConfig(
            draft_model=args.draft_model, num_draft_tokens=3, draft_weights=args.draft_weights
        ),
    )
    draft_model = base.drafter.own_model
    REPORT_LOAD_S = time.perf_counter() - t_load
    print(
        f"loaded {args.model} ({base.model.weights}) and {args.draft_model} ({draft_model.weights}) in "
        f"{REPORT_LOAD_S:.0f} s; cells: {len(cells)}, configurations: {', '.join(names)}",
        flush=True,
    )
    if args.estimate:
        estimate(args, base, draft_model, names, specs, cells)
        return

    report = {
        "issue": 37,
        "target": f"{args.model} ({base.model.weights})",
        "draft": f"{args.draft_model} ({draft_model.weights})",
        "machine": machine_info(args.threads),
        "args": {k: v for k, v in vars(args).items() if k not in ("estimate", "self_test")},
        "notes": notes,
        "started": now(),
        "load_s": REPORT_LOAD_S,
        "cells": [],
    }
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["wall_s"] = time.perf_counter() - T0
        if out is None:
            return
        merged = report
        if previous is not None:  # the flagged cells replaced (the old runs kept under "previous")
            new = {(c["kind"], c["temperature"], c["batch"]): c for c in report["cells"]}
            cells_m = []
            for c in previous["cells"]:
                k = (c["kind"], c["temperature"], c["batch"])
                old = {f: v for f, v in c.items() if f != "previous"}
                cells_m.append({**new[k], "previous": c.get("previous", []) + [old]} if k in new else c)
            this = {k: v for k, v in report.items() if k != "cells"}
            merged = {**previous, "cells": cells_m, "reruns": previous.get("reruns", []) + [this]}
        (out / "report.json").write_text(json.dumps(merged, indent=1))
        (out / "report.md").write_text(report_markdown(merged))

    i = 0
    for kind, kcells in by_kind(cells).items():
        prompts, engines = kind_engines(kind, kcells, names, specs, base, draft_model, args, args.new_tokens)
        for cell in kcells:
            i += 1
            label = cell_label(cell)
            print(f"\n== cell {i}/{len(cells)}: {label}", flush=True)
            run_cell(cell, engines, prompts, names, args, report, save, label)
        del engines
        gc.collect()
    report["ended"] = now()
    save()
    done = [c for c in report["cells"] if c.get("runs")]
    print("\n" + summary_markdown(done) + "\n")
    for c in done:
        print(cell_markdown(c, args.new_tokens) + "\n")
    print(
        f"wall time {report['wall_s']:.0f} s ({report['wall_s'] / 3600:.2f} h)" + (f"; report in {out}" if out else "")
    )


if __name__ == "__main__":
    main()
