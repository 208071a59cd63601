"""Session 13 (docs/perf/cpu.md, 'Session 13: CPU'): element-wise error of gguf / re-quantized int4 / int8 against the 1.5B file's Q4_K values (all layer tensors). Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_gguf_error.py"""
import torch
from redwood.loading.gguf import _MappedFile, int4_groups, dequantize
from redwood.models.cpu_weights import int4_scale_zero, quantize_int4, quantize_int8
from pathlib import Path
p = Path('/root/.cache/redwood/models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct.gguf')
agg = {k: [0.0, 0.0, 0] for k in ("gguf", "int4 (re-quantized)", "int8")}  # max e/step, sum e^2, n
wsq = 0.0
with _MappedFile(p) as f:
    for name, t in f.header.tensors.items():
        if t.type_name != "Q4_K" or not name.startswith("blk."):
            continue
        ref = dequantize(f.raw(t), t.type_name, t.shape)
        q, step, off = int4_groups(f.raw(t), t.type_name, t.shape)
        N, K = t.shape
        s, z = int4_scale_zero(step, off)
        w = ((q.float().view(N, K // 32, 32) - 8) * s.float()[..., None] + z.float()[..., None]).view(N, K)
        pk, sz = quantize_int4(ref, 32)
        sc, zz = sz[..., 0].float().T, sz[..., 1].float().T  # [N, K/32]
        # old int4 weight from its own q: recompute q as quantize_int4 does
        g = ref.view(N, K // 32, 32)
        qo = ((g - zz[..., None]) / sc[..., None] + 8).round().clamp(0, 15)
        wo = ((qo - 8) * sc[..., None] + zz[..., None]).view(N, K)
        w8, s8 = quantize_int8(ref); wi8 = w8.float() * s8.float()[:, None]
        st = step.abs().repeat_interleave(32, 1).clamp_min(1e-30)
        for k, x in (("gguf", w), ("int4 (re-quantized)", wo), ("int8", wi8)):
            e = (x - ref).abs()
            a = agg[k]; a[0] = max(a[0], (e / st)[st > 1e-20].max().item()); a[1] += e.pow(2).sum().item(); a[2] += e.numel()
        wsq += ref.pow(2).sum().item()
n = agg["gguf"][2]
print(f"Q4_K layer tensors of the 1.5B: {n/1e6:.0f}M weights, rms weight {(wsq/n)**0.5:.4g}")
for k, (mx, sq, n) in agg.items():
    print(f"| {k} | {mx:.3f} (step > 0) | {(sq/n)**0.5:.3g} | {(sq/wsq)**0.5*100:.2f}% |")
