"""The kquant CPU kernel (redwood.cpu_kernels.kquant: Q4_K / Q6_K GGUF super-blocks and Q8_0 / Q5_0 blocks of 32 ×
int8 activations), in
every build this CPU runs (the `kquant_variant` fixture: avx512, avx2, portable on an AVX-512 machine), on random
valid blocks built from bytes:

- `pack` keeps the file's values: unpack(pack(rows)) equals loading.gguf.dequantize(rows) bit for bit (Q8_0 /
  Q5_0 rows of any K a multiple of 32, e.g. the 0.5B's 896, padded with zero weights to whole super-blocks);
- the product equals float64(dequantized W) @ float64(q · dx), q and dx each activation row's per-256
  quantization (q = nearbyint(x · (127 / amax)) in float32, ties to even; dx = amax / 127), to float32
  rounding of the sums;
- each output row is the same bits whatever M, the row's position (row tiles of 4 and their tails) and
  the thread count; rows (and super-blocks) of zeros give zeros;
- every variant gives the same bits as every other (the integer lane sums are exact and the float operations
  the same, in the same order: kq_simd.h);
- bad shapes / dtypes are errors that name the problem; `kernel_order` is a permutation.
Skipped where the kernel cannot run (no compiler, a failed build: `why_unavailable`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from redwood.cpu_kernels import kquant
from redwood.loading.gguf import dequantize

pytestmark = pytest.mark.skipif(
    not kquant.available(), reason=f"kquant kernel unavailable here: {kquant.why_unavailable()}"
)

TYPE_NAMES = list(kquant.TYPES)
FILE_BYTES = {name: kquant.file_block_bytes(name) for name in kquant.TYPES}  # one block of the file
PACKED_BYTES = {name: packed for name, (_, _, packed) in kquant.TYPES.items()}
SHAPES = [(48, 256), (61, 512), (80, 1536)]  # 61: not a multiple of 16 (the kernel's split over N)
# the 32-value block types also at K not a multiple of 256 (one block; 3; the 0.5B's 896 = 3.5 super-blocks)
SHAPES_32 = SHAPES + [(48, 32), (61, 96), (80, 896)]
CASES = [(t, shape) for t in TYPE_NAMES for shape in (SHAPES if kquant.FILE_BLOCK[t] == 256 else SHAPES_32)]


def random_blocks(type_name: str, rows: int, cols: int, seed: int, d_range=(1e-3, 1e-2)) -> torch.Tensor:
    """uint8 [rows, cols / file block · file bytes] of valid `type_name` blocks: random bytes (nibbles, 6-bit
    scales / mins, int8 scales and Q8_0 q, 2-bit / 1-bit high parts) with finite fp16 d (and Q4_K's dmin) in
    d_range, Q6_K's / Q8_0's / Q5_0's d of either sign (llama.cpp's quantizers write negative ones: Q5_0's
    d = max / −16), and a few d = 0 blocks."""
    size = FILE_BYTES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // kquant.FILE_BLOCK[type_name], size), dtype=np.uint8)
    n = raw.shape[0]

    def fp16(sign: bool) -> np.ndarray:
        v = rng.uniform(*d_range, size=(n, 1))
        if sign:
            v *= rng.choice([-1.0, 1.0], size=(n, 1))
        v[rng.random(n) < 0.02] = 0.0
        return v.astype(np.float16).view(np.uint8)

    if type_name == "Q4_K":
        raw[:, 0:2], raw[:, 2:4] = fp16(False), fp16(False)  # d, dmin
    elif type_name == "Q6_K":
        raw[:, 208:210] = fp16(True)
    else:
        raw[:, 0:2] = fp16(True)
    return torch.from_numpy(raw.reshape(rows, -1))


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    """float32 [M, K]: normal values, outlier channels, one super-block of zeros in row 1, and in row 2
    (when M > 2) a first super-block of exact ties (amax 127: x · 127 / amax = x, halves round to even; K < 256:
    the row's K values are the block, zeros pad it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, :3] *= 40
    if M > 1:
        x[1, :256] = 0
    if M > 2:
        n = min(K, 256)
        x[2, :n] = (torch.arange(256, dtype=torch.float32) % 128 - 63.5)[:n]  # ±0.5, ±1.5, …, 63.5
        x[2, 0] = 127.0
    return x


def quantize_reference(x: torch.Tensor) -> torch.Tensor:
    """float64 q · dx of each activation super-block, as the kernel quantizes it (float32 ops); K not a multiple
    of 256: the row padded with zeros to whole super-blocks, as the kernel pads it (the padding's q are 0)."""
    M, K = x.shape
    b = torch.nn.functional.pad(x, (0, kquant.padded(K) - K)).view(M, -1, 256)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))  # float32 127 / amax
    q = torch.round(b * inv)  # (round half to even, as nearbyint in the default rounding mode)
    assert q.abs().max() <= 127
    dx = amax / torch.tensor(127.0)
    return (q.double() * dx.double()).view(M, -1)[:, :K]


