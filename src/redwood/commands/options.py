"""The flag groups commands share: model (--model/--dtype/--device), engine (scheduling and KV memory),
offloading, sampling, and speculation (`add_speculative_args` + `speculative_config_from_args`)."""

from __future__ import annotations

import argparse

from redwood.llm import DEFAULT_MODEL
from redwood.speculation.config import MAX_DRAFT_DEPTH, check_draft_tree
from redwood.speculation.draftless import DEFAULT_MAX_N, DEFAULT_MIN_N


def add_model_args(p: argparse.ArgumentParser, tensor_parallel: bool = False) -> None:
    """--model / --dtype / --device, shared by every command that loads a model; tensor_parallel: also
    --tensor-parallel-size (the commands that drive one engine through `LLM` / `Engine.from_pretrained`)."""
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"zoo name, Hugging Face folder or .gguf file (default: {DEFAULT_MODEL})"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    add_weights_arg(p)
    add_graphs_arg(p)
    add_threads_arg(p)
    add_execution_args(p)
    add_quiet_arg(p)
    if tensor_parallel:
        add_tensor_parallel_arg(p)


def add_execution_args(p: argparse.ArgumentParser) -> None:
    """The `ExecutionConfig` switches users may want (A/B measurements; the defaults take the fastest path):
    --megakernel, --no-prefill-kernel, --no-cpu-fused, --no-adaptive-threads (`execution_kwargs`)."""
    g = p.add_argument_group("execution (how forwards run; every choice computes the same model)")
    g.add_argument(
        "--megakernel",
        default="auto",
        choices=["auto", "on", "off"],
        help="one-token one-row CUDA forwards as one persistent kernel: auto (where the model fits), "
        "on (an error where it does not), off",
    )
    g.add_argument(
        "--no-prefill-kernel",
        dest="prefill_kernel",
        action="store_false",
        help="long CUDA prefill chunks attend through the reference path, not the flash prefill kernel",
    )
    g.add_argument(
        "--no-cpu-fused",
        dest="cpu_fused",
        action="store_false",
        help="kquant / q4k CPU models keep the Python layers (not one C++ call a layer)",
    )
    g.add_argument(
        "--no-adaptive-threads",
        dest="adaptive_threads",
        action="store_false",
        help="on a small CPU machine, decode steps keep the default thread count (no timing of 1 vs 2)",
    )


def execution_kwargs(args) -> dict:
    """LLM(...) / Engine(...) keyword for the execution flags ({} where all are defaults)."""
    from redwood.config import ExecutionConfig

    execution = ExecutionConfig(
        megakernel=getattr(args, "megakernel", "auto"),
        prefill_kernel=getattr(args, "prefill_kernel", True),
        cpu_fused=getattr(args, "cpu_fused", True),
        adaptive_threads=getattr(args, "adaptive_threads", True),
    )
    return {} if execution == ExecutionConfig() else {"execution": execution}


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    """-q / --quiet: no progress on stderr (the CLI calls `redwood.progress.set_quiet`)."""
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress on stderr (model loading, long prefills); errors still print",
    )


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """--threads N (args.threads, default None: OMP_NUM_THREADS when set, else the measured default)."""
    from redwood.engine.threads import SMALL_MACHINE_CORES

    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help=f"CPU threads for torch's kernels (default: OMP_NUM_THREADS when set, else 1 on a "
        f"machine of <= {SMALL_MACHINE_CORES} cores — where decode steps of kquant / q4k models "
        f"pick 1 or {SMALL_MACHINE_CORES} by timing both as they run (--no-adaptive-threads: off) "
        f"— torch's default, its physical cores, above that)",
    )


def threads_kwargs(args) -> dict:
    """LLM(...) / Engine(...) keyword for --threads (a one-line error for a bad value, before loading)."""
    from redwood.engine.threads import check_threads
    from redwood.errors import ConfigError

    threads = getattr(args, "threads", None)
    try:
        check_threads(threads)
    except ConfigError:
        raise ConfigError(f"--threads must be a positive integer, got {threads}") from None
    return {} if threads is None else {"threads": threads}


