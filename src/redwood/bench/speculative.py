"""`redwood bench baseline|standalone|selfspec`: MagicDec's experiments on long real text.

Every run cuts `batch_size` prompts of exactly `prefix_len` tokens from one long text (a dataset's
concatenated documents — essays by default — or any text file), then, in the same process and on the
same prompts, measures

- the autoregressive baseline: the target alone, exactly `gen_len` tokens per row (EOS ignored);
- for `standalone` (a small draft model) and `selfspec` (the target drafting for itself through a
  compressed view of its KV cache): speculative decoding with each γ of the sweep.

Throughput is decode tokens/s over the whole batch: the tokens after the first (which the prefill
yields), divided by the time from the end of the prefill to the last row's last token — the same
definition as `bench ar`. Speedup = speculative tokens/s over the baseline's for the same (batch,
prefix). Acceptance statistics use the engine's definitions (`redwood.engine.request.SpecStats`):
acceptance rate = accepted / drafted; mean accepted length = tokens per target step *including* the
bonus / correction token (= `tokens_per_step`; `accepted_per_step` excludes it); acceptance by position
i = fraction of steps whose draft token i was accepted (so it also counts all tokens before i).
Greedy speculative output must equal the autoregressive output token for token; every run reports
whether it does (`identical_to_ar`; None when sampling, where outputs legitimately differ).

Each measurement is one static batch through an Engine of its own (every prompt added at once, a slot
each; prefills run one prompt per step beside the rows already decoding). `prefill_s` sums the rows'
prefill times (copied to each speculative run as `ar_prefill_s`); `end_to_end_tokens_per_s` counts every
generated token over the whole run (less graph captures), where the batch drains row by row — what
`bench throughput` fixes by refilling finished rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from redwood.bench.divergence import divergence_logits, first_divergence
from redwood.devices import free_memory
from redwood.engine.runner import sync
from redwood.errors import ConfigError
from redwood.sampling_params import SamplingParams

KINDS = ("baseline", "standalone", "selfspec")
DEFAULT_DATASET = "essays"
WARMUP_PREFIX = 64  # warm-up prompts are cut to at most this many tokens
WARMUP_TOKENS = 4


# ---------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class PromptSource:
    """Where prompts come from: a dataset name (`redwood data list`) or a text file."""

    dataset: str | None = None
    prompts_file: str | None = None

    @property
    def label(self) -> str:
        return f"file {self.prompts_file}" if self.prompts_file else f"dataset {self.dataset}"

    def check(self) -> None:
        """Fail early (before any model loads) on a missing file or an unknown dataset."""
        if self.prompts_file:
            p = Path(self.prompts_file)
            if not p.is_file():
                raise ConfigError(f"--prompts-file {p}: no such file")
            self._read(p)
        elif self.dataset:
            from redwood.data.recipes import get_recipe

            get_recipe(self.dataset)
        else:
            raise ConfigError("no prompt source: give --dataset NAME or --prompts-file FILE")

    def documents(self) -> str | list[dict]:
        if not self.prompts_file:
            return self.dataset
        p = Path(self.prompts_file)
        return [{"id": p.name, "text": self._read(p)}]

    @staticmethod
    def _read(p: Path) -> str:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts-file {p}: cannot read it as UTF-8 text ({e})") from None
        if not text.strip():
            raise ConfigError(f"--prompts-file {p} is empty")
        return text


def make_prompts(
    tokenizer,
    source: PromptSource,
    batch_size: int,
    prefix_len: int,
    seed: int = 0,
    docs: str | list[dict] | None = None,
) -> list[list[int]]:
    """`batch_size` windows of exactly `prefix_len` tokens from the source's long text (seeded offsets)."""
    from redwood.data.prompts import long_context_prompts

    if tokenizer is None:
        raise ConfigError("this model has no tokenizer, so text cannot be cut into prompts")
    try:
        return long_context_prompts(
            tokenizer, source.documents() if docs is None else docs, prefix_len, batch_size, seed
        )
    except ConfigError as e:
        if source.prompts_file:
            raise ConfigError(str(e).replace("dataset <documents>", source.label)) from None
        raise


# -------------------------------------------------------------------------------------------- measuring
def sampling_params(
    batch_size: int, gen_len: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None
) -> list[SamplingParams]:
    """Exactly `gen_len` tokens per row, EOS ignored; row b samples with seed + b (when seeded)."""
    return [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=gen_len,
            ignore_eos=True,
            seed=None if seed is None else seed + b,
        )
        for b in range(batch_size)
    ]


