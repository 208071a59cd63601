"""Session 13 (docs/perf/cpu.md, 'Session 13: CPU'): whole 1.5B forwards at 1 vs 2 threads per format (128-row prefill, decode steps, a 4-token verify, a 40-row prefill). Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_threads_identity.py gguf int8 int4"""
import sys, torch
sys.path.insert(0, "benchmarks")
from cpu_weights import held_out_texts
from redwood.loading import load_model
NAME = "qwen2.5-coder-1.5b-instruct"
for kind in sys.argv[1:]:
    lm = load_model(NAME, weights=kind)
    m = lm.model
    ids = held_out_texts(lm.tokenizer, 300)["code"]
    res = {}
    for th in (1, 2, 1):
        torch.set_num_threads(th)
        with torch.inference_mode():
            out = []
            for n_prompt in (128, 40):  # 128 rows: the gemm path; 40: the kernels
                c = m.new_cache(1, 256)
                lg = m(torch.tensor([ids[:n_prompt]]), torch.arange(n_prompt)[None], c); c.commit(n_prompt)
                out.append(lg)
                p = n_prompt
                for i in range(3):
                    lg = m(torch.tensor([[ids[p]]]), torch.tensor([[p]]), c); c.commit(1); p += 1
                    out.append(lg)
                lg = m(torch.tensor([ids[p:p + 4]]), torch.arange(p, p + 4)[None], c)
                out.append(lg)
        res.setdefault(th, []).append(out)
    names = ["prefill128", "dec1", "dec2", "dec3", "verify4", "prefill40", "dec1", "dec2", "dec3", "verify4"]
    same12 = [torch.equal(a, b) for a, b in zip(res[1][0], res[2][0])]
    same11 = [torch.equal(a, b) for a, b in zip(res[1][0], res[1][1])]
    diff = [(a - b).abs().max().item() for a, b in zip(res[1][0], res[2][0])]
    print(kind, "1t == 2t:", dict(zip(names, same12)), "1t == 1t again:", all(same11), "max diff", max(diff), flush=True)
    del m, lm