def apply_threads_arg(args) -> int:
    """For commands that load models themselves (not through LLM / Engine): set torch's threads per
    --threads now (see `redwood.engine.threads`); → the count in effect."""
    import torch

    from redwood.engine.threads import apply_threads

    threads = threads_kwargs(args).get("threads")
    if threads is None and not str(getattr(args, "device", "cpu")).startswith("cpu"):
        return torch.get_num_threads()  # (as Engine: on CUDA only an explicit count is set)
    return apply_threads(threads)


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    """--weights (args.weights): the CPU weight format of the target (`redwood.models.cpu_weights`)."""
    from redwood.models.cpu_weights import GGUF_DEFAULT, GGUF_FALLBACK, W8A8_DEFAULT, WEIGHT_CHOICES

    p.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHT_CHOICES,
        help=f"CPU weight format of the target's projections (default auto: for a .gguf model "
        f"{GGUF_DEFAULT} — the file's Q4_K/Q6_K/Q8_0/Q5_0 blocks times int8 activations — on a "
        f"CPU with a C++ compiler (REDWOOD_CPU_KERNEL: which build), else {W8A8_DEFAULT} where its int8 sums are "
        f"exact, else {GGUF_FALLBACK}; float32 for other checkpoints; CUDA keeps --dtype; a draft "
        f"model's: --draft-weights)",
    )


def add_draft_weights_arg(p) -> None:
    """--draft-weights (args.draft_weights, default None = auto): the weight format of a draft model
    (`SpeculativeConfig.draft_weights`); for every command that takes --weights and --draft-model (checked
    by `check_draft_weights_arg`)."""
    from redwood.models.cpu_weights import DRAFT_GGUF_DEFAULT, DRAFT_GGUF_FALLBACK, W8A8_DEFAULT, WEIGHT_CHOICES

    p.add_argument(
        "--draft-weights",
        default=None,
        choices=WEIGHT_CHOICES,
        help=f"weight format of the draft model's projections. On the CPU any CPU format (default "
        f"auto: {DRAFT_GGUF_DEFAULT} — re-quantized to Q4_K — for a .gguf draft where kquant "
        f"runs, else {W8A8_DEFAULT} on an AVX512-VNNI CPU, else {DRAFT_GGUF_FALLBACK} — the "
        f"fastest speculation measured — and float32 for other checkpoints). On CUDA auto / "
        f"float32 (--dtype) or int8: int8 copies of its weights for the one-token draft "
        f"forwards (half the bytes per draft step). The output is the target's whatever the "
        f"draft's format; only acceptance and speed move",
    )


def check_draft_weights_arg(args, default_draft: bool = False) -> None:
    """One-line errors (ConfigError) for --draft-weights without a draft model (`default_draft`: the
    command drafts with its default draft model then), with self-speculation, or a CPU format on CUDA —
    before any model loads."""
    from redwood.errors import ConfigError
    from redwood.models.cpu_weights import CUDA_DRAFT_WEIGHTS

    weights = getattr(args, "draft_weights", None)
    if weights is None:
        return
    if getattr(args, "self_speculate", False):
        raise ConfigError(
            "--draft-weights applies to a --draft-model; self-speculation drafts with the target's weights (--weights)"
        )
    if not getattr(args, "draft_model", None) and not default_draft:
        raise ConfigError("--draft-weights only applies with --draft-model M")
    if weights not in CUDA_DRAFT_WEIGHTS and not str(getattr(args, "device", "cpu")).startswith("cpu"):
        raise ConfigError(
            f"--draft-weights {weights} is a CPU format; on CUDA the draft takes auto or float32 "
            f"(--dtype) or int8 (int8 copies for its one-token forwards)"
        )


def add_graphs_arg(p: argparse.ArgumentParser) -> None:
    """--no-cuda-graphs (args.cuda_graphs, default True)."""
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, launch every step's kernels eagerly instead of replaying captured CUDA graphs",
    )


def graphs_kwargs(args) -> dict:
    """LLM(...) keyword for --no-cuda-graphs (default: graphs wherever they apply)."""
    return {} if getattr(args, "cuda_graphs", True) else {"cuda_graphs": False}


