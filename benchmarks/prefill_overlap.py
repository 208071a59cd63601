"""Does prompt lookup's indexing during prefill hide behind the prefill's forwards? (issue 40, item 3)

In the H100 burst of session 36 (64 × 30,720 essays, prefill first, `--speculative auto`) the last request's
first token came 1.2–1.3 s later than AR's in the same process, in both runs. The executor indexes each
prefill chunk's tokens for prompt lookup after launching the chunk's forwards (`Executor._prefill`,
`DraftlessDrafter.index_prefix`) — hidden only if nothing before it waits for the GPU. This runs an AR engine
and an auto engine (prompt lookup alone) over the same ROWS × CONTEXT random prompts (a Qwen2.5-1.5B-shaped
model with random bf16 weights: no staging), prefill first, 8,192 prefill tokens a step, one new token each,
AR / auto / AR / auto, and prints per run: the wall time until every request had its first token, the host
seconds spent indexing, and how long the GPU still ran after `prefill_rows` returned (≈ 0: it had waited for
the forwards, so the indexing after it was not hidden).

    PYTHONPATH=src:. python benchmarks/prefill_overlap.py [--rows 16] [--context 30720] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from redwood.engine import executor as executor_module
from redwood.engine.engine import Engine
from redwood.sampling_params import SamplingParams
from redwood.speculation.draftless import DraftlessDrafter, NgramDrafter


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=30720)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run with a tiny random model")
    args = ap.parse_args()
    if args.device == "cuda":
        from decode_step import random_model

        model = random_model(True)
    else:
        import tempfile
        from pathlib import Path

        from redwood import LLM
        from tests.conftest import make_tokenizer, save_target_and_draft  # (the test suite's tiny model)

        root = Path(tempfile.mkdtemp())
        save_target_and_draft(root, make_tokenizer(), noise=0.01, max_position_embeddings=args.context + 64)
        model = LLM(str(root / "target")).model
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = []
    for _ in range(args.rows):  # (text that repeats itself now and then, as essays do: the index has work)
        base = [rng.randrange(vocab) for _ in range(600)]
        p: list[int] = []
        while len(p) < args.context:
            p += base if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(300)]
        prompts.append(p[: args.context])

    timers = {"index_s": 0.0, "gpu_after_s": 0.0}
    index_prefix = DraftlessDrafter.index_prefix
    prefill_rows = executor_module.prefill_rows

    def timed_index(self, *a, **k):
        t = time.perf_counter()
        index_prefix(self, *a, **k)
        timers["index_s"] += time.perf_counter() - t

    def timed_prefill(*a, **k):
        out = prefill_rows(*a, **k)
        t = time.perf_counter()
        sync(args.device)
        timers["gpu_after_s"] += time.perf_counter() - t
        return out

    DraftlessDrafter.index_prefix = timed_index
    results = []
    for mode in ["ar", "auto", "ar", "auto"]:
        kw = dict(max_num_seqs=args.rows, max_model_len=args.context + 64, max_num_batched_tokens=args.chunk)
        kw.update(prefill_first=True, cuda_graphs=args.device == "cuda")
        drafters = [NgramDrafter(vocab)] if mode == "auto" else None
        engine = Engine.build(model, None, auto_drafters=drafters, **kw)
        for p in prompts:
            engine.add_request(p, SamplingParams(max_new_tokens=1, ignore_eos=True))
        timers.update(index_s=0.0, gpu_after_s=0.0)
        sync(args.device)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync(args.device)
        wall = time.perf_counter() - t0
        index_s = timers["index_s"]
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        # the GPU's time left after prefill_rows returned: measured in a second pass (its synchronize would
        # itself serialize the indexing behind the forwards in the timed one)
        executor_module.prefill_rows = timed_prefill
        engine2 = Engine.build(model, None, auto_drafters=[NgramDrafter(vocab)] if mode == "auto" else None, **kw)
        for p in prompts[:2]:
            engine2.add_request(p, SamplingParams(max_new_tokens=1, ignore_eos=True))
        timers["gpu_after_s"] = 0.0
        while engine2.has_unfinished():
            engine2.step()
        executor_module.prefill_rows = prefill_rows
        results.append((mode, wall, index_s, timers["gpu_after_s"]))
        del engine2
        gc.collect()
    print(
        f"\n{args.rows} rows × {args.context} tokens, prefill first, {args.chunk} prefill tokens a step, {args.device}"
    )
    print("| run | prefill wall s | indexing s (host) | GPU time left after prefill_rows returned, 2 rows, s |")
    print("|---|---|---|---|")
    for mode, wall, index_s, after in results:
        print(f"| {mode} | {wall:.3f} | {index_s:.3f} | {after:.4f} |")


if __name__ == "__main__":
    main()