def q4k_terms(rows: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K weight's two parts d · sc · q and dmin · mn (dequantized with dmin, then d, set to 0): the
    kernel sums them apart, so its rounding error scales with their magnitudes, not their difference's."""
    b = rows.clone().view(N, K // 256, 144)
    b[..., 2:4] = 0
    scaled = dequantize(b, "Q4_K", (N, K))
    b = rows.clone().view(N, K // 256, 144)
    b[..., 0:2] = 0
    mins = dequantize(b, "Q4_K", (N, K))  # −dmin · mn
    return scaled, mins


@pytest.mark.parametrize("type_name, shape", CASES)
def test_unpack_of_pack_is_the_files_values_bit_for_bit(type_name, shape, kquant_variant):
    N, K = shape
    rows = random_blocks(type_name, N, K, seed=N + K)
    before = rows.clone()
    packed = kquant.pack(rows, type_name)
    assert torch.equal(rows, before)  # (the file's rows are not touched)
    Kp = kquant.padded(K)
    assert packed.dtype == torch.uint8 and packed.shape == (N, Kp // 256 * PACKED_BYTES[type_name])
    want = dequantize(rows, type_name, (N, K))
    got = kquant.unpack(packed, type_name)
    assert got.dtype == torch.float32 and got.shape == (N, Kp)
    assert torch.equal(got[:, :K], want)
    assert torch.equal(got[:, K:], torch.zeros(N, Kp - K))  # (the padding: zero blocks)
    assert torch.equal(kquant.pack(rows[7:19], type_name), packed[7:19])  # (rows are packed alone)


@pytest.mark.parametrize("type_name, shape", CASES)
def test_the_product_is_the_float64_product_of_the_quantized_activations(type_name, shape, kquant_variant):
    N, K = shape
    rows = random_blocks(type_name, N, K, seed=2 * N + K)
    packed = kquant.pack(rows, type_name)
    w = dequantize(rows, type_name, (N, K)).double()
    x = activations(9, K, seed=K)
    xq = quantize_reference(x)
    y = kquant.kquant_linear(x, packed, type_name)
    assert y.dtype == torch.float32 and y.shape == (9, N)
    ref = xq @ w.T
    err = (y.double() - ref).abs()
    assert (err.norm() / ref.norm()).item() < 1e-5
    # element-wise: within float32 roundings of the sums of the terms' magnitudes
    if type_name == "Q4_K":
        scaled, mins = q4k_terms(rows, N, K)
        magnitude = xq.abs() @ (scaled.double().abs() + mins.double().abs()).T
    else:
        magnitude = xq.abs() @ w.abs().T
    assert (err <= 1e-5 * magnitude).all(), (err / magnitude).max().item()
    # the activations' quantization is what is modelled: the float product itself is further off
    assert (y.double() - x.double() @ w.T).abs().max() > 100 * err.max()


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_ties_round_half_to_even(type_name, kquant_variant):
    """Row 2's first super-block holds x · 127 / amax = ±0.5, ±1.5, …: the kernel's q are nearbyint's
    (halves to even), not halves away from zero — one q off by one moves the product far beyond rounding."""
    N, K = 48, 256
    rows = random_blocks(type_name, N, K, seed=11)
    w = dequantize(rows, type_name, (N, K)).double()
    x = activations(3, K, seed=5)[2:3]
    y = kquant.kquant_linear(x, kquant.pack(rows, type_name), type_name).double()
    b = x.double()
    even = b.round() / 1.0  # (amax 127: dx = 1, q = x rounded half to even)
    away = torch.sign(b) * torch.floor(b.abs() + 0.5)
    assert not torch.equal(even, away)
    ref_even, ref_away = even @ w.T, away @ w.T
    assert (y - ref_even).abs().max() * 100 < (y - ref_away).abs().max()


@pytest.mark.parametrize("type_name, shape", CASES)
def test_rows_are_exact_at_any_m_position_and_thread_count(type_name, shape, kquant_variant):
    N, K = shape
    rows = random_blocks(type_name, N, K, seed=N * K)
    packed = kquant.pack(rows, type_name)
    x = activations(40, K, seed=N)
    ones = torch.cat([kquant.kquant_linear(x[i : i + 1], packed, type_name) for i in range(40)])
    # row tiles (8 rows; 4 where a build is made with KQ_ROW_TILE=4) and their tails; passes over the weights of 16 rows (KQ_M_CHUNK) and their tails
    for m in list(range(1, 10)) + [16, 17, 33, 40]:
        assert torch.equal(kquant.kquant_linear(x[:m], packed, type_name), ones[:m]), m
    for start, end in ((3, 12), (5, 6), (1, 17), (13, 40)):  # rows in other tile and pass positions
        assert torch.equal(kquant.kquant_linear(x[start:end], packed, type_name), ones[start:end])
    threads = torch.get_num_threads()
    try:
        by_threads = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            by_threads[n] = (kquant.kquant_linear(x, packed, type_name), kquant.pack(rows, type_name))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(by_threads[1][0], ones) and torch.equal(by_threads[2][0], ones)
    assert torch.equal(by_threads[1][1], packed) and torch.equal(by_threads[2][1], packed)
    # a non-contiguous input is the same rows
    xt = x.t().contiguous().t()
    assert not xt.is_contiguous() and torch.equal(kquant.kquant_linear(xt, packed, type_name), ones)


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_zero_activations_give_zero_outputs(type_name, kquant_variant):
    N, K = 61, 512
    rows = random_blocks(type_name, N, K, seed=3)
    packed = kquant.pack(rows, type_name)
    x = activations(6, K, seed=4)
    x[4] = 0
    y = kquant.kquant_linear(x, packed, type_name)
    assert torch.equal(y[4], torch.zeros(N)) and torch.isfinite(y).all()
    assert torch.equal(kquant.kquant_linear(torch.zeros(1, K), packed, type_name), torch.zeros(1, N))
    # a super-block of zeros in a row (row 1's first) is left out of that row's sum
    w = dequantize(rows, type_name, (N, K)).double()
    ref = quantize_reference(x[1:2, 256:]) @ w[:, 256:].T
    assert ((y[1].double() - ref[0]).abs() <= 1e-5 * ref.abs().max()).all()
    assert kquant.kquant_linear(torch.zeros(0, K), packed, type_name).shape == (0, N)


def test_bad_inputs_are_errors_that_name_the_problem():
    """The Python wrappers refuse bad arguments before the C++ op runs (kquant.py: why)."""
    rows = random_blocks("Q4_K", 16, 512, seed=1)
    packed = kquant.pack(rows, "Q4_K")  # [16, 296]
    with pytest.raises(ValueError, match=r"K = 300 needs whole super-blocks of 256"):
        kquant.kquant_linear(torch.randn(2, 300), packed, "Q4_K")
    with pytest.raises(
        ValueError,
        match=r"K = 256 needs whole super-blocks of 256 and packed rows of 148 bytes, "
        r"got 296",
    ):
        kquant.kquant_linear(torch.randn(2, 256), packed, "Q4_K")
    with pytest.raises(ValueError, match=r"packed rows of 420 bytes, got 296"):  # (Q4_K rows taken as Q6_K)
        kquant.kquant_linear(torch.randn(2, 512), packed, "Q6_K")
    with pytest.raises(ValueError, match=r"x must be a contiguous float32 \[M, K\] tensor"):
        kquant.kquant_linear(torch.randn(2, 512, dtype=torch.float64), packed, "Q4_K")
    with pytest.raises(ValueError, match=r"x must be a contiguous float32 \[M, K\] tensor"):
        kquant.kquant_linear(torch.randn(2, 512).bfloat16(), packed, "Q4_K")
    with pytest.raises(ValueError, match=r"x must be a contiguous float32 \[M, K\] tensor"):
        kquant.kquant_linear(torch.randn(512), packed, "Q4_K")
    with pytest.raises(ValueError, match=r"w must be a contiguous uint8 \[N, row bytes\] tensor"):
        kquant.kquant_linear(torch.randn(2, 512), packed.view(torch.int8), "Q4_K")
    with pytest.raises(ValueError, match=r"w must be a contiguous uint8 \[N, row bytes\] tensor"):
        kquant.kquant_linear(torch.randn(2, 512), packed[:, :148].t().contiguous().t(), "Q4_K")
    with pytest.raises(ValueError, match=r"kquant_pack: w must be a contiguous uint8 \[N, K / 256 \* 144\] tensor"):
        kquant.pack(rows[:, :200], "Q4_K")  # (not whole super-blocks)
    with pytest.raises(ValueError, match=r"kquant_pack: w must be a contiguous uint8 \[N, K / 256 \* 210\] tensor"):
        kquant.pack(rows, "Q6_K")  # (288 bytes: not whole Q6_K blocks)
    with pytest.raises(ValueError, match=r"kquant_pack: w must be a contiguous uint8"):
        kquant.pack(rows.float(), "Q4_K")
    # the 32-value block types: K a multiple of 32, rows padded to whole super-blocks
    rows8 = random_blocks("Q8_0", 16, 896, seed=2)  # [16, 28 · 34]
    packed8 = kquant.pack(rows8, "Q8_0")
    assert packed8.shape == (16, 4 * 272)
    with pytest.raises(ValueError, match=r"K = 900 needs whole blocks of 32 and packed rows of 1088 bytes, got 1088"):
        kquant.kquant_linear(torch.randn(2, 900), packed8, "Q8_0")
    with pytest.raises(ValueError, match=r"K = 1152 needs whole blocks of 32 and packed rows of 1360 bytes, got 1088"):
        kquant.kquant_linear(torch.randn(2, 1152), packed8, "Q8_0")
    with pytest.raises(ValueError, match=r"K = 896 needs whole blocks of 32 and packed rows of 704 bytes, got 1088"):
        kquant.kquant_linear(torch.randn(2, 896), packed8, "Q5_0")  # (Q8_0 rows taken as Q5_0)
    with pytest.raises(ValueError, match=r"kquant_pack: w must be a contiguous uint8 \[N, K / 32 \* 34\] tensor"):
        kquant.pack(rows8[:, :100], "Q8_0")  # (not whole blocks)
    with pytest.raises(ValueError, match=r"kquant_pack: w must be a contiguous uint8 \[N, K / 32 \* 22\] tensor"):
        kquant.pack(rows8, "Q5_0")  # (952 bytes: not whole Q5_0 blocks)
    with pytest.raises(ValueError, match=r"the kquant kernel takes Q4_K, Q6_K, Q8_0, Q5_0 blocks, not 'Q4_0'"):
        kquant.pack(rows8, "Q4_0")


# The C++ ops' own checks (the last guard, behind the wrappers), run in a child process: on a torch build where an
# extension's exception kills the process (kquant.py's docstring), this fails alone instead of ending the session.
CPP_CHECKS = r"""
import sys
import torch
from redwood.cpu_kernels import kquant
from tests.cpu_kernels.test_kquant import random_blocks
rows = random_blocks("Q4_K", 16, 512, seed=1)
packed = kquant.pack(rows, "Q4_K")
packed8 = kquant.pack(random_blocks("Q8_0", 16, 896, seed=2), "Q8_0")
for name in sys.argv[1:]:
    op = kquant.ops(name)
    for call in (lambda: op.kquant_linear(torch.randn(2, 512), packed, 13),
                 lambda: op.kquant_linear(torch.randn(2, 256), packed, 12),
                 lambda: op.kquant_pack(rows, 10),
                 lambda: op.kquant_linear(torch.randn(2, 900), packed8, 8),
                 lambda: op.kquant_pack(rows[:, :100], 8)):
        try:
            call()
            print("no error")
        except RuntimeError as e:
            print(str(e).splitlines()[0])
"""


def test_the_cpp_ops_check_their_arguments_too():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    names = [v for v in kquant.supported() if kquant.variant_unavailable(v) is None]
    out = subprocess.run(
        [sys.executable, "-c", CPP_CHECKS, *names],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": f"{root / 'src'}:{root}"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 5 * len(names) and names, (names, lines)
    for i in range(0, len(lines), 5):
        assert "type must be Q4_K (12), Q6_K (14), Q8_0 (8) or Q5_0 (6), got 13" in lines[i]
        assert "K = 256 needs whole super-blocks of 256 and packed rows of 148 bytes, got 296" in lines[i + 1]
        assert "kquant_pack: type must be Q4_K (12), Q6_K (14), Q8_0 (8) or Q5_0 (6), got 10" in lines[i + 2]
        assert "K = 900 needs whole blocks of 32 and packed rows of 1088 bytes, got 1088" in lines[i + 3]
        assert "kquant_pack: w must be a contiguous uint8 [N, K / 32 * 34] tensor" in lines[i + 4]


def test_kernel_order_is_a_permutation_that_keeps_each_lane_in_16_values():
    order = kquant.kernel_order()
    assert order.dtype == torch.int64 and order.shape == (256,)
    assert torch.equal(order.sort().values, torch.arange(256))
    # position 64c + 4l + t holds value 16l + 4c + t: the 4 bytes of 32-bit lane l of any of the 4
    # vectors lie in values 16l..16l+15 (one Q6_K scale, half a Q4_K sub-block)
    lanes = order.view(4, 16, 4)  # [c, l, t]
    assert torch.equal(lanes // 16, torch.arange(16)[None, :, None].expand(4, 16, 4))
    assert torch.equal(kquant.kernel_order()[[0, 1, 4, 63, 64, 255]], torch.tensor([0, 1, 16, 243, 4, 255]))


def test_availability_is_reported():
    assert kquant.available() and kquant.why_unavailable() is None
    assert kquant.variant() in kquant.AUTO and kquant.chosen() == kquant.variant()
    assert kquant.ops().variant() == kquant.variant()  # (the build computes with its variant's code)
    assert kquant.BLOCK == 256 and set(kquant.TYPES) == {"Q4_K", "Q6_K", "Q8_0", "Q5_0"}


def test_each_build_runs_its_own_code(kquant_variant):
    assert kquant.ops(kquant_variant).variant() == kquant_variant == kquant.variant()


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_every_variant_gives_the_same_bits(type_name):
    """Against the first (fastest) variant: packing, the product at M = 1..9 and 17 (row tiles of 8 and their tails),
    rows of zeros and ties, outliers, large and tiny scales, and weights at the extremes of the AVX2 saturation bound
    (every q at its maximum against activations of ±127)."""
    names = [v for v in kquant.supported() if kquant.variant_unavailable(v) is None]
    if len(names) < 2:
        pytest.skip(f"one kquant build runs here ({names})")
    N, K = 61, 1536 if kquant.FILE_BLOCK[type_name] == 256 else 1504  # (1504: 5.875 super-blocks, padded)
    rows = random_blocks(type_name, N, K, seed=21, d_range=(1e-4, 4.0))
    full = rows.view(N, K // kquant.FILE_BLOCK[type_name], FILE_BYTES[type_name]).clone()
    if type_name == "Q4_K":
        full[:5, :, 16:] = 0xFF  # q = 15 everywhere (rows 0-4)
        full[:5, :, 4:16] = 0xFF  # scales / mins 63
    elif type_name == "Q6_K":
        full[:5, :, :192] = 0xFF  # q = 63 everywhere
    elif type_name == "Q8_0":
        full[:3, :, 2:] = 0x80  # q = −128 everywhere (rows 0-2): |w| = 128, the largest sign-transfer operand
        full[3:5, :, 2:] = 0x7F  # q = 127 (rows 3-4)
    else:
        full[:3, :, 2:] = 0  # q = 0: w = −16 everywhere (rows 0-2)
        full[3:5, :, 2:] = 0xFF  # q = 31: w = 15 (rows 3-4)
    rows = full.view(N, -1)
    x = torch.cat([activations(9, K, seed=7), torch.randn(8, K) * 1e-3])  # (rows 3-4: ±127 below)
    x[3], x[4] = 127.0, -127.0  # q = ±127 throughout: the largest |sums| of a lane's byte pairs
    x[5] = 1e20 * torch.randn(K)  # huge values
    packed = {v: kquant.pack(rows, type_name, variant=v) for v in names}
    ys = {v: kquant.kquant_linear(x, packed[names[0]], type_name, variant=v) for v in names}
    for v in names[1:]:
        assert torch.equal(packed[v], packed[names[0]]), v
        assert torch.equal(ys[v], ys[names[0]]), (v, (ys[v] - ys[names[0]]).abs().max())
        for m in list(range(1, 10)) + [17]:
            assert torch.equal(kquant.kquant_linear(x[:m], packed[v], type_name, variant=v), ys[v][:m]), (v, m)
    # the saturation rows against the exact product (float64 of the quantized activations): no lane wrapped
    w = dequantize(rows, type_name, (N, K)).double()
    ref = quantize_reference(x[3:5]) @ w[:5].T
    assert ((ys[names[0]][3:5, :5].double() - ref).abs() <= 1e-5 * ref.abs().max()).all()