def add_offload_args(p: argparse.ArgumentParser) -> None:
    """--offload / --offload-prefetch N: stream the target's layer weights from host memory."""
    p.add_argument(
        "--offload",
        action="store_true",
        help="keep the target's layer weights in pinned host memory and stream them to the device",
    )
    p.add_argument(
        "--offload-prefetch",
        type=int,
        default=None,
        metavar="N",
        help="with --offload: layers held on the device at a time, copied ahead (default 2)",
    )


def offload_kwargs(args) -> dict:
    """LLM(...) keyword arguments from the offload flags (ConfigError for bad values)."""
    from redwood.errors import ConfigError
    from redwood.models.offload import check_prefetch

    if args.offload_prefetch is not None and not args.offload:
        raise ConfigError("--offload-prefetch only applies with --offload")
    prefetch = 2 if args.offload_prefetch is None else args.offload_prefetch
    return {"offload": args.offload, "offload_prefetch": check_prefetch(prefetch)}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def sampling_params_from_args(args):
    from redwood.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


DRAFT_KV_CHOICES = ("full", "streaming", "snapkv")
VERIFIER_CHOICES = ("auto", "greedy", "sampling", "sequoia", "specinfer", "topk", "match")
DEFAULT_GAMMA = 4
DEFAULT_POOL_KERNEL = 5


def add_draft_cache_args(g) -> None:
    """--draft-kv / --draft-budget / --sinks / --window / --pool-kernel: which committed tokens the draft
    reads (a parser or argument group `g`; checked by `check_draft_cache_args`)."""
    g.add_argument(
        "--draft-kv",
        default=None,
        metavar="{full,streaming,snapkv}",
        help="which committed tokens the draft reads: the full cache (default), StreamingLLM "
        "(sinks + recent window) or SnapKV (prefill-selected positions + recent tokens)",
    )
    g.add_argument(
        "--draft-budget",
        type=int,
        default=None,
        metavar="N",
        help="draft KV budget in tokens (streaming: sinks + window; snapkv: required)",
    )
    g.add_argument("--sinks", type=int, default=None, metavar="N", help="streaming: attention sinks kept (default 4)")
    g.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help="streaming: recent window (default budget - sinks); snapkv: observation window (default 32)",
    )
    g.add_argument(
        "--pool-kernel",
        type=int,
        default=None,
        metavar="K",
        help=f"snapkv: pooling kernel over the scores, odd (default {DEFAULT_POOL_KERNEL})",
    )


