"""Session 13 (docs/perf/cpu.md, 'Session 13: CPU'): one projection of the 1.5B's shapes per format, 1 and 2 threads interleaved. Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_projections.py"""
import torch, time, statistics
from redwood.models.cpu_weights import PackedLinear
g = torch.Generator().manual_seed(0)
shapes = {"head 151936x1536": (151936, 1536), "ffn_down 1536x8960": (1536, 8960), "ffn_up 8960x1536": (8960, 1536), "q 1536x1536": (1536, 1536)}
for name, (N, K) in shapes.items():
    w = torch.randn(N, K, generator=g) * 0.02
    for kind in ["int8", "int4", "bfloat16"]:
        p = PackedLinear(w, None, kind)
        x = torch.randn(1, 1, K, generator=g)
        res = {}
        for rep in range(3):
            for th in (1, 2):
                torch.set_num_threads(th)
                p(x)
                ts = []
                for _ in range(5 if N > 100000 else 20):
                    t = time.perf_counter(); p(x); ts.append(time.perf_counter() - t)
                res.setdefault(th, []).append(statistics.median(ts))
        r = {th: min(v) * 1e3 for th, v in res.items()}
        print(f"{name:20s} {kind:9s} 1t {r[1]:7.2f} ms  2t {r[2]:7.2f} ms  ({N*K/r[1]/1e6:.1f} / {N*K/r[2]/1e6:.1f} G weights/s)", flush=True)
        del p
