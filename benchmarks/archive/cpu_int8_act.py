"""Session 15 (docs/perf/cpu.md, 'Session 15 (CPU)'): int8 activations × int8 weights through stock
PyTorch CPU kernels (integer dot products: VNNI on the AMD EPYC machine) against the current weight-only
kernels, per 1.5B projection shape, M = 1 and 4 rows, 1 and 2 threads.

Each candidate quantizes the activation ROWS itself (float32 scale per row, q = round(x / s) ∈ [−127, 127])
and hands the kernel those integers with scale 1 (zero point 128 where it wants uint8), so the kernel's own
per-tensor quantization is the identity and its int32 sums are exact: each output row is then acc · w_scale
· s_row, independent of the other rows (`--check` verifies that bit for bit for M = 1..8 and against an
exact float64 product).

Usage: PYTHONPATH=src:benchmarks python benchmarks/archive/cpu_int8_act.py [--check] [--shapes qkv o gate_up down head]
    [--kinds int4 int8 fbgemm onednn intmm ...] [--rows 1 4] [--threads 1 2] [--reps 20]
Timings cycle through copies of each weight (≥ 96 MB in all) so that no call finds its weight in the 32 MB
L3. Median of --reps calls per cell, ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from redwood.models.cpu_weights import PackedLinear

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
          "head": (151936, 1536)}


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float → (q int8 [M, K], s float32 [M, 1]): symmetric per row, s = max |x| / 127."""
    x = x.float()
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return torch.round(x / s).clamp_(-127, 127).to(torch.int8), s


class Candidate:
    """One kernel over int8 weights w8 [N, K] with float32 per-row scales ws [N]: __call__(x float32
    [M, K]) → float32 [M, N]."""