def add_draft_kv_args(p: argparse.ArgumentParser, sweep: bool = False, tree: bool = False) -> None:
    """--draft-kv / --draft-budget / --sinks / --window / --pool-kernel / --gamma / --verifier.

    Choices are checked by `speculative_config_from_args` (one-line errors, exit status 2), not by argparse.
    sweep: --gamma takes several values (benchmarks run one configuration per value).
    tree: also --tree (a token tree instead of a chain of --gamma drafts).
    """
    g = p.add_argument_group("speculation")
    add_draft_cache_args(g)
    if sweep:
        g.add_argument(
            "--gamma",
            type=int,
            nargs="+",
            default=None,
            metavar="G",
            help=f"draft tokens per step; several values sweep (default {DEFAULT_GAMMA})",
        )
    else:
        g.add_argument(
            "--gamma", type=int, default=None, metavar="G", help=f"draft tokens per step (default {DEFAULT_GAMMA})"
        )
    g.add_argument(
        "--verifier",
        default=None,
        metavar="{" + ",".join(VERIFIER_CHOICES) + "}",
        help="greedy (temperature 0 only), sampling (rejection sampling; Sequoia's on a tree), "
        "sequoia (children drawn without replacement), specinfer (with replacement), topk "
        "(the draft's top children; the target samples), match (drafts accepted while they equal the "
        "target's own seeded draws: a seed gives the same tokens as without speculation) or auto "
        "(default: greedy when every request is greedy, else sampling)",
    )
    if tree:
        g.add_argument(
            "--tree",
            default=None,
            metavar="FILE.json|chain:G|chains:KxL|NAME",
            help="speculate over a token tree instead of a chain of --gamma drafts: a tree file "
            "(`redwood tree-search`), chain:G, K independent chains of L tokens (chains:KxL) "
            "or a shipped tree (generic-16, generic-64)",
        )


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """--draft-model M | --self-speculate | --draft ngram|suffix, plus the draft KV / γ / verifier flags."""
    p.add_argument(
        "--draft-model", default=None, metavar="M", help="speculate with this draft model (same tokenizer as --model)"
    )
    p.add_argument(
        "--self-speculate",
        action="store_true",
        help="speculate with the target itself reading a compressed view of its KV cache",
    )
    p.add_argument(
        "--draft",
        default=None,
        choices=["ngram", "suffix"],
        help="a draftless drafter (no draft forward): ngram proposes the tokens that followed the latest earlier "
        "occurrence of the request's last --ngram-max … --ngram-min tokens in its prompt and output (prompt "
        "lookup, a chain of --gamma); suffix proposes a token tree of the continuations seen after them, the "
        "most frequent first (--tree, default an 8-node tree; --gamma G: a chain; verified by greedy / topk)",
    )
    p.add_argument(
        "--suffix-shared",
        action="store_true",
        default=None,
        help="--draft suffix also looks up the tokens of recent requests (a bounded shared index)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        choices=["fixed", "auto"],
        help="auto: plan every step — plain decoding, or a chain of 1-8 drafts from --draft-model / "
        "--self-speculate (if given) or the draftless ngram drafter — from measured step costs and live "
        "acceptance, so speculation never runs slower than plain decoding (a one-time calibration per setup, "
        "cached; `redwood profile --for-policy` runs it ahead) — the default whenever --draft-model, "
        "--self-speculate or --draft ngram is given without --gamma / --tree. fixed: every step as the flags say "
        "(γ 4 unless --gamma); --gamma / --tree pin a fixed plan",
    )
    p.add_argument(
        "--acceptance",
        default=None,
        metavar="FILE",
        help="with --speculative auto: start the model drafter's live acceptance from this `redwood acceptance` "
        "file (else from a flat guess; either way it learns from every verified step)",
    )
    p.add_argument("--ngram-min", type=int, default=None, metavar="N", help="shortest match (default 2)")
    p.add_argument("--ngram-max", type=int, default=None, metavar="N", help="longest match tried first (default 4)")
    add_draft_weights_arg(p)
    p.add_argument(
        "--draft-tensor-parallel",
        default=None,
        metavar="shard|replicate|K",
        help="with --tensor-parallel-size: shard the draft model over the ranks (default; its all-reduces in every "
        "draft level), replicate it whole on every rank (no collectives), or shard it over ranks 0 … K-1 only "
        "(K below the tensor-parallel size; 1: whole on rank 0) while the other ranks skip the draft; placed other "
        "than shard, rank 0's draft tokens are broadcast",
    )
    add_draft_kv_args(p, tree=True)


_SPEC_FLAGS = (
    "suffix_shared",
    "ngram_min",
    "ngram_max",
    "draft_kv",
    "draft_budget",
    "sinks",
    "window",
    "pool_kernel",
    "gamma",
    "tree",
    "verifier",
    "draft_weights",
    "draft_tensor_parallel",
)


