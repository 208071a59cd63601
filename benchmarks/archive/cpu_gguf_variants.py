"""Session 13 (docs/perf/cpu.md, 'Session 13: CPU'): which of the file's Q6_K tensors cost int4's perplexity: gguf with the head / the layers' Q6_K / every Q6_K re-quantized to int4 (ppl + decode at 1 and 2 threads). Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_gguf_variants.py"""
import sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
from cpu_weights import held_out_texts, perplexity, greedy_decode
from redwood.loading import load_model
from redwood.loading.gguf import _MappedFile, dequantize, hf_name
from redwood.models.cpu_weights import PackedLinear
from redwood.bench.ar import weight_bytes
NAME = "qwen2.5-coder-1.5b-instruct"
torch.set_num_threads(2)
base = load_model(NAME, weights="gguf")
texts = held_out_texts(base.tokenizer, 512)
prompt = texts["code"][:128]

def requant(model, which):
    """Re-quantize the int8 (Q6_K in the file) projections selected by `which` to int4 from the file's floats."""
    with _MappedFile(base.path) as f:
        for gname, t in f.header.tensors.items():
            hf = hf_name(gname)
            if hf is None or t.type_name != "Q6_K" or not which(hf):
                continue
            w = dequantize(f.raw(t), t.type_name, t.shape)
            path = hf.removesuffix(".weight").removeprefix("model.")
            old = model.get_submodule(path)
            new = PackedLinear(w, None, "int4"); new.bias = old.bias
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
            if hf == "lm_head.weight":
                model.packed_head = new
    return model

variants = [("gguf", lambda h: False), ("gguf + int4 head", lambda h: h == "lm_head.weight"),
            ("gguf + int4 ffn_down/attn_v", lambda h: h != "lm_head.weight"), ("all Q6_K int4", lambda h: True)]
for label, which in variants:
    m = load_model(NAME, weights="gguf").model
    m = requant(m, which)
    torch.set_num_threads(2)
    ppl = {k: perplexity(m, ids) for k, ids in texts.items()}
    st = {1: [], 2: []}
    for r in range(2):
        for th in (1, 2):
            torch.set_num_threads(th)
            st[th] += greedy_decode(m, prompt, 32)[2]
    s = {th: statistics.median(v) for th, v in st.items()}
    print(f"| {label} | {weight_bytes(m)/1e9:.2f} | " + " / ".join(f"{k} {v:.3f}" for k, v in ppl.items())
          + f" | {1/s[1]:.2f} ({s[1]*1e3:.0f}) | {1/s[2]:.2f} ({s[2]*1e3:.0f}) |", flush=True)
    del m
