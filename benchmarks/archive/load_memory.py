"""Peak resident memory of loading a model in a CPU weight format (issue 20: packing used to build the whole
float32 model first), and of the forwards after it.

Usage: OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python benchmarks/archive/load_memory.py [--model M] [--weights int8]
    [--draft] [--forward 0]
One load per process (peak RSS is per process: run it once per format). Prints the load's wall time, the
peak RSS during the load (getrusage's ru_maxrss), the RSS after it, the bytes the model holds (parameters
and buffers), and with --forward N the peak and current RSS after a prefill of N tokens and 8 decode steps.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from redwood.loading import load_model


def rss_gib() -> tuple[float, float]:
    """(peak RSS so far, RSS now) of this process in GiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (kB on Linux)
    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return peak / 2**30, now / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--draft", action="store_true", help="load as a draft model (its auto format)")
    ap.add_argument("--forward", type=int, default=0, metavar="N", help="then prefill N tokens and decode 8")
    args = ap.parse_args()
    t = time.perf_counter()
    loaded = load_model(args.model, weights=args.weights, **({"draft": True} if args.draft else {}))
    out = {"model": args.model, "weights": loaded.model.weights, "load_s": round(time.perf_counter() - t, 1)}
    out["load_peak_gib"], out["after_load_gib"] = (round(x, 2) for x in rss_gib())
    model = loaded.model
    held = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    out["model_gib"] = round(held / 2**30, 2)
    if args.forward:
        n = args.forward
        cache = model.new_cache(1, n + 9)
        with torch.inference_mode():
            ids = torch.randint(3, 1000, (1, n))
            logits = model(ids, torch.arange(n)[None], cache, logits_at=torch.tensor([[n - 1]]))
            cache.commit(n)
            for i in range(8):
                tok = logits[:, -1:].argmax(-1)
                logits = model(tok, torch.tensor([[n + i]]), cache)
                cache.commit(1)
        out["forward_peak_gib"], out["after_forward_gib"] = (round(x, 2) for x in rss_gib())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