def draft_placement_arg(args) -> str | int:
    """--draft-tensor-parallel as `SpeculativeConfig.draft_tensor_parallel` takes it: "shard" (the default),
    "replicate", or a number of ranks (checked there: one line for a bad value)."""
    value = getattr(args, "draft_tensor_parallel", None) or "shard"
    return int(value) if value.lstrip("+-").isdigit() else value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_draft_cache_args(args) -> None:
    """One-line errors (ConfigError) for bad --draft-kv / --draft-budget / --sinks / --window /
    --pool-kernel values, before any model loads."""
    from redwood.errors import ConfigError

    if args.draft_kv is not None and args.draft_kv not in DRAFT_KV_CHOICES:
        raise ConfigError(f"--draft-kv must be one of {', '.join(DRAFT_KV_CHOICES)}, got {args.draft_kv!r}")
    for name in ("draft_budget", "window", "pool_kernel"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"{_flag(name)} must be >= 1, got {v}")
    if args.sinks is not None and args.sinks < 0:
        raise ConfigError(f"--sinks must be >= 0, got {args.sinks}")
    if args.pool_kernel is not None and args.pool_kernel % 2 == 0:
        raise ConfigError(f"--pool-kernel must be odd, got {args.pool_kernel}")
    budget = args.draft_budget
    if args.draft_kv == "streaming" and budget is not None:
        sinks = 4 if args.sinks is None else args.sinks
        if budget <= sinks:
            raise ConfigError(
                f"--draft-budget ({budget}) must be larger than --sinks ({sinks}): the streaming "
                f"draft cache holds the sinks plus a recent window of at least one token"
            )
    if args.draft_kv == "snapkv" and budget is not None:
        window = 32 if args.window is None else args.window
        if budget < window:
            raise ConfigError(
                f"--draft-budget ({budget}) must be at least the snapkv observation --window "
                f"({window}{'' if args.window is not None else ', the default'})"
            )


def check_draft_kv_args(args) -> None:
    """One-line errors (ConfigError) for bad draft KV / γ / verifier values, before any model loads."""
    from redwood.errors import ConfigError

    if args.verifier is not None and args.verifier not in VERIFIER_CHOICES:
        raise ConfigError(f"--verifier must be one of {', '.join(VERIFIER_CHOICES)}, got {args.verifier!r}")
    gammas = args.gamma if isinstance(args.gamma, list) else [args.gamma]
    for gamma in gammas:
        if gamma is not None and gamma < 1:
            raise ConfigError(f"--gamma must be >= 1 (draft tokens per step), got {gamma}")
        if gamma is not None and gamma > MAX_DRAFT_DEPTH:
            raise ConfigError(
                f"--gamma must be at most {MAX_DRAFT_DEPTH} (a longer chain is almost never accepted "
                f"whole, and every draft token costs a draft forward), got {gamma}"
            )
    check_draft_cache_args(args)
    if args.verifier == "greedy" and getattr(args, "temperature", 0) > 0:
        raise ConfigError("--verifier greedy is lossless only at --temperature 0; use --verifier sampling (or auto)")
    check_tree_arg(args)


def check_tree_arg(args):
    """The tree --tree names (None without --tree); a ConfigError for a bad spec or one that contradicts
    --gamma (both may be given only when the tree is a chain of that many draft tokens)."""
    from redwood.errors import ConfigError
    from redwood.speculation.trees import resolve_tree

    spec = getattr(args, "tree", None)
    if spec is None:
        return None
    try:
        tree = resolve_tree(spec)
        check_draft_tree(tree, spec)
    except ConfigError as e:
        raise ConfigError(f"--tree: {e}") from None
    gammas = args.gamma if isinstance(args.gamma, list) else [args.gamma]
    for gamma in gammas:
        if gamma is not None and not (tree.is_chain and tree.size - 1 == gamma):
            shape = (
                f"a chain of {tree.size - 1} draft tokens"
                if tree.is_chain
                else f"a tree of {tree.size} nodes, {tree.max_depth} levels"
            )
            raise ConfigError(
                f"--tree {spec} ({shape}) contradicts --gamma {gamma}: a tree sets the drafts per "
                f"step itself; drop --gamma (or use --tree chain:{gamma})"
            )
    return tree


