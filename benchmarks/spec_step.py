"""Cost of one speculative step vs the forwards it contains, on the GPU, with Qwen2.5-Coder-1.5B / 0.5B
shaped models (random bf16 weights: step time does not depend on the weights' values, only how many
tokens a step commits does — so acceptance here is meaningless and not reported).

Usage: PYTHONPATH=src:. python benchmarks/spec_step.py [--context 256] [--trees chain:1 chain:2 ...]
For each draft shape and sampling mode: the engine's ms per step (each step one CUDA graph: every draft
level, the verification forward, sampling and the verifier, then the host's commit), next to the sum of
the forwards it runs (draft levels × a draft forward + one target forward over the tree, each timed alone
as a graph) — the difference is what sampling, verification and bookkeeping cost. Short table last.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.decode_step import QWEN_1_5B, kernel_table, print_kernels, time_step
from redwood.config import ModelConfig
from redwood.engine.engine import Engine
from redwood.engine.runner import StepRunner
from redwood.kv.policies import FullPolicy
from redwood.models.transformer import Transformer, build_model
from redwood.sampling_params import SamplingParams
from redwood.speculation.drafters import ModelDrafter, draft_plan
from redwood.speculation.trees import resolve_tree

QWEN_0_5B = dict(
    QWEN_1_5B,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
)


def random_model(config: dict, seed: int):
    cfg = ModelConfig.from_hf_dict(config)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(seed)
    state = {k: torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for k, s in shapes.items()}
    model = build_model(cfg, state, torch.bfloat16, "cuda")
    model.set_execution()  # the CUDA backend (fused projections, the kernels)
    return model


def run(engine, prompts, temperature, gen_len):
    """(decode seconds, tokens decoded, final stats per request) of one batch through `engine`."""
    params = [
        SamplingParams(temperature=temperature, max_new_tokens=gen_len, ignore_eos=True, seed=b)
        for b in range(len(prompts))
    ]
    for p, q in zip(prompts, params):
        engine.add_request(p, q)
    stats = []
    while engine.has_unfinished():
        stats += [d.stats for d in engine.step() if d.finish_reason is not None]
    return max(s["decode_s"] for s in stats), sum(s["generated_tokens"] - 1 for s in stats), stats


def forward_kernels(label: str, model, batch: int, context: int) -> None:
    """The kernels of one decode forward (eager: each kernel's GPU time is the same inside a graph)."""
    cache = model.new_cache(batch, context + 64)
    cache.lengths.fill_(context)
    ids = torch.randint(0, 1000, (batch, 1), device="cuda")
    pos = cache.lengths[:, None]
    graphed = StepRunner(model, cache, use_graphs=True)
    ms = time_step(lambda: graphed.forward(ids, pos))
    eager = StepRunner(model, cache, use_graphs=False)
    print()
    print_kernels(label, kernel_table(lambda: eager.forward(ids, pos)), ms)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--kernels", action="store_true", help="also list the draft/target forward's kernels")
    ap.add_argument(
        "--trees", nargs="+", default=["chain:1", "chain:2", "chain:3", "chain:4", "generic-16", "generic-64"]
    )
    args = ap.parse_args()
    target, draft = random_model(QWEN_1_5B, 0), random_model(QWEN_0_5B, 1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 150000, (args.batch, args.context), generator=g).tolist()

    # the forwards alone (graphs), after a prefill of `context` tokens
    def forward_ms(model, T, mask=None):
        cache = model.new_cache(args.batch, args.context + 512)
        cache.lengths.fill_(args.context)
        runner = StepRunner(model, cache, use_graphs=True)
        ids = torch.randint(0, 1000, (args.batch, T), device="cuda")
        pos = cache.lengths[:, None] + torch.arange(T, device="cuda")
        return time_step(lambda: runner.forward(ids, pos, new_mask=mask, mask_key=("t", T)))

    rows = []
    knobs = dict(max_num_seqs=args.batch, max_model_len=args.context + args.gen_len + 128, block_size=128)
    ar_engine = Engine.build(target, None, **knobs)
    run(ar_engine, prompts, 0.0, args.gen_len)  # (captures)
    ar_s, ar_n, _ = run(ar_engine, prompts, 0.0, args.gen_len)
    del ar_engine
    ar_ms = 1e3 * ar_s / (ar_n / args.batch)
    d1 = forward_ms(draft, 1)
    rows.append(("autoregressive", "greedy", ar_ms, forward_ms(target, 1), 1))
    for name in args.trees:
        tree = resolve_tree(name)
        levels = len(draft_plan(tree).steps)
        mask = None if tree.is_chain else tree.ancestor_mask("cuda")
        fwd = levels * d1 + forward_ms(target, tree.size, mask)
        for temperature in (0.0, 0.6):
            drafter = ModelDrafter(draft, FullPolicy(), target.config.vocab_size)
            engine = Engine.build(target, None, drafter=drafter, tree=tree, **knobs)
            run(engine, prompts, temperature, 8)  # capture
            s, n, stats = run(engine, prompts, temperature, args.gen_len)
            del engine
            steps = max(st["speculative"]["steps"] for st in stats)
            rows.append((name, "greedy" if temperature == 0 else f"T={temperature}", 1e3 * s / steps, fwd, levels))
            print(rows[-1], flush=True)
    if args.kernels:
        for label, model in (("draft 0.5B", draft), ("target 1.5B", target)):
            forward_kernels(label, model, args.batch, args.context)
    print(
        f"\nbatch {args.batch}, context {args.context}, random Qwen2.5-Coder 1.5B / 0.5B-shaped bf16 models; "
        f"draft forward alone {d1:.3f} ms"
    )
    print(f"{'shape':<16}{'sampling':>9}{'ms/step':>9}{'forwards ms':>13}{'rest ms':>9}{'draft levels':>14}")
    for name, mode, ms, fwd, levels in rows:
        print(f"{name:<16}{mode:>9}{ms:>9.3f}{fwd:>13.3f}{ms - fwd:>9.3f}{levels:>14}")


if __name__ == "__main__":
    main()
