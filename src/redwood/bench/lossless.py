"""Is sampled speculation lossless? A large-sample end-to-end test against the exact target distribution.

A tiny random target (vocabulary V = 16) makes the generated tokens' distribution computable exactly:
after a fixed prompt, every continuation of K tokens is scored by batched target forwards (all V^d
prefixes of each length d < K), turned into the distribution a request samples from by
`redwood.sample.sampler.probabilities` (temperature, top-k, top-p), and multiplied out into the joint
distribution of the K generated tokens (V^K cells, float64).

Each *configuration* (case) is a method — plain sampling, or speculation with some drafter, draft KV
policy, chain or tree and verifier — at one sampling setting. It generates N sequences through
`LLM.generate` (one seed per row; the cases' seed ranges are disjoint) and tests them:

- goodness of fit (χ²) of each position's marginal (K tests) and of each adjacent pair's joint
  (K − 1 tests over V² cells) against the exact distribution, cells of expected count < 5 pooled; a
  token the exact distribution gives probability 0 (cut by top-k / top-p) is an outright failure;
- two-sample homogeneity (χ²) of the same marginals and pairs against plain sampling's rows at the same
  setting (when the run has them; the same pooling), an independent check that needs no exact model.

The "control" method draws its rows from the exact distribution itself (torch's generator, no engine):
its p-values show how the tests behave on perfect samples.

p-values come from the χ² survival function (`redwood.bench.stats`). Holm's step-down
correction runs over *every* test of the run (valid under any dependence between the tests); the run
passes when the smallest corrected p is ≥ α. Effect sizes say what the N could see: per marginal the
largest |empirical − exact| and the total-variation distance, next to the TV that sampling noise alone
gives (`tv_noise`, its expectation under the exact distribution).

The harness reads only tokens and the outputs' stats: it does not depend on how the engine draws its
random numbers. Sampling can run in several worker processes (`workers`): per-row host bookkeeping, not
the device, limits throughput at these model sizes.
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from redwood.bench.stats import chi2_fit, chi2_homogeneity, effect, holm
from redwood.devices import free_memory
from redwood.sample.sampler import probabilities
from redwood.sampling_params import SamplingParams

VOCAB = 16
# 12 prompt tokens: a StreamingLLM draft view of 2 sinks + 4 recent tokens drops context from the first step.
PROMPT = (5, 11, 3, 14, 7, 9, 1, 12, 6, 15, 4, 10)
GENERATED = 5  # K: tokens generated per row (the first comes from the prefill, the rest through verifiers)
ALPHA = 0.01
SEED_BASE = 1_000_003
WIDE_TREE = (6, 2, 1)  # children per node, breadth-first: a root of 6 children (more than top-k 5 keeps)


# ------------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class Models:
    """Folders of the tiny models (safetensors, no tokenizer: token-id prompts) and a tree file."""

    target: str  # Llama, 2 layers, hidden 64
    close: str  # the target's weights plus small noise: a draft that agrees often, not always
    far: str  # an unrelated 1-layer Qwen2 model: many rejections
    wide_tree: str  # a JSON tree (WIDE_TREE)


def _random_weights(model, seed: int, scale: float) -> None:
    """Normal(0, scale²) weights (norm gains in [0.8, 1.2]): logits of std ≈ scale·√hidden ≈ 1 over 16
    tokens give distributions that are neither flat nor one-hot."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def _hf_config(arch: str, layers: int):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def build_models(root: str | Path, seed: int = 0, close_noise: float = 0.01) -> Models:
    """Write the target, the two drafts and the wide tree under `root`."""
    import transformers

    from redwood.speculation.trees import Tree

    root = Path(root)
    target = transformers.AutoModelForCausalLM.from_config(_hf_config("llama", 2)).eval()
    _random_weights(target, seed, scale=0.15)
    target.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # (in place: the target is already on disk)
        for p in target.parameters():
            p.add_(close_noise * torch.randn(p.shape, generator=g))
    target.save_pretrained(root / "close")
    far = transformers.AutoModelForCausalLM.from_config(_hf_config("qwen2", 1)).eval()
    _random_weights(far, seed + 2, scale=0.15)
    far.save_pretrained(root / "far")
    tree = Tree.from_branching(WIDE_TREE).save(root / "wide-tree.json")
    return Models(str(root / "target"), str(root / "close"), str(root / "far"), str(tree))