def make_speculative_config(
    args,
    *,
    draft_model: str | None = None,
    self_speculate: bool = False,
    gamma: int | None = None,
    draftless: str | None = None,
):
    """A SpeculativeConfig from the draft KV / verifier flags in `args` (γ given or from --gamma)."""
    from redwood.speculation.config import SpeculativeConfig

    if gamma is None:
        gamma = args.gamma[0] if isinstance(args.gamma, list) else args.gamma
    tree = getattr(args, "tree", None)
    if draftless == "suffix" and gamma is not None and tree is None:
        tree = f"chain:{gamma}"  # (--gamma with the tree drafter: a chain of that many)
    return SpeculativeConfig(
        draft_model=draft_model,
        self_speculate=self_speculate,
        draft_kv=args.draft_kv or "full",
        draft_budget=args.draft_budget,
        sinks=args.sinks,
        window=args.window,
        pool_kernel=DEFAULT_POOL_KERNEL if args.pool_kernel is None else args.pool_kernel,
        num_draft_tokens=DEFAULT_GAMMA if gamma is None else gamma,
        tree=tree,
        verifier=args.verifier or "auto",
        draft_weights=getattr(args, "draft_weights", None) or "auto",
        draftless=draftless,
        ngram_min=getattr(args, "ngram_min", None) or DEFAULT_MIN_N,
        ngram_max=getattr(args, "ngram_max", None) or DEFAULT_MAX_N,
        suffix_shared=bool(getattr(args, "suffix_shared", None)),
        draft_tensor_parallel=draft_placement_arg(args),
    )


def _auto_config(args, draftless: str | None):
    """--speculative auto: the model drafter (optional) and the draftless one the policy plans between."""
    from redwood.errors import ConfigError
    from redwood.speculation.config import SpeculativeConfig

    if args.draft_model and args.self_speculate:
        raise ConfigError("--speculative auto takes one model drafter: --draft-model M or --self-speculate")
    given = (("--gamma", args.gamma not in (None, [])), ("--tree", getattr(args, "tree", None) is not None))
    pinned = [flag for flag, on in given if on]
    if pinned:
        raise ConfigError(
            f"{pinned[0]} pins a fixed plan; --speculative auto chooses γ per step (drop {pinned[0]}, or "
            f"--speculative auto)"
        )
    check_draft_cache_args(args)
    if args.draft_model:
        check_draft_weights_arg(args)
    return SpeculativeConfig(
        draft_model=args.draft_model or None,
        self_speculate=bool(args.self_speculate),
        draft_kv=args.draft_kv or "full",
        draft_budget=args.draft_budget,
        sinks=args.sinks,
        window=args.window,
        pool_kernel=DEFAULT_POOL_KERNEL if args.pool_kernel is None else args.pool_kernel,
        verifier=args.verifier or "auto",
        draft_weights=getattr(args, "draft_weights", None) or "auto",
        draftless=draftless,
        ngram_min=getattr(args, "ngram_min", None) or DEFAULT_MIN_N,
        ngram_max=getattr(args, "ngram_max", None) or DEFAULT_MAX_N,
        policy="auto",
        acceptance_file=getattr(args, "acceptance", None),
        suffix_shared=bool(getattr(args, "suffix_shared", None)),
        draft_tensor_parallel=draft_placement_arg(args),
    )


def _auto_by_default(args, draftless: str | None) -> bool:
    """With no --speculative: the automatic policy whenever a drafter is given — a draft model, self-speculation
    or prompt lookup (`--draft ngram`) — and no --gamma / --tree pins a fixed plan. Measured no worse than the best
    fixed choice (issue 37's grids: CPU and GPU), so a user who turns speculation on is not made slower by it. The
    suffix drafter keeps its fixed token tree (the policy plans chains). Called once `_check_drafter_flags` found
    exactly one drafter."""
    return draftless in (None, "ngram") and args.gamma in (None, []) and getattr(args, "tree", None) is None


def _check_drafter_flags(args, draftless: str | None) -> bool:
    """The drafter flags' one-line errors (one drafter at most; flags that need one); → whether one is given."""
    from redwood.errors import ConfigError

    chosen = [
        f
        for f, on in (
            ("--draft-model", args.draft_model),
            ("--self-speculate", args.self_speculate),
            ("--draft", draftless),
        )
        if on
    ]
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)} are mutually exclusive; pick one drafter")
    check_draft_kv_args(args)
    if args.draft_model or args.self_speculate or draftless:
        check_draft_weights_arg(args)
    if not chosen:
        given = [_flag(n) for n in _SPEC_FLAGS if getattr(args, n, None) is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} when speculating: "
                f"add --draft-model M, --self-speculate or --draft ngram"
            )
        return False
    if not draftless and (getattr(args, "ngram_min", None) is not None or getattr(args, "ngram_max", None) is not None):
        raise ConfigError("--ngram-min / --ngram-max apply to --draft ngram / suffix")
    if getattr(args, "suffix_shared", None) and draftless != "suffix":
        raise ConfigError("--suffix-shared applies to --draft suffix")
    return True