class Fbgemm(Candidate):
    """quantized.linear_with_input_q_dq_qweight_dq_output_fp32 (fbgemm u8s8 → fp32): X float with integer
    values q + 0 quantized by the op at scale 1, zero point 128."""

    def __init__(self, w8, ws, engine="fbgemm"):
        torch.backends.quantized.engine = engine
        qw = torch._make_per_channel_quantized_tensor(w8, ws.double(), torch.zeros(len(ws), dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def __call__(self, x):
        q, s = act_quant(x)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(q.float(), 1.0, 128, self.packed)
        return y.mul_(s)


class FbgemmDynamic(Fbgemm):
    """quantized.linear_dynamic (per-TENSOR dynamic quantization inside: not row-exact; speed only)."""

    def __call__(self, x):
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, False)


class Onednn(Candidate):
    """onednn.qlinear_prepack + qlinear_pointwise: uint8 input q + 128 (scale 1, zero point 128), per-
    channel weight scales, float32 output."""

    def __init__(self, w8, ws, signed=False):
        self.signed = signed
        self.packed = torch.ops.onednn.qlinear_prepack(w8, None)
        self.ws, self.wz = ws.float(), torch.zeros(len(ws), dtype=torch.long)

    def __call__(self, x):
        q, s = act_quant(x)
        if self.signed:
            xin, zp = q, 0
        else:
            xin, zp = (q.to(torch.int16) + 128).to(torch.uint8), 128
        y = torch.ops.onednn.qlinear_pointwise(xin, 1.0, zp, self.packed, self.ws, self.wz, None, 1.0, 0,
                                               torch.float32, "none", [None], "")
        return y.mul_(s)


class IntMM(Candidate):
    """torch._int_mm(int8 [M, K], int8 [K, N]) → int32 (oneDNN s8s8s32 matmul), then acc · ws · s."""

    def __init__(self, w8, ws, transposed_view=True):
        self.wt = w8.t() if transposed_view else w8.t().contiguous()
        self.ws = ws.float()

    def __call__(self, x):
        q, s = act_quant(x)
        acc = torch._int_mm(q, self.wt)
        return acc.float().mul_(self.ws).mul_(s)


class Current(Candidate):
    """The current PackedLinear kinds (bf16 activations): int8 = _weight_int8pack_mm, int4 =
    _weight_int4pack_mm_for_cpu (group 32)."""

    def __init__(self, w8, ws, kind):
        self.p = PackedLinear(w8.float() * ws.float()[:, None], None, kind)

    def __call__(self, x):
        return self.p.raw(x.to(torch.bfloat16)).float()


class DynQuant4(Candidate):
    """aten._dyn_quant_pack_4bit_weight / _dyn_quant_matmul_4bit (KleidiAI on Arm; x86 has a fallback)."""

    def __init__(self, w8, ws, group=32):
        N, K = w8.shape
        q4 = (w8.to(torch.int16) // 16 + 8).clamp(0, 15).to(torch.uint8)  # (values only matter for speed)
        packed_u8 = (q4[:, 1::2] << 4 | q4[:, ::2]).contiguous()
        scales = torch.ones(N, K // group)
        self.N, self.K, self.group = N, K, group
        self.packed = torch.ops.aten._dyn_quant_pack_4bit_weight(packed_u8, scales, None, group, K, N)

    def __call__(self, x):
        return torch.ops.aten._dyn_quant_matmul_4bit(x.float(), self.packed, self.group, self.K, self.N)


def make(kind, w8, ws):
    return {"int8": lambda: Current(w8, ws, "int8"), "int4": lambda: Current(w8, ws, "int4"),
            "fbgemm": lambda: Fbgemm(w8, ws, "fbgemm"), "fbgemm-x86": lambda: Fbgemm(w8, ws, "x86"),
            "fbgemm-dyn": lambda: FbgemmDynamic(w8, ws, "fbgemm"),
            "onednn": lambda: Onednn(w8, ws), "onednn-s8": lambda: Onednn(w8, ws, signed=True),
            "intmm": lambda: IntMM(w8, ws), "intmm-kn": lambda: IntMM(w8, ws, transposed_view=False),
            "dynq4": lambda: DynQuant4(w8, ws)}[kind]()


def weights(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    ws = (torch.rand(N, generator=g) * 1e-3 + 1e-4).to(torch.bfloat16).float()
    return w8, ws


def check(kinds, shapes) -> None:
    """Rows of an M-row product == the one-row products (torch.equal), M = 1..8, and the one-row product
    against the exact value (float64 product of the integers, times the scales)."""
    g = torch.Generator().manual_seed(1)
    for name in shapes:
        N, K = SHAPES[name]
        w8, ws = weights(N, K)
        x = torch.randn(8, K, generator=g)
        x[:, :4] *= 40  # outlier channels, as Qwen2's hidden states have
        q, s = act_quant(x)
        exact = (q.double() @ w8.double().t()) * ws.double() * s.double()
        for kind in kinds:
            try:
                c = make(kind, w8, ws)
                ones = torch.cat([c(x[i:i + 1]) for i in range(8)])
                rows_ok = all(torch.equal(c(x[:m]), ones[:m]) for m in range(1, 9))
                err = ((ones.double() - exact).abs().max() / exact.abs().max()).item()
                print(f"{name:8s} {kind:11s} rows == one-row products M=1..8: {rows_ok}   max |y − exact| / max |exact| {err:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001 (a missing op or a refused shape: report it)
                print(f"{name:8s} {kind:11s} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)


def timing(kinds, shapes, rows, threads, reps) -> None:
    print(f"| shape | kind | " + " | ".join(f"M={m} {t}t ms" for m in rows for t in threads) + " |")
    print("|---|---|" + "---|" * (len(rows) * len(threads)))
    for name in shapes:
        N, K = SHAPES[name]
        copies = max(1, -(-96_000_000 // (N * K)))
        base = [weights(N, K, seed=i) for i in range(copies)]
        for kind in kinds:
            try:
                cs = [make(kind, w8, ws) for w8, ws in base]
            except Exception as e:  # noqa: BLE001
                print(f"| {name} {N}x{K} | {kind} | FAILED {type(e).__name__}: {str(e)[:120]} |", flush=True)
                continue
            cells = []
            for m in rows:
                x = torch.randn(m, K)
                for t in threads:
                    torch.set_num_threads(t)
                    for c in cs:
                        c(x)  # warm-up (oneDNN builds a primitive per shape)
                    ts = []
                    for i in range(reps):
                        c = cs[i % copies]
                        t0 = time.perf_counter()
                        c(x)
                        ts.append(time.perf_counter() - t0)
                    cells.append(statistics.median(ts) * 1e3)
            print(f"| {name} {N}x{K} | {kind} | " + " | ".join(f"{v:.3f}" for v in cells) + " |", flush=True)
            del cs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--kinds", nargs="+", default=["int4", "int8", "fbgemm", "fbgemm-x86", "fbgemm-dyn", "onednn",
                                                   "onednn-s8", "intmm", "intmm-kn", "dynq4"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, engines "
          f"{torch.backends.quantized.supported_engines}", flush=True)
    if args.check:
        torch.set_num_threads(1)
        check(args.kinds, args.shapes)
    else:
        timing(args.kinds, args.shapes, args.rows, args.threads, args.reps)


if __name__ == "__main__":
    main()