def aggregate_spec(stats: Sequence[dict]) -> dict[str, Any]:
    """Speculation stats over all rows (their final RequestStats dicts): rates from summed counts; draft /
    verify time of the batch (the engine's timings already leave out one-time CUDA-graph captures)."""
    specs = [s["speculative"] for s in stats if s.get("speculative")]
    steps = sum(s["steps"] for s in specs)
    drafted = sum(s["drafted"] for s in specs)
    accepted = sum(s["accepted"] for s in specs)
    width = max((len(s["acceptance_by_position"]) for s in specs), default=0)
    at = [
        sum(round(s["acceptance_by_position"][i] * s["steps"]) for s in specs if i < len(s["acceptance_by_position"]))
        for i in range(width)
    ]
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
        "accepted_per_step": accepted / steps if steps else 0.0,
        "acceptance_by_position": [a / steps for a in at] if steps else [],
        # every active row shares each step's draft and verify forward: the batch's time is the longest row's
        "draft_s": max((s["draft_s"] for s in specs), default=0.0),
        "verify_s": max((s["verify_s"] for s in specs), default=0.0),
        # (0 / 0 above when each step ran as one CUDA graph: then only whole steps are timed)
        "step_s": max((s["step_s"] for s in specs), default=0.0),
        "ms_per_step": max((1e3 * s["step_s"] / s["steps"] for s in specs if s["steps"]), default=0.0),
    }


