"""Issue 40 item 3: where a MagicDec speculative step's time goes against its byte floors, and what bounds the
end-to-end ratio of a long-generation run.

Reads `benchmarks/engine_steps.py --json` (whole Engine steps, AR and self-speculation, at B rows × L context, and
the prefill of those rows), a `redwood profile` JSON of the same shape (graphed forwards: the verify of γ + 1
tokens, one draft level over the compressed view) and, optionally, `bench throughput` reports of the end-to-end
run (AR vs speculation). Measures this GPU's copy bandwidth (`redwood.bench.ar.copy_bandwidth`, as P1's floor) and its bf16
matmul rate, then prints the step's split — draft levels, verify, the rest (sampling, acceptance, commit, host) —
next to the floors (bytes / bandwidth), and the end-to-end bound: with prefill P and AR's decoding D, a steady
decoding speedup s gives at most (P + D) / (P + D / s).

    python3 benchmarks/step_floors.py --model /root/t.gguf --steps steps.json --profile profile.json \\
        [--e2e REPORT_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from redwood.bench.ar import copy_bandwidth
from redwood.config import ModelConfig
from redwood.loading.gguf import read_gguf_config


def weight_bytes(c, itemsize: int) -> int:
    """Bytes of weights one forward reads: every layer's projections and the LM head (the embedding lookup reads
    only the batch's rows; norms and biases are noise)."""
    q = c.hidden_size * c.num_heads * c.head_dim
    kv = 2 * c.hidden_size * c.num_kv_heads * c.head_dim
    o = c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return (c.num_layers * (q + kv + o + mlp) + c.vocab_size * c.hidden_size) * itemsize


def kv_token_bytes(c, itemsize: int) -> int:
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / timed(lambda: a @ b)


def prefill_flops(c, prompt: int) -> float:
    """One prompt's prefill: the projections over every token plus causal attention (QKᵀ and PV)."""
    proj = 2 * (weight_bytes(c, 1) - c.vocab_size * c.hidden_size) * prompt
    attn = c.num_layers * 4 * c.num_heads * c.head_dim * prompt * prompt / 2
    return proj + attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the target (its shape gives the bytes)")
    ap.add_argument("--steps", required=True, help="engine_steps.py --json output")
    ap.add_argument("--profile", required=True, help="`redwood profile` JSON at the same batch × context")
    ap.add_argument("--e2e", nargs="*", default=[], help="bench throughput report folders (AR vs speculation)")
    args = ap.parse_args()
    path = Path(args.model)
    c = ModelConfig.from_hf_file(path / "config.json") if path.is_dir() else read_gguf_config(path)
    steps = json.loads(Path(args.steps).read_text())
    prof = json.loads(Path(args.profile).read_text())
    itemsize = 2  # bf16
    W, kv = weight_bytes(c, itemsize), kv_token_bytes(c, itemsize)
    B, L, gamma, budget = steps["rows"], steps["context"], steps["gamma"], steps["budget"]
    if prof["batch"] != B or abs(prof["context"] - L) > 256:
        raise SystemExit(f"the profile's {prof['batch']} × {prof['context']} is not the steps' {B} × {L}")
    bw = copy_bandwidth(torch.device("cuda")) if torch.cuda.is_available() else float("nan")
    peak = matmul_rate() if torch.cuda.is_available() else float("nan")
    modes = {m["mode"]: m for m in steps["modes"]}
    ar, spec = modes["ar"], modes.get("self")
    fwd = dict(zip(prof["target"]["tokens"], prof["target"]["ms"]))
    level_ms = prof["draft"]["ms"][0]
    ms = lambda nbytes: nbytes / bw * 1e3  # noqa: E731
    ar_floor, verify_floor, level_floor = ms(W + B * L * kv), ms(W + B * (L + gamma + 1) * kv), ms(W + B * budget * kv)
    print(
        f"\n{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}: copy {bw / 1e12:.2f} TB/s, "
        f"bf16 matmul {peak / 1e12:.0f} TFLOP/s; weights {W / 1e9:.2f} GB, KV {kv} B a token; {B} rows × {L}"
    )
    print("| part | measured ms | floor ms | × floor |")
    print("|---|---|---|---|")
    print(f"| AR step (engine, wall) | {ar['step_ms']:.2f} | {ar_floor:.2f} | {ar['step_ms'] / ar_floor:.2f} |")
    print(f"| AR forward (graphed) | {fwd[1]:.2f} | {ar_floor:.2f} | {fwd[1] / ar_floor:.2f} |")
    if spec is not None:
        verify = fwd.get(gamma + 1)
        rest = spec["step_ms"] - gamma * level_ms - (verify or 0)
        print(
            f"| draft level ({budget}-token view) | {level_ms:.2f} | {level_floor:.2f} | {level_ms / level_floor:.2f} |"
        )
        print(
            f"| {gamma} draft levels | {gamma * level_ms:.2f} | {gamma * level_floor:.2f} | "
            f"{level_ms / level_floor:.2f} |"
        )
        if verify is not None:
            print(f"| verify ({gamma + 1} tokens) | {verify:.2f} | {verify_floor:.2f} | {verify / verify_floor:.2f} |")
        print(f"| the rest (sampling, acceptance, commit, host) | {rest:.2f} | 0 | |")
        spec_floor = gamma * level_floor + verify_floor
        print(
            f"| speculative step (engine, wall) | {spec['step_ms']:.2f} | {spec_floor:.2f} | "
            f"{spec['step_ms'] / spec_floor:.2f} |"
        )
        tpr = spec["tokens_per_row"]
        steady = spec["tokens_per_s"] / ar["tokens_per_s"]
        at_floor = tpr * ar_floor / spec_floor
        at_levels = tpr * ar["step_ms"] / (spec["step_ms"] - gamma * (level_ms - 1.5 * level_floor))
        print(
            f"\nsteady: {tpr:.2f} tokens a row a step → {steady:.2f}× AR measured; {at_floor:.2f}× with both at "
            f"their floors; {at_levels:.2f}× with the draft levels at 1.5× their floor and the rest as measured"
        )
    fill = steps.get("fill_s")
    for folder in args.e2e:
        report = json.loads((Path(folder) / "report.json").read_text())
        runs = {r["method"]: r for r in report["runs"]}
        if "ar" not in runs or len(runs) < 2:
            continue
        other = next(m for m in runs if m != "ar")
        t_ar, t_sp = runs["ar"]["duration_s"], runs[other]["duration_s"]
        cfg = report["config"]
        flops = cfg["num_requests"] * prefill_flops(c, cfg["prompt_len"])
        p_floor = flops / peak
        prefill = fill if fill is not None else runs["ar"]["ttft_ms_p99"] / 1e3
        decode = t_ar - prefill
        print(
            f"\nend to end ({folder}): {cfg['num_requests']} × {cfg['prompt_len']} prompt tokens, "
            f"{cfg['min_new_tokens']}–{cfg['max_new_tokens']} new; AR {t_ar:.1f} s, {other} {t_sp:.1f} s → "
            f"{t_ar / t_sp:.2f}×"
        )
        print(f"  prefill {prefill:.1f} s measured ({p_floor:.1f} s at the matmul rate), AR decoding ≈ {decode:.1f} s")
        for label, s in (
            ("steady ratio measured", steady if spec else None),
            ("steps at their floors", at_floor if spec else None),
            ("free decoding", float("inf")),
        ):
            if s:
                print(f"  bound with {label} ({s:.2f}×): {t_ar / (prefill + decode / s):.2f}×")


if __name__ == "__main__":
    main()
