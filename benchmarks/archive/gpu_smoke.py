"""CUDA smoke test: on the GPU, speculative greedy output equals autoregressive (tiny random models, float32).

Run on the GPU machine from the repo root:  PYTHONPATH=src:. python benchmarks/archive/gpu_smoke.py
Prints one line per configuration and a short table last.
"""

from __future__ import annotations

import tempfile
import time

import torch

from redwood import LLM, SamplingParams
from redwood.speculation.config import SpeculativeConfig
from tests.conftest import make_tokenizer, random_hf_model, tiny_hf_config


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    tok = make_tokenizer()
    target_dir, draft_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
    hf = random_hf_model(tiny_hf_config("qwen2", eos_token_id=tok.eos_token_id), seed=0, scale=0.3)
    hf.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(draft_dir)
    tok.save_pretrained(draft_dir)
    prompts = [list(range(5, 60)), [11, 3, 4], list(range(100, 130))]
    greedy = SamplingParams(max_new_tokens=32, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)
    configs = {
        "ar": None,
        "self-streaming-chain": SpeculativeConfig(self_speculate=True, draft_kv="streaming", sinks=2, window=12),
        "self-snapkv-chain": SpeculativeConfig(self_speculate=True, draft_kv="snapkv", draft_budget=16, window=4),
        "draft-full-chain": SpeculativeConfig(draft_model=draft_dir, num_draft_tokens=3),
        "draft-full-tree16": SpeculativeConfig(draft_model=draft_dir, tree="generic-16"),
        "self-streaming-tree16": SpeculativeConfig(self_speculate=True, draft_kv="streaming", sinks=2, window=12,
                                                   tree="generic-16"),
    }
    cpu_ref = [o.token_ids for o in LLM(target_dir).generate(prompts, greedy)]
    cuda_ref = [o.token_ids for o in LLM(target_dir, device="cuda").generate(prompts, greedy)]
    print("CUDA AR == CPU AR (float32, rounding may differ at near-ties):", cuda_ref == cpu_ref)
    rows = []
    for name, spec in configs.items():
        llm = LLM(target_dir, device="cuda", speculative=spec)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        dt = time.perf_counter() - t0
        same = [o.token_ids for o in outs] == cuda_ref
        s_outs = llm.generate(prompts, sampled)
        s_again = llm.generate(prompts, sampled)
        reproducible = [o.token_ids for o in s_outs] == [o.token_ids for o in s_again]
        rows.append((name, same, reproducible, dt))
        print(name, "greedy == CUDA AR:", same, "seeded sampling reproducible:", reproducible, flush=True)
    print(f"\n{'config':<24}{'greedy==AR':>12}{'seeded repro':>14}{'wall s':>9}")
    for name, same, rep, dt in rows:
        print(f"{name:<24}{str(same):>12}{str(rep):>14}{dt:>9.2f}")


if __name__ == "__main__":
    main()
