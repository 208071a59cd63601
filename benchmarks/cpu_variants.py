"""Each build of the C++ CPU kernels (redwood.cpu_kernels.kquant: avx512, avx2, portable, … — those this CPU runs)
on a real model, side by side in one process: prompt processing (one prefill forward of --prompt tokens) and decode
(--decode one-token forwards after it), at each --threads count, interleaved over --rounds rounds; the median.

The model loads once (its packed weights are the same bytes for every build); REDWOOD_CPU_KERNEL switches the build
between passes (the forwards reach the operators through `kquant.ops()`). Each pass also checks that the build's
logits equal the first build's bit for bit (the variants compute the same bits). `--python-layers` adds a pass
with the C++ layers off (`ExecutionConfig(cpu_fused=False)`: the Python layers around the first build's products),
reported as the build "python" (its logits differ within float32 rounding: not checked).

Usage: PYTHONPATH=src python benchmarks/cpu_variants.py [--model qwen2.5-coder-1.5b-instruct] [--prompt 496]
    [--decode 32] [--threads 1 2] [--rounds 2] [--variants avx512 avx2 portable] [--python-layers] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from redwood import envs
from redwood.config import ExecutionConfig
from redwood.cpu_kernels import kquant
from redwood.loading import load_model


def one_pass(model, ids: torch.Tensor, decode: int) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, decode seconds, the logits of every forward concatenated) of one prefill + decode."""
    P = ids.shape[1]
    with torch.inference_mode():
        cache = model.new_cache(1, P + decode + 1)
        t0 = time.perf_counter()
        # (logits of the last prompt position only, as the engine's prefill asks for: the head is not prompt
        # processing)
        logits = [model(ids, torch.arange(P)[None], cache, logits_at=torch.tensor([[P - 1]]))]
        cache.commit(P)
        t1 = time.perf_counter()
        for i in range(decode):
            nxt = logits[-1].argmax(-1)
            logits.append(model(nxt, torch.tensor([[P + i]]), cache))
            cache.commit(1)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat(logits, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompt", type=int, default=496, help="prompt tokens (one prefill forward)")
    ap.add_argument("--decode", type=int, default=32, help="one-token decode forwards after the prefill")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=None, help="default: every build this CPU runs")
    ap.add_argument("--python-layers", action="store_true", help="also the first build with the C++ layers off")
    ap.add_argument("--json", default=None, help="also write every pass's seconds and the medians here")
    args = ap.parse_args()
    builds = args.variants or [v for v in kquant.supported() if kquant.variant_unavailable(v) is None]
    names = builds + (["python"] if args.python_layers else [])
    model = load_model(args.model, weights="auto").model
    print(f"model {args.model} ({model.weights}); builds {', '.join(names)}; CPU threads {args.threads}")
    ids = torch.randint(100, 20000, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def use(name: str) -> None:  # the build (or the Python layers over the first build) the next pass runs
        os.environ[envs.CPU_KERNEL] = builds[0] if name == "python" else name
        model.set_execution(ExecutionConfig(cpu_fused=name != "python"))

    for name in names:  # warm-up, not timed: a build not yet cached compiles on its first call
        use(name)
        one_pass(model, ids[:, :16], 1)
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    first = None
    for r in range(args.rounds):
        for n in args.threads:
            torch.set_num_threads(n)
            for name in names:
                use(name)
                pre, dec, logits = one_pass(model, ids, args.decode)
                times.setdefault((name, n), []).append((pre, dec))
                if first is None:
                    first = logits
                same = "not checked" if name == "python" else torch.equal(logits, first)
                print(f"round {r} threads {n} {name}: prefill {pre:.2f} s, decode {dec:.2f} s, logits equal: {same}")
    print(f"\n| build | threads | prompt tok/s ({args.prompt}) | decode tok/s ({args.decode}) |\n|---|---|---|---|")
    rows = []
    for n in args.threads:
        for name in names:
            pre = statistics.median(t[0] for t in times[(name, n)])
            dec = statistics.median(t[1] for t in times[(name, n)])
            dec_rate = args.decode / dec if args.decode else None  # (--decode 0: prompt processing alone)
            rows.append(
                {
                    "build": name,
                    "threads": n,
                    "prompt_tok_s": args.prompt / pre,
                    "decode_tok_s": dec_rate,
                    "passes_s": times[(name, n)],
                }
            )
            print(f"| {name} | {n} | {args.prompt / pre:.1f} | {'' if dec_rate is None else f'{dec_rate:.1f}'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "prompt": args.prompt, "decode": args.decode, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
