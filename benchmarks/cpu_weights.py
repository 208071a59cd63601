"""CPU weight formats side by side in one process (issue 20 item 1): for each model and each format of
`Transformer.quantize_cpu` — perplexity on held-out text, greedy agreement with float32, plain-decoding
tokens/s and the bytes a decode step reads against this machine's copy bandwidth.

Usage: PYTHONPATH=src python benchmarks/cpu_weights.py [--models qwen2.5-coder-1.5b-instruct ...]
    [--formats float32 bfloat16 int8 int4 gguf] [--threads 1 2] [--rounds 2] [--ppl-tokens 512]
    [--new-tokens 32] [--prompt-tokens 128]
Held-out text: HumanEval problems 100+ (prompt + canonical solution, code) and, when the `essays` dataset is
fetched, a window of the Paul Graham essays (prose). The model is loaded once in float32; each format is a
deep copy quantized from it (no calibration data), except "gguf" (the file's own 4-bit grid: loaded from the
file again in that format). Perplexity runs at the largest --threads; the decode (greedy, from the same
prompt) at each --threads count, interleaved over --rounds rounds (1, 2, 1, 2, …), the median step of each
count over all its rounds; "greedy = 1t" says whether every thread count's tokens equal the first's.
Short table last.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch

from redwood.bench.ar import copy_bandwidth, weight_bytes
from redwood.data import recipes
from redwood.loading import load_model
from redwood.models.cpu_weights import FILE_FORMATS, WEIGHT_FORMATS


def held_out_texts(tok, n: int) -> dict[str, list[int]]:
    docs = recipes.load_dataset("humaneval")
    code = "\n\n".join(d["prompt"] + d["canonical_solution"] for d in docs[100:])
    texts = {"code": tok.encode(code)[:n]}
    if recipes.is_fetched("essays"):
        essay = recipes.load_dataset("essays", fetch_missing=False)[0]["text"]
        texts["essay"] = tok.encode(essay[200_000:260_000])[:n]
    return texts


@torch.inference_mode()
def perplexity(model, ids: list[int], chunk: int = 128) -> float:
    """exp(mean NLL) of ids[1:] given the prefix, fed in prefill chunks of `chunk` tokens."""
    cache = model.new_cache(1, len(ids) + 1)
    nll, count = 0.0, 0
    x = torch.tensor([ids])
    for s in range(0, len(ids) - 1, chunk):
        e = min(s + chunk, len(ids) - 1)
        logits = model(x[:, s:e], torch.arange(s, e)[None], cache)
        cache.commit(e - s)
        nll += torch.nn.functional.cross_entropy(logits[0], x[0, s + 1 : e + 1], reduction="sum").item()
        count += e - s
    return math.exp(nll / count)


@torch.inference_mode()
def greedy_decode(model, prompt: list[int], new: int) -> tuple[list[int], float, list[float]]:
    """Greedy tokens, prefill seconds and the seconds of each decode step (batch 1)."""
    cache = model.new_cache(1, len(prompt) + new + 1)
    t = time.perf_counter()
    logits = model(
        torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, logits_at=torch.tensor([[len(prompt) - 1]])
    )
    cache.commit(len(prompt))
    prefill = time.perf_counter() - t
    out, steps = [int(logits[0, -1].argmax())], []
    for i in range(new - 1):
        t = time.perf_counter()
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + i]]), cache)
        cache.commit(1)
        out.append(int(logits[0, -1].argmax()))
        steps.append(time.perf_counter() - t)
    return out, prefill, steps


def formats(base, kinds, name):
    """(kind, model) per format: float32 is `base` itself, the others quantized copies of it. The copies
    share base's parameters (quantize_cpu replaces modules, it never writes a weight), so one format at a
    time costs only its packed bytes next to base: a 1.5B's second float32 copy (6.2 GB) ran out of memory."""
    for kind in kinds:
        if kind == "float32":
            yield kind, base
        elif kind in FILE_FORMATS:  # (chosen per tensor as the file loads)
            t = time.perf_counter()
            m = load_model(name, dtype="float32", weights=kind).model
            print(f"  load {kind}: {time.perf_counter() - t:.1f} s", flush=True)
            yield kind, m
            del m
        else:
            m = copy.deepcopy(base, memo={id(p): p for p in base.parameters()})
            t = time.perf_counter()
            m.quantize_cpu(kind)
            print(f"  quantize {kind}: {time.perf_counter() - t:.1f} s", flush=True)
            yield kind, m
            del m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument(
        "--formats", nargs="+", default=list(WEIGHT_FORMATS) + list(FILE_FORMATS), choices=WEIGHT_FORMATS + FILE_FORMATS
    )
    ap.add_argument("--threads", nargs="+", type=int, default=[torch.get_num_threads()])
    ap.add_argument("--rounds", type=int, default=1, help="decode passes per thread count, interleaved")
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cpu"), repeats=5) / 1e9  # GB/s, bytes read + written
    print(f"threads {torch.get_num_threads()}, copy bandwidth {bw:.1f} GB/s", flush=True)
    rows = []
    for name in args.models:
        t = time.perf_counter()
        loaded = load_model(name, dtype="float32")
        print(f"{name}: loaded in {time.perf_counter() - t:.0f} s", flush=True)
        texts = held_out_texts(loaded.tokenizer, args.ppl_tokens)
        prompt = texts["code"][: args.prompt_tokens]
        ref = ref_kind = None  # (the first format's greedy tokens: float32's where it is listed first)
        for kind, model in formats(loaded.model, args.formats, name):
            torch.set_num_threads(max(args.threads))
            ppl = {k: perplexity(model, ids) for k, ids in texts.items()}
            steps, prefills, outs = {n: [] for n in args.threads}, {n: [] for n in args.threads}, {}
            for _ in range(args.rounds):
                for n in args.threads:
                    torch.set_num_threads(n)
                    toks, prefill, st = greedy_decode(model, prompt, args.new_tokens)
                    steps[n] += st
                    prefills[n].append(prefill)
                    outs.setdefault(n, toks)
                    same_threads = all(o == outs[args.threads[0]] for o in outs.values()) and toks == outs[n]
            toks = outs[args.threads[0]]
            ref, ref_kind = ref or toks, ref_kind or kind
            agree = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
            nbytes = weight_bytes(model)
            step = {n: statistics.median(v) for n, v in steps.items()}
            prefill = {n: min(v) for n, v in prefills.items()}
            row = (name, kind, nbytes / 1e9, ppl, step, nbytes / 1e9 / bw, agree, prefill, same_threads)
            rows.append(row)
            print(
                f"  {kind:9s} {nbytes / 1e9:5.2f} GB/step  ppl "
                + " ".join(f"{k} {v:.3f}" for k, v in ppl.items())
                + "  decode "
                + ", ".join(f"{n}t {1 / step[n]:5.2f} tok/s ({step[n] * 1e3:.0f} ms)" for n in args.threads)
                + f" (floor {nbytes / 1e9 / bw * 1e3:.0f} ms)  prefill {args.prompt_tokens} tok "
                + ", ".join(f"{n}t {prefill[n]:.1f} s" for n in args.threads)
                + f"  greedy = {ref_kind} for {agree}/{len(ref)}, = across threads {same_threads}",
                flush=True,
            )
            del model
        del loaded
    threads = " | ".join(f"decode tok/s {n}t (ms)" for n in args.threads)
    print(
        f"\n| model | weights | GB/step | ppl | {threads} | floor ms at {bw:.1f} GB/s | "
        f"prefill {args.prompt_tokens} s | greedy = first format's | = across threads |"
    )
    print("|---|---|---|---|" + "---|" * len(args.threads) + "---|---|---|---|")
    for name, kind, gb, ppl, step, floor, agree, prefill, same in rows:
        p = " / ".join(f"{k} {v:.3f}" for k, v in ppl.items())
        t = " | ".join(f"{1 / step[n]:.2f} ({step[n] * 1e3:.0f})" for n in args.threads)
        print(
            f"| {name} | {kind} | {gb:.2f} | {p} | {t} | {floor * 1e3:.0f} | "
            f"{' / '.join(f'{prefill[n]:.1f}' for n in args.threads)} | {agree}/{args.new_tokens} | {same} |"
        )


if __name__ == "__main__":
    main()
