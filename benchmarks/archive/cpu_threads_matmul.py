"""Session 13 (docs/perf/cpu.md, 'Session 13: CPU'): one 8960x1536 packed projection per format at 1 vs 2 threads, 1-300 rows: bit-identical? Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_threads_matmul.py"""
import torch, sys
from redwood.models.cpu_weights import PackedLinear
g = torch.Generator().manual_seed(0)
w = torch.randn(8960, 1536, generator=g) * 0.02
for kind in ["int8", "int4", "bfloat16"]:
    p = PackedLinear(w, None, kind)
    for M in [1, 2, 4, 5, 16, 65, 128, 300]:
        x = torch.randn(M, 1536, generator=g)
        torch.set_num_threads(1); a = p(x)
        torch.set_num_threads(2); b = p(x)
        print(kind, M, torch.equal(a, b), (a - b).abs().max().item())
