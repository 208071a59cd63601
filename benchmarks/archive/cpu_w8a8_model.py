"""Session 15 (docs/perf/cpu.md, 'Session 15 (CPU)'): the 1.5B GGUF target with int8-activation (w8a8)
projections against the file's own format, whole model: perplexity (cpu_weights.py's held-out code and
essay text), decode tok/s at 1 and 2 threads (interleaved rounds, median step), a 4-token verify forward
(what a γ 3 speculative step's target forward costs), greedy agreement with gguf.

Variants: gguf (as `--weights gguf` loads it: Q4_K → int4 kernel, the rest int8 kernel); gguf-w8a8 (the
same, its int8 projections and head multiplied by w8a8 instead: same weights, int8 activations); w8a8
(`--weights w8a8`: every projection and the head int8 per row from the file's floats, int8 activations);
w8a8-down-int8 / w8a8-head-int8 (w8a8 with ffn_down / the LM head on the int8 weight-only kernel: which
projection's int8 activations cost the perplexity); w8a8-down-bN (ffn_down's activations scaled per row and
per each of N K-blocks: `BlockW8A8`); int8, float32 (`--weights` of that name). --prose FILE: a second held-out
text where the essays dataset is not fetched; --ppl-tokens 2048 to resolve differences under ~1%.

Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_w8a8_model.py [--variants gguf gguf-w8a8 w8a8]
    [--threads 1 2] [--rounds 2] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpu_weights import greedy_decode, held_out_texts, perplexity
from redwood.bench.ar import weight_bytes
from redwood.loading import load_model
from redwood.models.cpu_weights import PackedLinear, pack_w8a8, quantize_rows

NAME = "qwen2.5-coder-1.5b-instruct"


def as_w8a8(m: PackedLinear) -> PackedLinear:
    return PackedLinear.from_int8(m.w8.clone(), m.scale.clone(), m.bias)


def convert(model, which) -> None:
    """Projections for which which(layer_module_name, PackedLinear) is true become w8a8 (int8 ones from their
    own (w8, scale); others re-quantized from `dequantized()`), then the concat groups are formed again."""
    for i, layer in enumerate(model.layers):
        for mod, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                           (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                m = getattr(mod, n)
                if which(n, m):
                    setattr(mod, n, as_w8a8(m) if m.kind == "int8" else PackedLinear(m.dequantized(), m.bias, "w8a8"))
    head = model.packed_head
    if which("head", head):
        new = as_w8a8(head) if head.kind == "int8" else PackedLinear(head.dequantized(), None, "w8a8")
        model.packed_head = new
        if model.lm_head is head:
            model.lm_head = new
    model._concat_packed()


class BlockW8A8(PackedLinear):
    """w8a8 with per-(row, K-block) activation scales: the weight split into `blocks` column blocks, each its
    own fbgemm call on its slice of x, y = Σ_b s_b · acc_b · scale (in block order: rows still exact across M).
    Experiment only (not a format)."""

    def __init__(self, base: PackedLinear, blocks: int):
        torch.nn.Module.__init__(self)
        self.kind, self.out_features, self.in_features = "w8a8", base.out_features, base.in_features
        self.register_buffer("bias", base.bias, persistent=False)
        self.register_buffer("scale", base.scale.clone(), persistent=False)
        w8, self.kb = base.int8_weight(), base.in_features // blocks
        assert self.kb * blocks == base.in_features
        self.parts = [pack_w8a8(w8[:, i:i + self.kb].contiguous(), self.scale) for i in range(0, w8.shape[1], self.kb)]
        self._w8a8, self._slice = self.parts[0], None

    def raw(self, x2):
        y = None
        for i, part in enumerate(self.parts):
            q, s = quantize_rows(x2[:, i * self.kb:(i + 1) * self.kb])
            yi = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(q, 1.0, 128, part).mul_(s)
            y = yi if y is None else y.add_(yi)
        return y


def load(variant):
    if variant.startswith("w8a8-down-b"):  # ffn_down with per-block activation scales (BlockW8A8)
        loaded = load_model(NAME, dtype="float32", weights="w8a8")
        for layer in loaded.model.layers:
            layer.mlp.down_proj = BlockW8A8(layer.mlp.down_proj, int(variant[len("w8a8-down-b"):]))
        return loaded
    if variant == "gguf":
        return load_model(NAME, dtype="float32", weights="gguf")
    if variant == "gguf-w8a8":
        loaded = load_model(NAME, dtype="float32", weights="gguf")
        convert(loaded.model, lambda n, m: m.kind == "int8")
        return loaded
    if variant in ("w8a8", "int8", "float32"):  # (int8: the same weights as w8a8, bfloat16 activations)
        return load_model(NAME, dtype="float32", weights=variant)
    if variant in ("w8a8-down-int8", "w8a8-head-int8"):  # one projection kind kept on bfloat16 activations
        loaded = load_model(NAME, dtype="float32", weights="int8")
        keep = variant.split("-")[1] + ("_proj" if variant.startswith("w8a8-down") else "")
        convert(loaded.model, lambda n, m: n != keep)
        return loaded
    raise ValueError(variant)


@torch.inference_mode()
def verify_ms(model, prompt, t=4, reps=5) -> float:
    cache = model.new_cache(1, len(prompt) + t + 1)
    model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
    cache.commit(len(prompt))
    ids, pos = torch.tensor([prompt[:t]]), torch.arange(len(prompt), len(prompt) + t)[None]
    ts = []
    for _ in range(reps + 1):
        s = time.perf_counter()
        model(ids, pos, cache)
        ts.append(time.perf_counter() - s)
    return statistics.median(ts[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["gguf", "gguf-w8a8", "w8a8"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--prose", default=None,
                    help="a text file whose window [20000:80000] chars is the prose held-out text when the essays "
                         "dataset is not fetched (session 15: benchmarks/NOTES.md at commit 2d5c64b, written after "
                         "the models were trained)")
    args = ap.parse_args()
    rows, ref = [], None
    for variant in args.variants:
        t = time.perf_counter()
        loaded = load(variant)
        model = loaded.model
        print(f"{variant}: loaded in {time.perf_counter() - t:.0f} s", flush=True)
        texts = held_out_texts(loaded.tokenizer, args.ppl_tokens)
        if args.prose and "essay" not in texts:
            texts["prose"] = loaded.tokenizer.encode(open(args.prose).read()[20000:80000])[:args.ppl_tokens]
        prompt = texts["code"][:128]
        torch.set_num_threads(max(args.threads))
        ppl = {} if args.no_ppl else {k: perplexity(model, ids) for k, ids in texts.items()}
        steps, verify, outs = {n: [] for n in args.threads}, {n: [] for n in args.threads}, {}
        for _ in range(args.rounds):
            for n in args.threads:
                torch.set_num_threads(n)
                toks, _, st = greedy_decode(model, prompt, args.new_tokens)
                steps[n] += st
                verify[n].append(verify_ms(model, prompt))
                outs.setdefault(n, toks)
        toks = outs[args.threads[0]]
        ref = ref or toks
        agree = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
        step = {n: statistics.median(v) for n, v in steps.items()}
        ver = {n: min(v) for n, v in verify.items()}
        same = all(o == toks for o in outs.values())
        row = (variant, weight_bytes(model) / 1e9, ppl, step, ver, agree, same)
        rows.append(row)
        print(f"  {row[1]:.2f} GB/step ppl " + " ".join(f"{k} {v:.3f}" for k, v in ppl.items()) + "  "
              + ", ".join(f"{n}t {1 / step[n]:.2f} tok/s ({step[n] * 1e3:.0f} ms, verify 4: {ver[n]:.0f} ms)"
                          for n in args.threads) + f"  greedy = first variant {agree}/{len(ref)}, = across threads {same}",
              flush=True)
        del model, loaded
    th = " | ".join(f"{n}t tok/s (step ms) | {n}t verify-4 ms" for n in args.threads)
    print(f"\n| variant | GB/step | ppl code / essay | {th} | greedy = {args.variants[0]} | = across threads |")
    print("|---|---|---|" + "---|---|" * len(args.threads) + "---|---|")
    for variant, gb, ppl, step, ver, agree, same in rows:
        p = " / ".join(f"{v:.3f}" for v in ppl.values())
        t = " | ".join(f"{1 / step[n]:.2f} ({step[n] * 1e3:.0f}) | {ver[n]:.0f}" for n in args.threads)
        print(f"| {variant} | {gb:.2f} | {p} | {t} | {agree}/{args.new_tokens} | {same} |")


if __name__ == "__main__":
    main()