def measure(
    llm, prompts: list[list[int]], params: list[SamplingParams], drafter=None, tree=None, verifier: str = "auto"
) -> dict[str, Any]:
    """One generation of `prompts` as one batch through a fresh Engine over llm's models (a slot per
    prompt, every request added at once): autoregressive (drafter None) or speculative over `tree`."""
    from redwood.engine.engine import Engine

    model = llm.model
    device = model.device
    lookahead = 1 if tree is None else tree.size
    longest = max(len(p) + q.max_new_tokens for p, q in zip(prompts, params))
    config = {
        "max_num_seqs": len(prompts),
        "max_model_len": min(longest + lookahead, model.config.max_position_embeddings),
        "max_num_batched_tokens": sum(len(p) for p in prompts),  # (all prefilled in step 1)
    }
    if llm.tp is not None:  # sharded models serve one engine at a time: rebuilt on every rank
        if drafter is not None and drafter is not llm.drafter:
            raise ConfigError("under tensor parallelism a benchmark speculates with the LLM's own drafter")
        engine = llm.engine = llm.engine.rebuild(speculate=drafter is not None, tree=tree, verifier=verifier, **config)
    else:
        engine = Engine.build(
            model, llm.tokenizer, drafter=drafter, tree=tree, verifier=verifier, model_name=llm.model_name, **config
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    token_ids: dict[str, list[int]] = {i: [] for i in ids}
    stats: dict[str, dict] = {}
    sync(device)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for d in engine.step():
            token_ids[d.request_id] += d.token_ids
            if d.finish_reason is not None:
                stats[d.request_id] = d.stats
    sync(device)
    wall = time.perf_counter() - t0
    rows = [token_ids[i] for i in ids]
    # CUDA-graph capture of a new step shape happens once per engine, in the first decode steps: a
    # one-time cost like compilation, which the engine leaves out of decode and step times; reported apart.
    decode_s = max(stats[i]["decode_s"] for i in ids)
    decoded = sum(len(t) - 1 for t in rows)
    out: dict[str, Any] = {
        "prefill_s": sum(stats[i]["prefill_s"] for i in ids),
        "decode_s": decode_s,
        "capture_s": engine.capture_s,
        "wall_s": wall,
        "tokens_per_s": decoded / decode_s if decode_s > 0 else 0.0,
        "end_to_end_tokens_per_s": sum(len(t) for t in rows) / (wall - engine.capture_s),
        "generated_tokens": sum(len(t) for t in rows),
        "token_ids": rows,
    }
    if device.type == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if drafter is not None:
        out.update(aggregate_spec([stats[i] for i in ids]))
    del engine
    free_memory(device)
    return out


# ---------------------------------------------------------------------------------------------- the bench
def _unique(values: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(values))


def check_sizes(
    batch_sizes: Sequence[int], prefix_lens: Sequence[int], gen_len: int, gammas: Sequence[int] = ()
) -> None:
    """Clear errors for non-positive sizes (before any model loads)."""
    for flag, values in (("--batch-size", batch_sizes), ("--prefix-len", prefix_lens), ("--gamma", gammas)):
        for v in values:
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1, got {v}")
    if gen_len < 2:
        raise ConfigError(f"--gen-len must be at least 2 (one token from the prefill, the rest decoded), got {gen_len}")


def check_context(llm, prefix_lens: Sequence[int], gen_len: int) -> None:
    """Every prompt plus the generation (and a speculative step's scratch) must fit the models' context."""
    models = [("the model", llm.config)]
    draft = getattr(getattr(llm, "drafter", None), "model", None)
    if draft is not None and draft is not llm.model:
        models.append(("the draft model", draft.config))
    longest = max(prefix_lens)
    for what, cfg in models:
        context = cfg.max_position_embeddings
        if longest + gen_len > context:
            raise ConfigError(
                f"--prefix-len {longest} + --gen-len {gen_len} = {longest + gen_len} tokens is more "
                f"than {what}'s context of {context} tokens; use a shorter prefix or generation"
            )


def run_bench(
    llm,
    kind: str,
    batch_sizes: Sequence[int],
    prefix_lens: Sequence[int],
    gen_len: int,
    source: PromptSource,
    gammas: Sequence[int] = (4,),
    *,
    trees: Sequence[str] = (),
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    prompt_seed: int = 0,
    verifier: str = "auto",
    progress=None,
) -> dict[str, Any]:
    """Measure the baseline (and, unless kind == "baseline", speculation with a chain at each γ and with
    each of `trees`) for every (batch size, prefix length); `llm` is an `LLM` built with the matching
    SpeculativeConfig (its `drafter` is used directly, so the draft shape varies without reloading).

    Returns {"kind", "model", "draft", "gen_len", …, "runs": [one per (batch, prefix[, γ])],
    "best": [best γ per (batch, prefix)], "all_identical": bool | None}.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown bench kind {kind!r}; choose one of {', '.join(KINDS)}")
    batch_sizes, prefix_lens, gammas = _unique(batch_sizes), _unique(prefix_lens), _unique(gammas)
    speculating = kind != "baseline"
    check_sizes(batch_sizes, prefix_lens, gen_len, gammas if speculating else ())
    from redwood.speculation.trees import Tree, resolve_tree

    shapes = [(f"chain:{g}", Tree.chain(g)) for g in gammas] + [(t, resolve_tree(t)) for t in _unique(trees)]
    drafter = llm.drafter if speculating else None
    if speculating and drafter is None:
        raise ConfigError(f"bench {kind} needs an LLM built with speculative=SpeculativeConfig(...)")
    check_context(llm, prefix_lens, gen_len)
    docs = source.documents()
    say = progress or (lambda msg: None)

    # every prompt set first, so a text too short for some setting fails before anything is measured
    prompt_sets = {
        (b, n): make_prompts(llm.tokenizer, source, b, n, prompt_seed, docs) for b in batch_sizes for n in prefix_lens
    }
    runs: list[dict[str, Any]] = []
    best: list[dict[str, Any]] = []
    # warm-up (not timed): each code path once, on short prompts
    warm = [p[:WARMUP_PREFIX] for p in prompt_sets[batch_sizes[0], prefix_lens[0]]]
    warm_params = sampling_params(len(warm), min(gen_len, WARMUP_TOKENS), temperature, top_p, seed)
    measure(llm, warm, warm_params)
    if speculating:
        measure(llm, warm, warm_params, drafter, shapes[0][1], verifier)
    for batch in batch_sizes:
        for prefix in prefix_lens:
            params = sampling_params(batch, gen_len, temperature, top_p, seed)
            say(f"batch {batch}, prefix {prefix}: autoregressive")
            ar = measure(llm, prompt_sets[batch, prefix], params)
            base = {"method": kind if speculating else "ar", "batch_size": batch, "prefix_len": prefix}
            if not speculating:
                runs.append({**base, **{k: v for k, v in ar.items() if k != "token_ids"}})
                continue
            group = []
            for label, tree in shapes:
                say(f"batch {batch}, prefix {prefix}: {kind}, {label}")
                sp = measure(llm, prompt_sets[batch, prefix], params, drafter, tree, verifier)
                run = _spec_run(base, label, tree, sp, ar, greedy=temperature == 0)
                if "first_divergence" in run:
                    d = run["first_divergence"]
                    d.update(
                        divergence_logits(
                            llm.engine.prompt_logits,
                            prompt_sets[batch, prefix][d["row"]],
                            ar["token_ids"][d["row"]],
                            sp["token_ids"][d["row"]],
                            d["position"],
                        )
                    )
                group.append(run)
            runs += group
            top = max(group, key=lambda r: r["speedup"] or 0.0)
            best.append(
                {
                    "batch_size": batch,
                    "prefix_len": prefix,
                    "gamma": top["gamma"],
                    "tree": top["tree"],
                    "speedup": top["speedup"],
                    "tokens_per_s": top["tokens_per_s"],
                }
            )

    identical = [r["identical_to_ar"] for r in runs if r.get("identical_to_ar") is not None]
    return {
        "kind": kind,
        "model": llm.model_name,
        "draft": llm.draft_name if speculating else None,
        "prompts": source.label,
        "gen_len": gen_len,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "verifier": verifier if speculating else None,
        "dtype": str(llm.model.dtype).removeprefix("torch."),
        "device": str(llm.model.device),
        "runs": runs,
        "best": best,
        "all_identical": all(identical) if identical else None,
    }


def _spec_run(
    base: dict[str, Any], label: str, tree, sp: dict[str, Any], ar: dict[str, Any], greedy: bool
) -> dict[str, Any]:
    """One speculative run's record: its measurement `sp` next to the baseline's `ar`."""
    run = {
        **base,
        "gamma": tree.max_depth - 1,
        "tree": label,
        "tree_size": tree.size,
        "ar_tokens_per_s": ar["tokens_per_s"],
        **{k: v for k, v in sp.items() if k != "token_ids"},
        "speedup": sp["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] > 0 else None,
        "tokens_per_step": sp["mean_accepted_length"],
        "identical_to_ar": (sp["token_ids"] == ar["token_ids"]) if greedy else None,
        "ar_prefill_s": ar["prefill_s"],
        "ar_decode_s": ar["decode_s"],
    }
    if "peak_memory_bytes" in ar:
        run["ar_peak_memory_bytes"] = ar["peak_memory_bytes"]
    # Steady state: the rate while every row is still generating — batch × tokens per step / step time —
    # what a server that refills finished rows sustains. The end-to-end `speedup` also pays for the
    # batch's slowest row (finished rows keep occupying the batch), which AR, emitting one token per row
    # per step, never does.
    ms = sp.get("ms_per_step") or 0.0
    steady = base["batch_size"] * sp["mean_accepted_length"] / ms * 1e3 if ms > 0 else None
    run["steady_tokens_per_s"] = steady
    run["steady_speedup"] = steady / ar["tokens_per_s"] if steady and ar["tokens_per_s"] > 0 else None
    if run["identical_to_ar"] is False:  # where the greedy outputs part (row, output position)
        run["first_divergence"] = first_divergence(ar["token_ids"], sp["token_ids"])
    return run


# ----------------------------------------------------------------------------------------------- output
def _f(v: Any, fmt: str, width: int) -> str:
    return f"{'–':>{width}}" if v is None else f"{v:>{width}{fmt}}"


def format_result(r: dict[str, Any]) -> str:
    """The short table: one row per configuration, then the best γ per (batch, prefix)."""
    sampling = "greedy" if r["temperature"] == 0 else f"temperature {r['temperature']}, top-p {r['top_p']}"
    head = f"{r['kind']}: {r['model']}"
    if r.get("draft"):
        head += f", draft {r['draft']}"
    lines = [
        head,
        f"{r['gen_len']} tokens per row ({sampling}, EOS ignored); prompts from {r['prompts']}; "
        f"{r['dtype']} on {r['device']}",
    ]
    if r["kind"] == "baseline":
        lines.append(f"{'batch':>5} {'prefix':>7} {'prefill s':>10} {'decode s':>9} {'tok/s':>10}")
        for x in r["runs"]:
            lines.append(
                f"{x['batch_size']:>5} {x['prefix_len']:>7} {x['prefill_s']:>10.3f} {x['decode_s']:>9.3f} "
                f"{x['tokens_per_s']:>10.2f}"
            )
        return "\n".join(lines)
    lines.append(
        f"{'batch':>5} {'prefix':>7} {'draft shape':>12} {'AR tok/s':>10} {'spec tok/s':>10} {'speedup':>8} {'steady':>7} "
        f"{'accept':>7} {'acc len':>7} {'draft s':>8} {'verify s':>8} {'ms/step':>8}  {'same':<4}  "
        "acceptance by position"
    )
    for x in r["runs"]:
        same = {True: "yes", False: "NO", None: "n/a"}[x["identical_to_ar"]]
        pos = " ".join(f"{a:.2f}" for a in x["acceptance_by_position"])
        speedup = "–" if x["speedup"] is None else f"{x['speedup']:.2f}x"
        steady = "–" if x.get("steady_speedup") is None else f"{x['steady_speedup']:.2f}x"
        lines.append(
            f"{x['batch_size']:>5} {x['prefix_len']:>7} {x['tree']:>12} {x['ar_tokens_per_s']:>10.2f} "
            f"{x['tokens_per_s']:>10.2f} {speedup:>8} {steady:>7} {x['acceptance_rate']:>7.3f} "
            f"{x['mean_accepted_length']:>7.2f} {x['draft_s']:>8.3f} {x['verify_s']:>8.3f} "
            f"{x.get('ms_per_step', 0.0):>8.2f}  {same:<4}  {pos}"
        )
    if len({x["tree"] for x in r["runs"]}) > 1:
        for b in r["best"]:
            lines.append(
                f"best draft shape at batch {b['batch_size']}, prefix {b['prefix_len']}: {b['tree']} "
                f"({_f(b['speedup'], '.2f', 0).strip()}x)"
            )
    lines.append(
        "acc len = tokens per target step, bonus token included; same = greedy output identical to "
        "autoregressive; draft/verify s are 0 when each step runs as one CUDA graph (see ms/step);\n"
        "steady = speedup while every row is generating (batch × acc len / step time over AR), as a "
        "server refilling finished rows would see; speedup = until the batch's last row is done"
    )
    if r["all_identical"] is False:
        lines.append("WARNING: greedy speculative output differs from autoregressive output (must be identical)")
        for x in r["runs"]:
            d = x.get("first_divergence")
            if d and "top2_gap" in d:
                lines.append(
                    f"  batch {x['batch_size']}, prefix {x['prefix_len']}, {x['tree']}: row {d['row']} parts at "
                    f"output token {d['position']}; target's top-2 logit gap there {d['top2_gap']:.4g}"
                    + (f", AR token − spec token logit {d['logit_gap']:.4g}" if "logit_gap" in d else "")
                )
    return "\n".join(lines)


def to_report(r: dict[str, Any], extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `write_report` form (schema redwood.bench/1) of a `run_bench` result."""
    runs = []
    for x in r["runs"]:
        run = dict(x)
        run.setdefault("max_new_tokens", r["gen_len"])
        runs.append(run)
    aggregate: dict[str, Any] = {}
    spec_runs = [x for x in r["runs"] if x.get("speedup") is not None]
    if spec_runs:
        top = max(spec_runs, key=lambda x: x["speedup"])
        aggregate.update(
            speedup=top["speedup"],
            tokens_per_s=top["tokens_per_s"],
            best_gamma=top["gamma"],
            best_batch_size=top["batch_size"],
            best_prefix_len=top["prefix_len"],
        )
    elif r["runs"]:
        aggregate["tokens_per_s"] = max(x["tokens_per_s"] for x in r["runs"])
    if r["all_identical"] is not None:
        aggregate["greedy_identical_to_ar"] = r["all_identical"]
    config = {
        "prompts": r["prompts"],
        "gen_len": r["gen_len"],
        "temperature": r["temperature"],
        "top_p": r["top_p"],
        "seed": r["seed"],
        "verifier": r["verifier"],
        "dtype": r["dtype"],
        "device": r["device"],
        "ignore_eos": True,
        **(extra_config or {}),
    }
    models = {"target": r["model"], "dtype": r["dtype"]}
    if r.get("draft"):
        models["draft"] = r["draft"]
    return {
        "kind": r["kind"],
        "models": models,
        "config": config,
        "runs": runs,
        "aggregate": aggregate,
        "best_gamma": r["best"],
    }
