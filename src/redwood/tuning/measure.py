"""Measuring acceptance vectors (`redwood acceptance`): per-rank acceptance of a draft against a target.

Both methods write a ``redwood.acceptance/1`` record (see `redwood.tuning.acceptance`): values[k-1] is the
unconditional probability that the draft's rank-k child of a node is the one the verifier accepts.

**Dynamic (on-policy).** Real speculative generation through the normal engine (`LLM` with a
`SpeculativeConfig` whose tree is the depth-1 star of width W, ``chains:Wx1``). At every step of every
row the accepted child's rank (or none) is recorded; the vector is the normalised histogram and
``p_none`` the share of steps that accepted no child, so Σ values + p_none = 1 and ``samples`` is the
number of speculation steps. The rank is read off the accepted path the engine hands to its drafter's
`commit` (for a depth-1 tree, node k *is* rank k): the drafter is wrapped, the engine is untouched.

**Static (teacher-forced).** One forward of each model over real text (prompt + continuation). At every
position whose next token lies in the continuation (the ``gen_len`` positions after the first
``prompt_len`` tokens), with p and q the target's and draft's processed distributions
(`redwood.sample.sampler.probabilities`: temperature, then top-p — the very ones the verifiers use),
W children are drawn by the verifier's own rule (`draw_children`, seeded) and the *expected* per-rank
acceptance given those children is computed exactly — no random acceptance test:

- ``sequoia`` (children without replacement): entry 1 = min(1, p(x_1)/q(x_1)); entry k = (1 − Σ earlier
  entries) · min(1, p_res(x_k)/q'(x_k)), with p_res the residual normalize(max(p − q', 0)) after each
  rejection and q' the draft with the rejected children removed (uniform over untried tokens once its
  mass is used up — the exhausted-support rule of `verify_tree`);
- ``specinfer`` (children with replacement): the same recursion with q never modified;
- ``topk``: children are the draft's top W, the target draws y ~ p: entry k = p(x_k);
- ``greedy`` (temperature 0): entry k = 1 when x_k, the draft's k-th token, is the target's argmax.

The vector is the average over all positions (``samples`` = positions). ``p_none`` is left null as the
schema prescribes for static vectors; the expected no-acceptance probability 1 − Σ values is kept in
``notes.expected_none``.

**Prompts: a held-out slice.** Measurement text must not be evaluation text. Evaluation prompts
(`build_prompts`, `redwood bench`) take documents from the *front* of the seed-0 shuffle of a dataset;
measurement takes them from the *back* of the same order (`held_out_order`), so the two sets are
disjoint as long as together they fit in the dataset (the record lists the document ids used). Long
datasets (essays, shakespeare: one long text) have no documents to split: their windows are cut with
the distinct seed `LONG_WINDOW_SEED`, which avoids but cannot rule out overlap with evaluation windows
— prefer a prefix dataset (c4, openwebtext, wikipedia, news) or a ``--prompts`` file there.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from redwood.errors import ConfigError
from redwood.sample.sampler import probabilities
from redwood.sample.tree_verify import CHILD_RULE, VERIFIERS, draw_children
from redwood.speculation.drafters import Drafter
from redwood.tuning.acceptance import AcceptanceVector

MODES = ("dynamic", "static")
EVAL_SHUFFLE_SEED = 0  # the document order evaluation prompts are taken from (front)
LONG_WINDOW_SEED = 1_000_003  # windows of long datasets: a seed distinct from every bench default
# Elements of one [positions, vocab] working tensor in the static computation (memory bound).
_CHUNK_ELEMENTS = 1 << 23


def default_verifier(temperature: float) -> str:
    return "greedy" if temperature == 0 else "sequoia"


def check_settings(width: int, temperature: float, top_p: float, verifier: str) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ConfigError(f"width must be an integer >= 1 (children of the root to rank), got {width!r}")
    if not isinstance(temperature, (int, float)) or temperature != temperature or temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ConfigError(f"top-p must be in (0, 1], got {top_p!r}")
    if verifier not in VERIFIERS:
        raise ConfigError(f"unknown verifier {verifier!r}; choose one of {', '.join(VERIFIERS)}")
    if verifier == "match":  # (its coupled child shares the target's uniform: no per-child expectation)
        raise ConfigError(
            "acceptance is not modelled for match; measure it end to end (benchmarks/match_acceptance.py)"
        )
    if verifier == "greedy" and temperature > 0:
        raise ConfigError(
            "the greedy verifier is exact only at temperature 0; use sequoia, specinfer or topk for sampled decoding"
        )


# ============================================================================ static: exact expectations
def expected_acceptance(p: torch.Tensor, q: torch.Tensor, children: torch.Tensor, verifier: str) -> torch.Tensor:
    """Expected per-rank acceptance at N nodes, given their children.

    p: [N, V] target distributions; q: [N, V] the draft distributions the children were drawn from;
    children: [N, W] child tokens in rank order (drawn by `CHILD_RULE[verifier]`). Returns [N, W]
    float64: entry k is the probability (over the verifier's own randomness only) that child k is the
    one accepted. Each row sums to at most 1.
    """
    if verifier not in VERIFIERS or verifier == "match":
        raise ValueError(f"no expected acceptance for verifier {verifier!r}")
    N, V = p.shape
    W = children.shape[1]
    rows = torch.arange(N, device=p.device)
    p = p.float()
    out = torch.zeros(N, W, dtype=torch.float64, device=p.device)
    if verifier == "greedy":
        return (children == p.argmax(-1, keepdim=True)).to(torch.float64)
    if verifier == "topk":
        # y ~ p; rank k wins when y == x_k (children are distinct)
        return p.gather(1, children).to(torch.float64)
    q = q.float()
    swor = verifier == "sequoia"
    untried = torch.ones(N, V, dtype=torch.bool, device=p.device) if swor else None
    remaining = torch.ones(N, dtype=torch.float64, device=p.device)
    for k in range(W):
        x = children[:, k]
        px, qx = p[rows, x], q[rows, x]
        # verify_tree accepts x when p(x) > r·q(x), r ~ U[0, 1): probability min(1, p/q); 1 if q(x) = 0 < p(x)
        a = torch.where(qx > 0, (px / qx.clamp(min=1e-30)).clamp(max=1.0), (px > 0).float()).double()
        out[:, k] = remaining * a
        remaining = remaining * (1 - a)
        if k == W - 1:
            break
        # the state after rejecting x (later entries are conditional on it)
        residual = (p - q).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        p = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
        if swor:
            untried[rows, x] = False
            q_left = q.clone()
            q_left[rows, x] = 0.0
            q_mass = q_left.sum(-1, keepdim=True)
            uniform = untried.float() / untried.sum(-1, keepdim=True).clamp(min=1)
            q = torch.where(q_mass > 0, q_left / q_mass.clamp(min=1e-30), uniform)
    return out


def static_acceptance(
    p: torch.Tensor,
    q: torch.Tensor,
    width: int,
    verifier: str,
    generator: torch.Generator,
    rank_by: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw W children per node by the verifier's rule and return their expected acceptance [N, W].

    p, q: [N, V] processed target / draft distributions; rank_by: [N, V] what the draft ranks its top-k
    children by for greedy / topk (the drafter uses its raw softmax; default q). The children of all N
    nodes come from `generator`, in order. Processed in chunks of positions to bound memory.
    """
    N, V = p.shape
    if not 1 <= width <= V:
        raise ConfigError(f"width {width} must be between 1 and the vocabulary size {V}")
    rule = CHILD_RULE[verifier]
    chunk = max(1, _CHUNK_ELEMENTS // V)
    outs = []
    for s in range(0, N, chunk):
        pc, qc = p[s : s + chunk], q[s : s + chunk]
        src = qc if rule != "topk" or rank_by is None else rank_by[s : s + chunk]
        rows = torch.zeros(pc.shape[0], dtype=torch.long)
        kids = draw_children(src, width, rule, [generator], rows)
        outs.append(expected_acceptance(pc, qc, kids, verifier))
    return torch.cat(outs) if outs else torch.zeros(0, width, dtype=torch.float64)


@dataclass
class StaticResult:
    values: list[float]
    positions: int
    expected_none: float


def _pad_vocab(x: torch.Tensor, vocab: int) -> torch.Tensor:
    if x.shape[-1] >= vocab:
        return x[..., :vocab]
    return torch.cat([x, x.new_zeros(*x.shape[:-1], vocab - x.shape[-1])], dim=-1)


@torch.inference_mode()
def _logits_at(model, ids: list[int], at: torch.Tensor) -> torch.Tensor:
    device = model.device
    x = torch.tensor(ids, device=device)[None]
    cache = model.new_cache(1, len(ids))
    positions = torch.arange(len(ids), device=device)[None]
    return model(x, positions, cache, logits_at=at.to(device)[None])[0]  # [K, V] float32


@torch.inference_mode()
def measure_static(
    target,
    draft,
    texts: Sequence[tuple[list[int], int]],
    width: int,
    temperature: float,
    top_p: float,
    verifier: str,
    seed: int = 0,
    progress=None,
) -> StaticResult:
    """Teacher-forced expected acceptance over `texts`: (token ids, number of leading context tokens).

    target / draft: redwood Transformers sharing a tokenizer (the draft may have a smaller or larger
    vocabulary: ids up to the smaller one are shared, as in `ModelDrafter`). Positions t with
    ctx ≤ t < len(ids) are scored (the distributions predicting token t from ids[:t]).
    """
    check_settings(width, temperature, top_p, verifier)
    v_target = target.config.vocab_size
    shared = min(v_target, draft.config.vocab_size)
    device = target.device
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    total = torch.zeros(width, dtype=torch.float64)
    count = 0
    for i, (ids, ctx) in enumerate(texts):
        if not 1 <= ctx < len(ids):
            continue
        at = torch.arange(ctx - 1, len(ids) - 1)
        lt = _logits_at(target, ids, at)
        ld = _logits_at(draft, ids, at).to(device)[:, :shared]
        K = lt.shape[0]
        temp = torch.full((K,), float(temperature), device=device)
        tk = torch.zeros(K, dtype=torch.long, device=device)
        tp = torch.full((K,), float(top_p), device=device)
        p = probabilities(lt, temp, tk, tp)
        q = _pad_vocab(probabilities(ld, temp, tk, tp), v_target)
        rank_by = _pad_vocab(ld.float().softmax(-1), v_target)
        acc = static_acceptance(p, q, width, verifier, gen, rank_by=rank_by)
        total += acc.sum(0).cpu()
        count += K
        if progress is not None:
            progress(i + 1, len(texts), count)
    if count == 0:
        raise ConfigError(
            "no positions to score: every text is no longer than its context (prompt) part; "
            "use longer texts or a smaller --prompt-len"
        )
    values = (total / count).tolist()
    return StaticResult(values=values, positions=count, expected_none=max(0.0, 1.0 - sum(values)))


# ============================================================================ dynamic: on-policy histogram
class _RankRecorder(Drafter):
    """Wraps the engine's drafter; `commit(path, count)` reveals each row's accepted path."""

    def __init__(self, inner: Drafter, width: int):
        self._inner = inner
        self._width = width
        self.pending: dict[int, int] = {}  # row → accepted rank (0: none) of the latest step

    def __getattr__(self, name):  # anything else (e.g. `policy`) is the wrapped drafter's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def own_model(self):  # (class attributes of Drafter: __getattr__ would not reach them)
        return self._inner.own_model

    @property
    def standalone(self) -> bool:
        return self._inner.standalone

    def propose(self, *args, **kwargs):
        return self._inner.propose(*args, **kwargs)

    def commit(self, draft, path_src, count):
        # count = accepted + 1 (the root) for each generating batch row, 0 for the others; in a depth-1
        # tree node k is the rank-k child
        first = path_src[:, 1] if path_src.shape[1] > 1 else torch.zeros_like(path_src[:, 0])
        ranks = torch.where(count > 1, first, torch.zeros_like(first)).tolist()
        rows = count.tolist()
        if any(not 0 <= r <= self._width for r in ranks):
            raise RuntimeError(f"accepted rank out of range 0..{self._width}: {ranks}")
        self.pending = {b: r for b, (r, c) in enumerate(zip(ranks, rows)) if c > 0}
        return self._inner.commit(draft, path_src, count)


@dataclass
class DynamicResult:
    counts: list[int]  # counts[k-1]: steps that accepted the rank-k child
    none: int  # steps that accepted no child
    engine_steps: int  # speculation steps by the engine's own SpecStats (equals sum(counts) + none)
    generated_tokens: int
    request_stats: list[dict] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(self.counts) + self.none

    @property
    def values(self) -> list[float]:
        n = self.steps
        return [c / n for c in self.counts] if n else [0.0] * len(self.counts)

    @property
    def p_none(self) -> float:
        return self.none / self.steps if self.steps else 0.0


def star_tree_spec(width: int) -> str:
    """The depth-1 tree of `width` children as a tree spec (W one-token chains = the star)."""
    return f"chains:{int(width)}x1"


def measure_dynamic(
    llm,
    prompts: Sequence[list[int]],
    width: int,
    temperature: float,
    top_p: float,
    gen_len: int,
    seed: int = 0,
    batch_size: int = 1,
    progress=None,
) -> DynamicResult:
    """Generate `gen_len` tokens (EOS ignored) for each prompt with `llm` (an LLM speculating with a
    width-`width` depth-1 tree) and histogram the accepted rank of every step of every row.

    Row i samples with seed + i. Prompts are run `batch_size` at a time (rows are independent)."""
    from redwood.engine.engine import Engine
    from redwood.sampling_params import SamplingParams
    from redwood.speculation.trees import Tree

    tree = getattr(llm, "tree", None)
    if llm.drafter is None or tree is None:
        raise ConfigError("dynamic measurement needs an LLM built with a SpeculativeConfig")
    if tree != Tree.k_chains(width, 1):
        raise ConfigError(
            f"dynamic measurement needs the depth-1 tree of width {width} "
            f"({star_tree_spec(width)}), got {tree.size} nodes in {tree.max_depth} levels"
        )
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    counts = [0] * width
    none = 0
    engine_steps = 0
    generated = 0
    stats: list[dict] = []
    previous = llm._engine
    if previous is not None and previous.has_unfinished():
        raise ConfigError("dynamic measurement needs an idle engine")
    recorder = _RankRecorder(llm.drafter, width)
    # A fresh engine over the LLM's models with the recorder as its drafter (slots handed out from 0)
    llm.engine = Engine(dataclasses.replace(llm.models, drafter=recorder), llm.engine_config)
    try:
        for start in range(0, len(prompts), batch_size):
            batch = [list(p) for p in prompts[start : start + batch_size]]
            params = [
                SamplingParams(
                    temperature=temperature,
                    top_p=top_p,
                    max_new_tokens=gen_len,
                    ignore_eos=True,
                    seed=int(seed) + start + b,
                )
                for b in range(len(batch))
            ]
            # an idle engine gives the batch's requests slots 0, 1, … in order: slot == delta.index
            for delta in llm.stream(batch, params):
                rank = recorder.pending.pop(delta.index, None)
                if rank is not None:  # a speculation step of this row (the prefill's delta has none)
                    if rank == 0:
                        none += 1
                    else:
                        counts[rank - 1] += 1
                if delta.finish_reason is not None and delta.stats is not None:
                    stats.append(delta.stats)
                    spec = delta.stats.get("speculative") or {}
                    engine_steps += int(spec.get("steps", 0))
                    generated += int(delta.stats.get("generated_tokens", 0))
            if progress is not None:
                progress(min(start + batch_size, len(prompts)), len(prompts), sum(counts) + none)
    finally:
        llm.engine = previous
    res = DynamicResult(
        counts=counts, none=none, engine_steps=engine_steps, generated_tokens=generated, request_stats=stats
    )
    if res.steps != engine_steps:
        raise RuntimeError(f"recorded {res.steps} steps but the engine counted {engine_steps}")
    if res.steps == 0:
        raise ConfigError("no speculation steps were taken: generate more than one token (--gen-len)")
    return res


# ============================================================================ prompts
def held_out_order(num_docs: int) -> list[int]:
    """Document indices for measurement: the seed-0 shuffle (evaluation's order) reversed."""
    order = list(range(num_docs))
    random.Random(EVAL_SHUFFLE_SEED).shuffle(order)
    return order[::-1]


_REFERENCE_FIELDS = ("canonical_solution", "solution", "answer")


@dataclass
class MeasurementText:
    ids: list[int]  # prompt (dynamic) or prompt + continuation (static)
    context: int  # tokens of ids that are the prompt
    source: str  # document id / line number


def read_prompt_file(path: str | Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file (one prompt per line)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--prompts {p}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {p}: cannot read it as UTF-8 text ({e})") from None
    lines = [ln.rstrip("\r") for ln in text.split("\n")]
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        raise ConfigError(f"--prompts {p} has no non-empty lines (one prompt per line)")
    return lines


def file_texts(
    tokenizer, lines: Sequence[str], count: int, prompt_len: int, gen_len: int, static: bool
) -> list[MeasurementText]:
    """Texts from prompt-file lines, in file order.

    Dynamic: each line's first `prompt_len` tokens (with the tokenizer's usual special tokens) is a
    prompt. Static: lines longer than `prompt_len` tokens; the first `prompt_len` are context and up to
    `gen_len` more are scored."""
    from redwood.data.prompts import encode

    out = []
    for i, line in enumerate(lines, start=1):
        ids = encode(tokenizer, line, add_special_tokens=True)
        if static:
            if len(ids) <= prompt_len:
                continue
            out.append(MeasurementText(ids[: prompt_len + gen_len], prompt_len, f"line {i}"))
        elif ids:
            out.append(MeasurementText(ids[:prompt_len], min(prompt_len, len(ids)), f"line {i}"))
        if len(out) == count:
            break
    if not out:
        raise ConfigError(
            f"no prompt line has more than --prompt-len ({prompt_len}) tokens to score; use longer "
            f"lines or a smaller --prompt-len"
            if static
            else "no usable prompt lines"
        )
    return out


def dataset_texts(
    tokenizer, dataset: str, count: int, prompt_len: int, gen_len: int, static: bool
) -> tuple[list[MeasurementText], str]:
    """Held-out measurement texts from a dataset (see the module docstring); returns (texts, split note)."""
    from redwood.data.prompts import _chat_text, chat_prompt_ids, encode, has_chat_template, long_context_prompts
    from redwood.data.recipes import dataset_kind, load_dataset

    kind = dataset_kind(dataset)
    if kind == "long":
        length = prompt_len + (gen_len if static else 0)
        windows = long_context_prompts(tokenizer, dataset, length, count, seed=LONG_WINDOW_SEED)
        note = (
            f"windows of the concatenated text at seed {LONG_WINDOW_SEED} (bench uses seed 0); overlap with "
            f"evaluation windows is unlikely but not ruled out"
        )
        return [MeasurementText(w, prompt_len, f"window {i}") for i, w in enumerate(windows)], note
    docs = load_dataset(dataset)
    order = held_out_order(len(docs))
    note = (
        f"documents from the back of the seed-{EVAL_SHUFFLE_SEED} shuffle (evaluation prompts take the front); "
        f"disjoint while evaluation and measurement together use at most {len(docs)} documents"
    )
    out: list[MeasurementText] = []
    if kind == "prefix":
        for i in order:
            ids = encode(tokenizer, docs[i]["text"])
            need = prompt_len + 1 if static else prompt_len
            if len(ids) >= need:
                n = prompt_len + gen_len if static else prompt_len
                out.append(MeasurementText(ids[:n], prompt_len, str(docs[i].get("id", i))))
                if len(out) == count:
                    break
        what = f"at least {prompt_len + (1 if static else 0)} tokens"
    elif kind == "chat":
        use_chat = has_chat_template(tokenizer)
        for i in order:
            doc = docs[i]
            text = _chat_text(doc)
            prompt = chat_prompt_ids(tokenizer, text) if use_chat else encode(tokenizer, text, add_special_tokens=True)
            if static:
                ref = next((doc[f] for f in _REFERENCE_FIELDS if isinstance(doc.get(f), str) and doc[f].strip()), None)
                if ref is None:
                    continue
                cont = encode(tokenizer, ref)[:gen_len]
                if not cont:
                    continue
                out.append(MeasurementText(prompt + cont, len(prompt), str(doc.get("id", i))))
            else:
                out.append(MeasurementText(prompt, len(prompt), str(doc.get("id", i))))
            if len(out) == count:
                break
        what = "a reference answer" if static else "a prompt"
        note += "; chat prompts (prompt length as the template gives)" + (
            ", scored over the reference answer" if static else ""
        )
    else:
        raise ConfigError(f"dataset {dataset} has unknown kind {kind!r}")
    if not out:
        raise ConfigError(
            f"dataset {dataset} has no documents with {what} for this measurement"
            + ("; use --mode dynamic" if static and kind == "chat" else "")
        )
    if len(out) < count:
        raise ConfigError(
            f"dataset {dataset} has only {len(out)} documents with {what}, {count} requested; "
            f"ask for fewer with --num-prompts"
        )
    return out, note


# ============================================================================ records
def make_vector(
    method: str,
    values: Sequence[float],
    *,
    target: str,
    draft: str,
    temperature: float,
    top_p: float,
    dataset: str | None,
    samples: int,
    p_none: float | None,
    notes: dict[str, Any],
) -> AcceptanceVector:
    # Rounding can push a sum a hair past 1; the schema tolerates 1e-4, clamp anyway for cleanliness.
    vals = [min(1.0, max(0.0, float(v))) for v in values]
    return AcceptanceVector(
        values=tuple(vals),
        method=method,
        models={"target": target, "draft": draft},
        temperature=float(temperature),
        top_p=float(top_p),
        dataset=dataset,
        samples=int(samples),
        p_none=p_none,
        notes=notes,
    )