def speculative_config_from_args(args):
    """The SpeculativeConfig the flags ask for, or None (no --draft-model / --self-speculate / --draft).

    Raises ConfigError for conflicting or bad values — call it before loading any model.
    """
    from redwood.errors import ConfigError

    draftless = getattr(args, "draft", None)
    mode = getattr(args, "speculative", None)
    if mode == "auto":
        return _auto_config(args, draftless)
    speculating = _check_drafter_flags(args, draftless)
    if speculating and mode is None and _auto_by_default(args, draftless):
        return _auto_config(args, draftless)
    if getattr(args, "acceptance", None) is not None:
        raise ConfigError("--acceptance seeds the automatic policy: drop --gamma / --tree (or give --speculative auto)")
    if not speculating:
        return None
    return make_speculative_config(
        args, draft_model=args.draft_model or None, self_speculate=bool(args.self_speculate), draftless=draftless
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The Engine's scheduling and memory knobs (redwood.Engine): --max-num-seqs, --max-model-len,
    --block-size, --max-num-batched-tokens, --kv-cache-memory, --enable-prefix-caching."""
    from redwood.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

    g = p.add_argument_group("engine")
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help=f"requests generating at once (batch slots; default {DEFAULT_MAX_NUM_SEQS})",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="prompt + output tokens per request (default: the model's context)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens per KV-cache page (default {DEFAULT_BLOCK_SIZE})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"prefill tokens per step: longer prompts prefill in chunks beside the decoding rows "
        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="memory for the KV pages in GiB (default: 90%% of the free GPU memory after loading; 4 on the CPU)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="share the KV blocks of identical prompt prefixes across requests",
    )
    g.add_argument(
        "--prefill-first",
        action="store_true",
        help="while prompts wait to be prefilled, run their prefill alone and let the decoding rows wait "
        "(SGLang's order; default: both in every step, as vLLM): a burst finishes sooner, its early rows' "
        "inter-token latency grows while it prefills",
    )


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size N (args.tensor_parallel_size; `load_kwargs` passes it on)."""
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="shard the models over N ranks: redwood spawns them (gloo on the CPU, NCCL on CUDA; float weights); "
        "under `torchrun --nproc_per_node N -m redwood …` N is torchrun's",
    )


def engine_kwargs(args) -> dict:
    """LLM(...) / Engine(...) keywords from the engine flags that were given."""
    names = ("max_num_seqs", "max_model_len", "block_size", "max_num_batched_tokens", "kv_cache_memory")
    out = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for flag in ("enable_prefix_caching", "prefill_first"):
        if getattr(args, flag, False):
            out[flag] = True
    return out


def load_kwargs(args) -> dict:
    """LLM(...) / Engine.from_pretrained(...) keywords from the flags every model-loading command shares:
    --dtype, --device, --weights, --no-cuda-graphs, --threads, the execution flags and, where the command has
    them, the offload flags and --tensor-parallel-size (ConfigError for bad values, before any weights load)."""
    offload = offload_kwargs(args) if hasattr(args, "offload") else {}
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and tp < 1:
        from redwood.errors import ConfigError

        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {tp}")
    return {
        **({} if tp is None else {"tensor_parallel_size": tp}),
        "dtype": args.dtype,
        "device": args.device,
        "weights": args.weights,
        **offload,
        **graphs_kwargs(args),
        **threads_kwargs(args),
        **execution_kwargs(args),
    }


def llm_from_args(args, model=None, **kwargs):
    """The LLM of `model` (default --model; a `ModelInfo` already inspected is reused) loaded as the command's
    flags say (`load_kwargs`); `kwargs` add the rest (speculative=..., engine settings)."""
    from redwood.llm import LLM

    return LLM(args.model if model is None else model, **load_kwargs(args), **kwargs)
