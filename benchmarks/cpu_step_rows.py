"""Session 17 (docs/perf/cpu.md, 'Session 17 (CPU)'): what a forward of T new tokens costs against a one-token
decode step (a γ = T − 1 verify's price), per thread count, for a model as `auto` loads it on this CPU (the 1.5B:
kquant, the 0.5B draft: q4k) — and, with --busy, one-token steps at 1 and 2 threads while another process keeps
one core busy (what the default thread count must survive). Context: a 128-token code prompt.

Usage: PYTHONPATH=src python benchmarks/cpu_step_rows.py [--model NAME] [--draft] [--busy]
Short table last.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from cpu_weights import held_out_texts  # noqa: E402

from redwood.loading import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", action="store_true", help="load as a draft (auto = q4k)")
    ap.add_argument("--busy", action="store_true", help="one-token steps with and without a busy-looping process")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    args = ap.parse_args()
    lm = load_model(args.model, weights="auto", draft=args.draft)
    m = lm.model
    ids = held_out_texts(lm.tokenizer, 200)["code"][:128]

    def prefilled(th):
        torch.set_num_threads(th)
        c = m.new_cache(1, 600)
        m(torch.tensor([ids]), torch.arange(128)[None], c, logits_at=torch.tensor([[127]]))
        c.commit(128)
        return c

    lines = []
    with torch.inference_mode():
        if args.busy:
            for busy in (False, True):
                proc = subprocess.Popen(["sh", "-c", "while :; do :; done"]) if busy else None
                time.sleep(1)
                rate = {}
                for th in (1, 2, 1, 2):
                    c, tok, p = prefilled(th), ids[0], 128
                    t0 = time.perf_counter()
                    for _ in range(12):
                        lg = m(torch.tensor([[tok]]), torch.tensor([[p]]), c)
                        c.commit(1)
                        p, tok = p + 1, int(lg[0, -1].argmax())
                    rate[th] = 12 / (time.perf_counter() - t0)  # (the second of each pair kept)
                if proc:
                    proc.kill()
                lines.append(f"| {'one core busy' if busy else 'idle'} | {rate[1]:.2f} | {rate[2]:.2f} |")
            print("\n| machine | 1 thread tok/s | 2 threads tok/s |\n|---|---|---|\n" + "\n".join(lines))
            return
        for th in (1, 2):
            c = prefilled(th)
            res = []
            for T in args.rows:
                x, pos = torch.tensor([ids[:T]]), torch.arange(128, 128 + T)[None]
                m(x, pos, c)  # (not committed: every repeat writes the same slots)
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    m(x, pos, c)
                    ts.append(time.perf_counter() - t0)
                res.append(sorted(ts)[2] * 1e3)
            lines.append(f"| {th} | " + " | ".join(f"{t:.1f} ({t / res[0]:.2f}×)" for t in res) + " |")
    print(f"\n{args.model} ({m.weights}): ms a forward of T new tokens (× the one-token step), median of 5")
    print("| threads | " + " | ".join(f"T = {T}" for T in args.rows) + " |")
    print("|---" * (len(args.rows) + 1) + "|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
