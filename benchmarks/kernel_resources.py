"""Registers, shared memory and resident programs per SM of the attention kernel's variants, compiled
for sm_90 by this machine's Triton — no GPU needed (the cubin's resource usage via Triton's cuobjdump).

Why: split-KV attention sizes its grid to whole waves of resident programs (`decode_attention` reads
the compiled variant's occupancy on the GPU; without it, `default_num_splits` assumes 3 programs of
≤ 32 query rows or 2 of 64 per SM). A variant with more registers or shared memory than assumed runs a
partial extra wave. Run it where the benchmarks run (the GPU machine's Triton may allocate differently
from a newer one here):

    PYTHONPATH=src python benchmarks/kernel_resources.py
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from redwood.attention import triton_decode as td
from redwood.kernels.occupancy import resident_programs

POINTERS = {
    "Q": "*bf16",
    "K": "*bf16",
    "V": "*bf16",
    "OUT": "*bf16",
    "LENGTHS": "*i64",
    "LIVE": "*i64",
    "NEW_MASK": "*i64",
    "CTX_IDX": "*i64",
    "CTX_VALID": "*u8",
    "QPOS": "*i64",
    "BLOCK_TABLE": "*i32",
    "WS_ACC": "*fp32",
    "WS_M": "*fp32",
    "WS_L": "*fp32",
    "LOCKS": "*i32",
    "qk_scale": "fp32",
}
UNIT_STRIDES = ("sq_d", "sk_d", "sv_d", "sci_c", "scv_c")  # 1 at run time: Triton specializes them
ALIGNED = ("sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_n", "sv_b", "sv_h", "sv_n")  # multiples of 16


def compile_variant(
    T: int,
    mask: bool,
    live: bool,
    G: int = 6,
    D: int = 128,
    fused_merge: bool = False,
    view: str = "none",
    n_keys: int | None = None,
) -> dict:
    """The kernel as decode_attention launches it for T new tokens per row (bf16, split KV) over a paged cache
    whose pages hold whole key tiles (one table lookup a tile, a tile ahead); view: "none", "gathered" (ctx_idx:
    SnapKV's, a lookup a key) or "span" (StreamingLLM's two slot ranges, read as tiles); n_keys: the static bound
    the plan passes (context capacity, or the view's keys)."""
    fn = td._split_kv_kernel
    gathered = view == "gathered"
    cfg = td._launch_config(G * T, D, torch.bfloat16, True, n_keys, gathered)
    consts = {
        **{name: 1 for name in UNIT_STRIDES},
        "G": G,
        "D": D,
        "BLOCK_M": cfg["BLOCK_M"],
        "BLOCK_N": cfg["BLOCK_N"],
        "BLOCK_R": cfg["BLOCK_R"],
        "BLOCK_D": cfg["BLOCK_D"],
        "HAS_VIEW": gathered,
        "HAS_SPAN": view == "span",
        "PAGED": True,
        "PAGE_TILES": not gathered,
        "PREFETCH": not gathered,
        "HAS_NEW_MASK": mask,
        "HAS_WINDOW": False,
        "HAS_LIVE": live,
        "SPLIT": True,
        "FUSED_MERGE": fused_merge,
        "BLOCK_S": 4,
        "UPCAST": False,
        "PRECISION": "tf32",
        "PDL": False,
    }
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ALIGNED or (sig[n].startswith("*"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    spill = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    return dict(
        T=T,
        view=view,
        block_n=cfg["BLOCK_N"],
        mask=mask,
        live=live,
        fused=fused_merge,
        block_m=cfg["BLOCK_M"],
        stages=cfg["num_stages"],
        regs=regs,
        stack=spill,
        shared=shared,
        per_sm=resident_programs(regs, shared, cfg["num_warps"]),
        assumed=3 if cfg["BLOCK_M"] <= 32 else 2,
    )


def main() -> None:
    # live: rows that finished read no context (P3); fused: the split programs merge (REDWOOD_FUSED_MERGE)
    rows = [
        compile_variant(T, mask, live, fused_merge=fused, n_keys=32768)
        for T, mask, (live, fused) in itertools.product(
            (1, 2, 4, 8, 16), (False, True), ((False, False), (True, False), (True, True))
        )
    ]
    # the draft level over a 512-key StreamingLLM / SnapKV view (T = 1; tree levels: T = 4), rows finished or not
    rows += [
        compile_variant(T, False, live, view=view, n_keys=512)
        for view, T, live in itertools.product(("gathered", "span"), (1, 4), (False, True))
    ]
    print(
        f"triton {triton.__version__}, sm_90 (H100/H200 limits), bf16, G=6, D=128; per_sm = resident "
        f"programs per SM (decode_attention sizes its split grid with it; assumed: the estimate without it)"
    )
    print(
        f"{'view':>8} {'T':>3} {'mask':>5} {'live':>5} {'fused':>5} {'BLOCK_M':>7} {'BLOCK_N':>7} {'stages':>6} "
        f"{'regs':>5} {'stack B':>7} "
        f"{'smem KB':>7} {'per_sm':>6} {'assumed':>7}"
    )
    for r in rows:
        print(
            f"{r['view']:>8} {r['T']:>3} {r['mask']!s:>5} {r['live']!s:>5} {r['fused']!s:>5} {r['block_m']:>7} "
            f"{r['block_n']:>7} {r['stages']:>6} "
            f"{r['regs']:>5} "
            f"{r['stack']:>7} {r['shared'] / 1024:>7.1f} {r['per_sm']:>6} {r['assumed']:>7}"
        )


if __name__ == "__main__":
    main()