# ------------------------------------------------------------------------------------------ the matrix
@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    @property
    def label(self) -> str:
        return f"T={self.temperature:g} p={self.top_p:g} k={self.top_k}"

    def params(self, seed: int, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
        )


@dataclass(frozen=True)
class Method:
    """How rows are generated: plain sampling (draft None) or speculation.

    draft: "self" (self-speculation), "close" or "far" (a draft model, see `Models`), "ngram" (the draftless
    prompt-lookup drafter, matching 2 down to 1 tokens: it proposes on most steps of a tiny vocabulary), "suffix"
    (the draftless tree drafter, the same sizes; `gamma` does not apply: tree None is its default tree); tree:
    None (a chain of `gamma`), a shipped tree name, or "wide" (WIDE_TREE). source "exact": no engine at all —
    rows drawn from the exact distribution itself (`sample_exact`), a control of the statistics.
    """

    name: str
    draft: str | None = None
    draft_kv: str = "full"
    budget: int | None = None
    sinks: int | None = None
    window: int | None = None
    gamma: int = 3
    tree: str | None = None
    verifier: str = "sampling"
    source: str = "engine"
    policy: str = "fixed"  # "auto": the automatic policy plans each step (the draft beside the ngram drafter)

    def speculative(self, models: Models):
        from redwood.speculation.config import SpeculativeConfig

        if self.draft is None:
            return None
        tree = models.wide_tree if self.tree == "wide" else self.tree
        if self.policy == "auto":
            return SpeculativeConfig(draft_model=getattr(models, self.draft), ngram_min=1, ngram_max=2, policy="auto")
        if self.draft == "self":
            draft = dict(self_speculate=True)
        elif self.draft in ("ngram", "suffix"):
            draft = dict(draftless=self.draft, ngram_min=1, ngram_max=2)
        else:
            draft = dict(draft_model=getattr(models, self.draft))
        return SpeculativeConfig(
            **draft,
            draft_kv=self.draft_kv,
            draft_budget=self.budget,
            sinks=self.sinks,
            window=self.window,
            **({} if self.draft == "suffix" else dict(num_draft_tokens=self.gamma)),
            tree=tree,
            verifier=self.verifier,
        )


STREAM = dict(draft_kv="streaming", budget=6, sinks=2)  # 2 sinks + 4 recent tokens
SNAP = dict(draft_kv="snapkv", budget=6, window=2)  # 4 prompt positions per KV head + 2 recent

METHODS = {
    m.name: m
    for m in (
        Method("control", source="exact"),
        Method("plain"),
        Method("close-chain1", "close", gamma=1),
        Method("close-chain3", "close"),
        Method("far-chain3", "far"),
        Method("close-stream-chain3", "close", **STREAM),
        Method("close-g16-sequoia", "close", tree="generic-16", verifier="sequoia"),
        Method("close-g16-specinfer", "close", tree="generic-16", verifier="specinfer"),
        Method("close-g16-topk", "close", tree="generic-16", verifier="topk"),
        Method("far-wide-sequoia", "far", tree="wide", verifier="sequoia"),
        Method("far-wide-specinfer", "far", tree="wide", verifier="specinfer"),
        Method("far-wide-topk", "far", tree="wide", verifier="topk"),
        Method("close-chain3-match", "close", verifier="match"),
        Method("far-wide-match", "far", tree="wide", verifier="match"),
        Method("self-stream-chain3-match", "self", **STREAM, verifier="match"),
        Method("self-stream-chain3", "self", **STREAM),
        Method("ngram-chain3", "ngram"),
        Method("close-auto", "close", policy="auto"),
        Method("suffix-3x2-topk", "suffix", tree="chains:3x2", verifier="topk"),
        Method("suffix-3x2-match", "suffix", tree="chains:3x2", verifier="match"),
        Method("self-stream-g16-sequoia", "self", **STREAM, tree="generic-16", verifier="sequoia"),
        Method("self-snapkv-chain3", "self", **SNAP),
        Method("self-snapkv-g16-specinfer", "self", **SNAP, tree="generic-16", verifier="specinfer"),
    )
}

