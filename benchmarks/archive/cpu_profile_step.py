"""Session 13 (docs/perf/cpu.md, 'Session 13: CPU'): one decode step of the 1.5B under torch.profiler: int4 / int8 matmuls, the LM head, the rest, at 1 and 2 threads. Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_profile_step.py gguf int4"""
import sys, torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, "benchmarks")
from cpu_weights import held_out_texts
from redwood.loading import load_model
from redwood.models.cpu_weights import PackedLinear
NAME = "qwen2.5-coder-1.5b-instruct"
kinds = sys.argv[1:]
for kind in kinds:
    lm = load_model(NAME, weights=kind); m = lm.model
    # tag the head's projection
    head = m.packed_head
    orig = head.forward
    def hf(x, _o=orig):
        with torch.profiler.record_function("LM_HEAD"):
            return _o(x)
    head.forward = hf
    ids = held_out_texts(lm.tokenizer, 200)["code"][:128]
    for th in (1, 2):
        torch.set_num_threads(th)
        with torch.inference_mode():
            c = m.new_cache(1, 200)
            lg = m(torch.tensor([ids]), torch.arange(128)[None], c, logits_at=torch.tensor([[127]])); c.commit(128)
            tok, p = int(lg[0, -1].argmax()), 128
            for i in range(3):
                lg = m(torch.tensor([[tok]]), torch.tensor([[p]]), c); c.commit(1); p += 1; tok = int(lg[0, -1].argmax())
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(8):
                    with torch.profiler.record_function("STEP"):
                        lg = m(torch.tensor([[tok]]), torch.tensor([[p]]), c); c.commit(1); p += 1; tok = int(lg[0, -1].argmax())
        ev = {e.key: e for e in prof.key_averages()}
        step = ev["STEP"].cpu_time_total / 8 / 1e3
        def t(k): return ev[k].cpu_time_total / 8 / 1e3 if k in ev else 0.0
        i4, i8 = t("aten::_weight_int4pack_mm_for_cpu"), t("aten::_weight_int8pack_mm")
        head_t = t("LM_HEAD")
        print(f"{kind} {th}t: step {step:.1f} ms; int4 mm {i4:.1f}, int8 mm {i8:.1f} (of which LM head {head_t:.1f}); rest {step - i4 - i8:.1f}", flush=True)
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        print("   top self: " + "; ".join(f"{e.key} {e.self_cpu_time_total/8/1e3:.2f}" for e in top if e.key not in ('STEP','LM_HEAD')))
    del m, lm
