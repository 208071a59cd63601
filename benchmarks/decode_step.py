"""Decode-step latency of a Qwen2.5-Coder-1.5B-shaped model (random bf16 weights) on the GPU: the P1
ablation without staging real weights (time per step does not depend on the weights' values).

Usage: PYTHONPATH=src python benchmarks/decode_step.py [--context 128] [--batch 1]
Prints, per variant (eager / graphs, reference / Triton attention, fused kernels on / off), the median
time of one decode step, its tokens/s and its fraction of the weight-read floor, short table last.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from redwood.bench.ar import copy_bandwidth, weight_bytes
from redwood.config import ModelConfig
from redwood.engine.runner import StepRunner
from redwood.models.transformer import build_model

QWEN_1_5B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
             "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
             "tie_word_embeddings": True, "eos_token_id": 151645}


def random_model(fuse: bool):
    cfg = ModelConfig.from_hf_dict(QWEN_1_5B)
    with torch.device("meta"):
        from redwood.models.transformer import Transformer

        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {k: (torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02) for k, s in shapes.items()}
    model = build_model(cfg, state, torch.bfloat16, "cuda")
    if fuse:
        model.fuse_projections()
    return model


def time_step(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median ms of fn() over `repeats` runs timed with CUDA events, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    rows = []
    for fuse in (False, True):
        model = random_model(fuse)
        floor_ms = weight_bytes(model) / bw * 1e3
        for backend in ("reference", "auto"):
            model.attention_backend = backend
            for graphs in (False, True):
                cache = model.new_cache(args.batch, args.context + 512)
                cache.lengths.fill_(args.context)
                runner = StepRunner(model, cache, use_graphs=graphs)
                for T in args.tokens:
                    ids = torch.randint(0, 1000, (args.batch, T), device="cuda")
                    pos = cache.lengths[:, None] + torch.arange(T, device="cuda")
                    ms = time_step(lambda: runner.forward(ids, pos))
                    rows.append((f"fused={'yes' if fuse else 'no'} attn={backend} graphs={'yes' if graphs else 'no'}",
                                 T, ms, args.batch * 1e3 / ms, floor_ms / ms))
                    print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"\nweight-read floor {floor_ms:.3f} ms/step at {bw / 1e12:.2f} TB/s; batch {args.batch}, context {args.context}")
    print(f"{'variant':<44}{'T':>4}{'ms/step':>9}{'tok/s (T=1)':>13}{'floor/time':>11}")
    for name, T, ms, tps, frac in rows:
        print(f"{name:<44}{T:>4}{ms:>9.3f}{tps:>13.0f}{frac:>11.2f}")


if __name__ == "__main__":
    main()