FULL_GRID = tuple(Sampling(t, p, k) for t in (0.6, 1.0, 1.5) for p in (1.0, 0.8) for k in (0, 5))
SMALL_GRID = (Sampling(1.0), Sampling(0.6, 0.8, 5))
FULL_GRID_METHODS = ("control", "plain", "self-stream-chain3", "far-wide-sequoia")


@dataclass(frozen=True)
class Case:
    method: Method
    sampling: Sampling

    @property
    def name(self) -> str:
        return f"{self.method.name} {self.sampling.label}"


def default_matrix(
    quick: bool = False, methods: Sequence[str] | None = None, full_grid: Sequence[str] | None = None
) -> list[Case]:
    """Every method at SMALL_GRID, and FULL_GRID for `full_grid` methods (none when quick); grouped by
    method, so that consecutive cases reuse one loaded LLM."""
    names = list(methods or METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    full = () if quick else tuple(FULL_GRID_METHODS if full_grid is None else full_grid)
    return [Case(METHODS[n], s) for n in names for s in (FULL_GRID if n in full else SMALL_GRID)]


# ------------------------------------------------------------------------------------------ exact
def prefixes(d: int, vocab: int = VOCAB) -> torch.Tensor:
    """All d-token sequences [V^d, d] in base-V order (the first token most significant)."""
    codes = torch.arange(vocab**d)
    digits = [(codes // vocab ** (d - 1 - i)) % vocab for i in range(d)]
    return torch.stack(digits, dim=1) if d else codes.new_zeros(1, 0)


@torch.inference_mode()
def continuation_logits(
    model, prompt: Sequence[int], generated: int, rows_per_forward: int = 8192
) -> list[torch.Tensor]:
    """levels[d]: [V^d, V] float32 logits of generated token d + 1 after the prompt and each d-token
    prefix (rows in `prefixes` order), d = 0 … K − 1, by full forwards over prompt + prefix."""
    device = model.device
    levels = []
    for d in range(generated):
        ids = torch.cat([torch.tensor(prompt).expand(VOCAB**d, -1), prefixes(d)], dim=1).to(device)
        out = []
        for chunk in ids.split(rows_per_forward):
            n, T = chunk.shape
            cache = model.new_cache(n, T)
            positions = torch.arange(T, device=device)[None].expand(n, -1)
            logits = model(chunk, positions, cache, logits_at=torch.full((n, 1), T - 1, device=device))
            out.append(logits[:, 0].float().cpu())
        levels.append(torch.cat(out))
    return levels


def level_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[R, V] logits → [R, V] the distribution a request with sampling `s` draws from."""
    R = logits.shape[0]
    return probabilities(
        logits, torch.full((R,), float(s.temperature)), torch.full((R,), s.top_k), torch.full((R,), float(s.top_p))
    )


def conditional(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """`level_probs` in float64, each row renormalized (as `inverse_cdf` scales its draw by the row's
    total mass, the float32 rows' rounding away from 1 is not part of the distribution sampled)."""
    probs = level_probs(logits, s).double()
    return probs / probs.sum(-1, keepdim=True)


def exact_joint(levels: list[torch.Tensor], s: Sampling) -> torch.Tensor:
    """The joint distribution of the K generated tokens: [V^K] float64, index = base-V code."""
    joint = torch.ones(1, dtype=torch.float64)
    for logits in levels:  # joint: [V^d] → [V^(d+1)], p(x1..xd+1) = p(x1..xd) · p(xd+1 | x1..xd)
        joint = (joint[:, None] * conditional(logits, s)).reshape(-1)
    return joint


NEAR_CUT = 1e-5


def filter_margins(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[R, V] logits → [R]: how close each distribution comes to a top-k / top-p cut (inf: no filter).

    Top-p: the least |mass of the more likely tokens − top_p|; top-k: the gap between the k-th and
    (k+1)-th scaled logits.
    """
    scaled = (logits.double() / s.temperature).sort(dim=-1, descending=True).values  # [R, V]
    margin = torch.full(scaled.shape[:1], math.inf, dtype=torch.float64)
    if 0 < s.top_k < VOCAB:
        margin = torch.minimum(margin, scaled[:, s.top_k - 1] - scaled[:, s.top_k])
    if s.top_p < 1:
        probs = scaled[:, : s.top_k or VOCAB].softmax(-1)
        before = probs.cumsum(-1) - probs
        margin = torch.minimum(margin, (before - s.top_p).abs().min(-1).values)
    return margin


def near_cut(levels: list[torch.Tensor], s: Sampling) -> dict:
    """Where a filter cut is close enough for rounding to matter. The engine's forwards round
    differently from `continuation_logits`' in the last bits (~1e-6), so at a margin below NEAR_CUT
    a token could be in the engine's distribution and out of the exact one: `mass` is the probability
    of reaching such a distribution (a bound on the TV that can cause), `margin` the least margin of any
    distribution reached with probability ≥ 1e-9."""
    prefix = torch.ones(1, dtype=torch.float64)  # [V^d] probability of each d-token prefix
    margin, mass = math.inf, 0.0
    for logits in levels:
        m = filter_margins(logits, s)
        reached = prefix >= 1e-9
        if reached.any():
            margin = min(margin, float(m[reached].min()))
        mass += float(prefix[m < NEAR_CUT].sum())
        prefix = (prefix[:, None] * conditional(logits, s)).reshape(-1)
    return dict(margin=None if math.isinf(margin) else margin, mass=mass)


# ------------------------------------------------------------------------------------------ sampling
@dataclass
class Sample:
    """What one case's rows generated: codes [N] (base-V code of each row's K tokens) and counters."""

    codes: torch.Tensor
    seconds: float  # sampling time (summed over the processes that sampled its parts)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_name: str | None = None

    @staticmethod
    def merge(parts: list["Sample"]) -> "Sample":
        """One case's parts (disjoint seed ranges) as one sample, in seed order as given."""
        return Sample(
            torch.cat([p.codes for p in parts]),
            sum(p.seconds for p in parts),
            sum(p.steps for p in parts),
            sum(p.drafted for p in parts),
            sum(p.accepted for p in parts),
            parts[0].draft_name,
        )


def sample_exact(joint: torch.Tensor, n: int, seed: int) -> Sample:
    """n rows drawn from the exact joint [V^K] by torch's generator: what a perfect engine would give."""
    t0 = time.perf_counter()
    codes = torch.multinomial(joint, n, replacement=True, generator=torch.Generator().manual_seed(seed))
    return Sample(codes, time.perf_counter() - t0, draft_name="exact draws")


def batch_sizes(n: int, batch: int) -> list[int]:
    """n rows in batches of at most `batch`: equal ones when n has a divisor in [batch / 2, batch] (one
    pooled cache and one set of graphs serve them all), else near-equal ones, the larger first."""
    for size in range(min(batch, n), max(1, batch // 2) - 1, -1):
        if n % size == 0:
            return [size] * (n // size)
    count = -(-n // batch)
    base, extra = divmod(n, count)
    return [base + 1] * extra + [base] * (count - extra)


def encode(tokens: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    """tokens [N, K] → base-V codes [N] (the first token most significant)."""
    K = tokens.shape[1]
    weights = vocab ** torch.arange(K - 1, -1, -1)
    return (tokens.long() * weights).sum(1)


def sample_rows(
    llm, sampling: Sampling, seeds: range, generated: int, batch: int, prompt: Sequence[int] = PROMPT
) -> Sample:
    """Generate len(seeds) rows (row i seeded seeds[i]) through `llm.generate`, `batch` rows per call."""
    t0 = time.perf_counter()
    codes, steps, drafted, accepted = [], 0, 0, 0
    start = seeds.start
    for size in batch_sizes(len(seeds), batch):
        params = [sampling.params(seed, generated) for seed in range(start, start + size)]
        start += size
        gc.disable()  # the engine makes a few objects per row and step; none are cyclic
        try:
            outs = llm.generate([list(prompt)] * size, params)
        finally:
            gc.enable()
        tokens = torch.tensor([o.token_ids for o in outs])  # [size, K]
        if tokens.shape != (size, generated):
            raise RuntimeError(f"expected {generated} tokens per row, got shape {tuple(tokens.shape)}")
        codes.append(encode(tokens))
        for o in outs:
            spec = o.stats.get("speculative")
            if spec:
                steps, drafted, accepted = steps + spec["steps"], drafted + spec["drafted"], accepted + spec["accepted"]
    return Sample(torch.cat(codes), time.perf_counter() - t0, steps, drafted, accepted, llm.draft_name)


@dataclass(frozen=True)
class Job:
    """A part of one case's sampling (a range of its seeds), as a worker process receives it."""

    index: int  # the case's
    case: Case
    models: Models
    seeds: range
    generated: int
    batch: int
    device: str
    cuda_graphs: bool | None


_loaded: dict = {}  # this process's current LLM: {"method": name, "llm": LLM}


def _llm_for(job: Job):
    """The LLM of the job's method, reusing this process's last one when it is the same method."""
    from redwood import LLM

    if _loaded.get("method") != job.case.method.name:
        _loaded.pop("llm", None)  # (freed before the next model loads)
        _loaded.clear()
        free_memory(torch.device(job.device))
        spec = job.case.method.speculative(job.models)
        _loaded.update(
            method=job.case.method.name,
            llm=LLM(
                job.models.target, dtype="float32", device=job.device, speculative=spec, cuda_graphs=job.cuda_graphs
            ),
        )
    return _loaded["llm"]


def run_job(job: Job) -> Sample:
    llm = _llm_for(job)
    return sample_rows(llm, job.case.sampling, job.seeds, job.generated, job.batch)


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ the tests of a case
def project(joint: torch.Tensor, generated: int, keep: tuple[int, ...]) -> torch.Tensor:
    """[V^K] (a joint or counts over K positions) → that of the positions `keep`, flattened."""
    cube = joint.view([VOCAB] * generated)
    others = [d for d in range(generated) if d not in keep]
    return (cube.sum(dim=others) if others else cube).reshape(-1)  # (sum over [] would sum everything)


def marginals(joint: torch.Tensor, generated: int) -> list[torch.Tensor]:
    """[V^K] → per position i: [V]."""
    return [project(joint, generated, (i,)) for i in range(generated)]


def adjacent_pairs(joint: torch.Tensor, generated: int) -> list[torch.Tensor]:
    """[V^K] → per i < K − 1: the joint of positions (i, i + 1) flattened [V²]."""
    return [project(joint, generated, (i, i + 1)) for i in range(generated - 1)]


def families(generated: int) -> list[tuple[str, tuple[int, ...]]]:
    """What each case tests: (name, positions) — every marginal, then every adjacent pair."""
    out = [(f"marginal t{i + 1}", (i,)) for i in range(generated)]
    return out + [(f"pair t{i + 1},t{i + 2}", (i, i + 1)) for i in range(generated - 1)]


def projections(x: torch.Tensor, generated: int) -> dict[tuple[int, ...], torch.Tensor]:
    """[V^K] (a joint or counts) → its projection on each family's positions."""
    return {keep: project(x, generated, keep) for _, keep in families(generated)}


def case_tests(counts: dict, exact: dict, reference: dict | None, generated: int) -> tuple[list[dict], list[dict]]:
    """All tests of one case, and the effect sizes per marginal / pair. counts, exact, reference:
    `projections` of the case's counts, of the exact joint, of plain sampling's counts (or None)."""
    tests, effects = [], []
    for name, keep in families(generated):
        c, p = counts[keep], exact[keep]
        tests.append(dict(test=f"fit {name}", **chi2_fit(c, p)))
        effects.append(dict(of=name, **effect(c, p)))
        if reference is not None:
            tests.append(dict(test=f"vs plain {name}", **chi2_homogeneity(c, reference[keep], p)))
    return tests, effects


# ------------------------------------------------------------------------------------------ the run
@dataclass
class Settings:
    samples: int = 1_000_000  # N per case
    generated: int = GENERATED
    batch: int = 4096  # rows per generate call
    device: str = "cpu"
    part: int | None = 250_000  # rows per job (a worker samples a case in parts; None: whole cases)
    workers: int = 1  # processes sampling in parallel (1: this process)
    time_limit: float | None = None  # seconds: no part starts after this; cases keep what is done
    threads: int = 1  # torch threads per worker process (workers > 1)
    cuda_graphs: bool | None = None
    seed_base: int = SEED_BASE
    alpha: float = ALPHA


def make_jobs(cases: list[Case], models: Models, settings: Settings) -> list[Job]:
    """Case c takes seeds seed_base + c·N … + N − 1, in parts of at most `settings.part` rows. Jobs go
    round-robin over the cases (every case's first part, then every case's second, …), so a run cut short
    by `time_limit` leaves every case with about the same number of rows."""
    N, part = settings.samples, settings.part or settings.samples
    jobs = []
    for offset in range(0, N, part):
        for c, case in enumerate(cases):
            start = settings.seed_base + c * N + offset
            jobs.append(
                Job(
                    c,
                    case,
                    models,
                    range(start, start + min(part, N - offset)),
                    settings.generated,
                    settings.batch,
                    settings.device,
                    settings.cuda_graphs,
                )
            )
    return jobs


def sample_all(
    cases: list[Case], models: Models, settings: Settings, log: Callable[[str], None]
) -> list[Sample | None]:
    """Sample every case, in this process or in `settings.workers` processes. Past `time_limit` seconds
    no new part starts; a case gets the parts done by then (None: none)."""
    jobs = make_jobs(cases, models, settings)
    parts: dict[int, list[tuple[int, Sample]]] = {}
    t0 = time.perf_counter()

    def done(job: Job, sample: Sample) -> bool:
        """Keep a finished part; True when time is up."""
        parts.setdefault(job.index, []).append((job.seeds.start, sample))
        finished = sum(len(v) for v in parts.values())
        log(f"[{finished}/{len(jobs)}] {job.case.name}: {len(job.seeds)} rows in {sample.seconds:.1f}s")
        return settings.time_limit is not None and time.perf_counter() - t0 > settings.time_limit

    if settings.workers <= 1:
        for job in jobs:
            if done(job, run_job(job)):
                break
        _loaded.clear()
    else:
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from multiprocessing import get_context

        with ProcessPoolExecutor(
            settings.workers, mp_context=get_context("spawn"), initializer=_worker_init, initargs=(settings.threads,)
        ) as pool:
            futures = {pool.submit(run_job, job): job for job in jobs}
            for future in as_completed(futures):
                if not future.cancelled() and done(futures[future], future.result()):
                    for f in futures:
                        f.cancel()  # (parts already running finish)
    merged = [
        Sample.merge([s for _, s in sorted(parts[c], key=lambda x: x[0])]) if c in parts else None
        for c in range(len(cases))
    ]
    if len(parts) < len(cases) or sum(len(v) for v in parts.values()) < len(jobs):
        log(f"time limit: {sum(len(v) for v in parts.values())} of {len(jobs)} parts sampled")
    return merged


def evaluate(cases: list[Case], samples: list[Sample | None], levels: list[torch.Tensor], settings: Settings) -> dict:
    """Tests for every case, Holm over all of them, and the report."""
    K = settings.generated
    sampled = [(case, s) for case, s in zip(cases, samples) if s is not None]
    skipped = [case.name for case, s in zip(cases, samples) if s is None]  # (past the time limit)

    def counted(sample: Sample) -> dict:
        return projections(torch.bincount(sample.codes, minlength=VOCAB**K), K)

    # (several cases share each sampling setting: its exact distribution and plain rows are read once)
    plain = {case.sampling: counted(s) for case, s in sampled if case.method.name == "plain"}
    settings_used = dict.fromkeys(case.sampling for case, _ in sampled)  # (unique, in order)
    exact = {setting: projections(exact_joint(levels, setting), K) for setting in settings_used}
    near = {setting: near_cut(levels, setting) for setting in settings_used}
    rows, all_tests = [], []
    for case, s in sampled:
        reference = plain.get(case.sampling) if case.method.name != "plain" else None
        tests, effects = case_tests(counted(s), exact[case.sampling], reference, K)
        for t in tests:
            t["case"] = case.name
        all_tests += tests
        rows.append(
            dict(
                case=case.name,
                method=asdict(case.method),
                sampling=asdict(case.sampling),
                samples=len(s.codes),
                seconds=round(s.seconds, 2),
                draft=s.draft_name,
                acceptance_rate=round(s.accepted / s.drafted, 4) if s.drafted else None,
                tokens_per_step=round((s.accepted + s.steps) / s.steps, 4) if s.steps else None,
                near_cut=near[case.sampling],
                tests=tests,
                effects=effects,
                max_tv=max(e["tv"] for e in effects if e["of"].startswith("marginal")),
                max_tv_noise=max(e["tv_noise"] for e in effects if e["of"].startswith("marginal")),
            )
        )
    adjusted = holm([t["p"] for t in all_tests])
    for t, a in zip(all_tests, adjusted):
        t["p_holm"] = a
    for row in rows:
        row["min_p"] = min(t["p"] for t in row["tests"])
        row["min_p_holm"] = min(t["p_holm"] for t in row["tests"])
        row["worst_test"] = min(row["tests"], key=lambda t: t["p"])["test"]
    min_holm = min(adjusted) if adjusted else 1.0
    # Under the null each raw p is (about) uniform: the share below a level should be about the level.
    below = {
        str(a): round(sum(p < a for p in (t["p"] for t in all_tests)) / max(1, len(all_tests)), 4)
        for a in (0.001, 0.01, 0.05, 0.1)
    }
    return dict(
        format="redwood.lossless/1",
        settings=asdict(settings),
        vocab=VOCAB,
        prompt=list(PROMPT),
        tests=len(all_tests),
        min_p_holm=min_holm,
        alpha=settings.alpha,
        share_of_p_below=below,
        verdict="PASS" if min_holm >= settings.alpha and rows else "FAIL",
        cases=rows,
        skipped=skipped,
    )


@dataclass
class Prepared:
    """The models on disk and the target's continuation logits (`continuation_logits`)."""

    models: Models
    levels: list[torch.Tensor]


def prepare(root: str | Path, settings: Settings) -> Prepared:
    """Build the models under `root` and score every continuation with the target."""
    from redwood.loading import load_model

    models = build_models(root)
    target = load_model(models.target, dtype="float32", device=settings.device).model
    return Prepared(models, continuation_logits(target, PROMPT, settings.generated))


def run_cases(cases: list[Case], settings: Settings, prepared: Prepared, log: Callable[[str], None] = print) -> dict:
    """Sample and test every case; returns the report."""
    t0 = time.perf_counter()
    log(f"sampling {len(cases)} cases × {settings.samples} rows")
    engine = [i for i, case in enumerate(cases) if case.method.source == "engine"]
    samples: list[Sample | None] = [None] * len(cases)
    for i, sample in zip(engine, sample_all([cases[i] for i in engine], prepared.models, settings, log)):
        samples[i] = sample
    for i, case in enumerate(cases):
        if case.method.source == "exact":
            samples[i] = sample_exact(
                exact_joint(prepared.levels, case.sampling), settings.samples, settings.seed_base + i
            )
    report = evaluate(cases, samples, prepared.levels, settings)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def run(cases: list[Case], settings: Settings, log: Callable[[str], None] = print) -> dict:
    """`prepare` in a temporary folder, then `run_cases`."""
    with tempfile.TemporaryDirectory(prefix="redwood-lossless-") as tmp:
        t0 = time.perf_counter()
        prepared = prepare(tmp, settings)
        log(
            f"exact distributions: {VOCAB}^{settings.generated} continuations scored in {time.perf_counter() - t0:.1f}s"
        )
        return run_cases(cases, settings, prepared, log)


def format_table(report: dict) -> str:
    """One line per case, then the verdict."""
    lines = [
        f"{'case':44} {'N':>8} {'accept':>6} {'tok/st':>6} {'max TV':>7} {'noise':>7} "
        f"{'min p':>9} {'min p_holm':>10} {'secs':>6}  worst test"
    ]
    for r in report["cases"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        tps = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
        lines.append(
            f"{r['case']:44} {r['samples']:>8} {acc:>6} {tps:>6} {r['max_tv']:>7.4f} "
            f"{r['max_tv_noise']:>7.4f} {r['min_p']:>9.2e} {r['min_p_holm']:>10.3g} {r['seconds']:>6.1f}  "
            f"{r['worst_test']}"
        )
    if report["skipped"]:
        lines.append(f"not sampled (time limit): {', '.join(report['skipped'])}")
    near = [r["case"] for r in report["cases"] if r["near_cut"]["mass"] > 0]
    if near:
        lines.append(f"warning: a top-k / top-p cut within {NEAR_CUT} of rounding in: {', '.join(near)}")
    shares = ", ".join(f"{float(v):.1%} < {a}" for a, v in report["share_of_p_below"].items())
    lines.append(f"raw p-values: {shares} (about the level each, if nothing deviates)")
    lines.append(
        f"{report['tests']} tests; min Holm-adjusted p = {report['min_p_holm']:.3g}; "
        f"{report['verdict']} at alpha = {report['alpha']} after correction"
    )
    return "\n".join(lines)
