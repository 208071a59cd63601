// GGUF weights (the K-quants Q4_K, Q6_K; the 32-value block types Q8_0, Q5_0) times int8-quantized activations with
// integer dot products: the torch-free core (kquant.h; the operators in ops.cpp), one build per variant (AVX-512
// VNNI, AVX-VNNI, AVX2, NEON, portable: kq_simd.h).
//
//   kquant_linear(x float32 [M, K], w uint8 [N, ceil(K / 256) * B], type) -> float32 [M, N]
//   kquant_pack(w uint8 [N, K / file block * file block bytes], type) -> uint8 [N, ceil(K / 256) * B]
// (ops.cpp's operators, in the variant's namespace redwood_kq_<variant>: kquant.py)
//
// A weight row is a run of super-blocks of 256 values holding the file's own numbers (nothing re-quantized):
//   Q4_K: value = d·sc[j]·q − dmin·mn[j] in sub-block j (32 values), q in 0..15, fp16 d / dmin, 6-bit sc / mn;
//   Q6_K: value = d·sc[j]·(q − 32) in sub-block j (16 values), q in 0..63, fp16 d, int8 sc;
//   Q8_0: value = d[j]·q in file block j (32 values; 8 a super-block), q int8, fp16 d;
//   Q5_0: value = d[j]·(q − 16) in file block j, q in 0..31 (4 low bits + 1 high bit), fp16 d.
// `kquant_pack` re-lays each super-block for the kernel (`pack_q4k`, `pack_q6k`, `pack_q8_0`, `pack_q5_0`): Q4_K in
// 148 bytes (d, dmin, sc[8] and mn[8] as bytes, 128 bytes of nibbles), Q6_K in the file's 210 (low nibbles, 2-bit
// high parts, 16 scales, d), Q8_0 in 272 (8 fp16 d, 256 int8 q) and Q5_0 in 176 (8 fp16 d, 128 bytes of nibbles,
// 32 bytes of high bits) — 8 file blocks' own bytes, re-ordered — each arranged so that 64-byte loads and masks
// give the 4 vectors of 64 values. All put the values in KERNEL ORDER: byte 4l + t of vector c holds value
// 16l + 4c + t — so 32-bit lane l of every vector belongs to the same 16 values (lane l; for Q4_K sub-block l / 2,
// for Q8_0 / Q5_0 file block l / 2), and vpdpbusd can accumulate all 4 vectors into one register before the scales
// are applied once per super-block. One layout for every variant (the 256-bit ones read each 64-byte vector as two
// 32-byte halves).
//
// K: whole super-blocks for the K-quants. Q8_0 / Q5_0 rows take any K a multiple of 32 (the 0.5B's 896 = 3.5
// super-blocks): `pack_rows` pads a row with zero blocks (d = 0, value 0) to whole super-blocks, and the
// activations past K are zeros (matmul's padding) — so the kernel has one granularity (256) and one activation
// quantization (per 256 values) for every type, the super-block machinery unchanged; the cost is the padding's
// bytes and dot products (896 → 1024: 14% more on such a row).
//
// Activations: each row is quantized per super-block (dx = max|x| / 127, q = round(x / dx) in int8, also in
// kernel order) with dx times the sums of q over each 16 values (for the Q4_K mins and the Q6_K offset), and those
// sums as integers (the Q8_0 / Q5_0 offsets on x86: kq_simd.h). A 32-bit lane's dot product is exact integer
// arithmetic; it enters a float32 accumulator once per super-block.
// Why: a token reads the file's bytes (~4.6 / 6.6 / 8.5 / 5.5 bits a weight) and multiplies with integer dot
// products instead of float FMAs.
//
// Exactness: every output (m, n) is computed by the same sequence of operations whatever M, the row tile it
// falls in and the thread split are — a verify over T rows scores each row exactly as a one-row forward. And the
// same sequence in every variant (the lane sums are exact integers; the float operations per lane and the final
// lane sum are the same IEEE operations in the same order: kq_simd.h), so the variants agree bit for bit.
#include "kquant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kq_simd.h"

namespace redwood_kq {
inline namespace KQ_VARIANT {
namespace {

constexpr int kQK = 256;       // values per super-block
constexpr int64_t kQ4K = 12;   // ggml type ids
constexpr int64_t kQ6K = 14;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ5_0 = 6;
constexpr int kQ4KFile = 144, kQ4KPacked = 148, kQ6KBytes = 210;
constexpr int kQ8_0File = 34, kQ5_0File = 22;         // one file block of 32 values
constexpr int kQ8_0Packed = 272, kQ5_0Packed = 176;   // one kernel super-block of 8 of them (the file's bytes)
#ifndef KQ_ROW_TILE
// 8 in every build: on AVX2 too, though 8 rows' accumulators (16 ymm) spill — the weight side (decoding a
// block's nibbles, its scales) costs more than the spills: 8 rows against 4 took 162 / 191 ms at M = 8 and 335 /
// 388 at M = 16 on the 1.5B's matrices (benchmarks/cpu_kquant.py --isa avx2; 2 rows: 1.4× slower than 4)
#define KQ_ROW_TILE 8
#endif
constexpr int kRowTile = KQ_ROW_TILE;  // activation rows sharing one pass over a weight row (no effect on results)
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 2048
#endif
constexpr int kPrefetch = KQ_PREFETCH;  // bytes ahead of the super-block being read that are prefetched
#ifndef KQ_M_CHUNK
#define KQ_M_CHUNK 16
#endif
// Activation rows a pass over the weight matrix takes at most (0: all). A prefill chunk of hundreds of rows would
// stream all of its quantized activations (up to M × 8,960 bytes for the MLP's down projection: megabytes, out of
// L2) once for every weight row; in chunks of this many rows they stay in L2 while the weights — re-read once per
// chunk, from L3 or DRAM — stream past. Which outputs a pass computes changes, not how: the same bits.
constexpr int64_t kMChunk = KQ_M_CHUNK;

// kernel position p (0..255) <- value index 16·l + 4·c + t, where p = 64·c + 4·l + t
inline int value_at(int p) { return 16 * ((p & 63) >> 2) + 4 * (p >> 6) + (p & 3); }

struct QuantRows {              // the activations, quantized per super-block
  std::vector<int8_t> q;        // [M, K] in kernel order
  std::vector<float> dx;        // [M, K / 256]
  std::vector<float> sum16;     // [M, K / 16]: dx · Σ q over values 16j..16j+15 of each super-block
  std::vector<int32_t> isum16;  // [M, K / 16]: Σ q over the same values (the Q8_0 / Q5_0 offsets: kq_simd.h's S)
};

QuantRows quantize(const float* x, int64_t M, int64_t K) {
  QuantRows r;
  const int64_t blocks = M * (K / kQK);
  r.q.resize(M * K);
  r.dx.resize(blocks);
  r.sum16.resize(blocks * 16);
  r.isum16.resize(blocks * 16);
  parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    int order[kQK];
    for (int p = 0; p < kQK; ++p) order[p] = value_at(p);
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = x + i * kQK;  // rows are contiguous: block i of the flat [M, K] array
      float amax = 0.f;
      for (int k = 0; k < kQK; ++k) amax = std::max(amax, std::fabs(xb[k]));
      int8_t vals[kQK];
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int k = 0; k < kQK; ++k) vals[k] = static_cast<int8_t>(std::nearbyint(xb[k] * inv));
      r.dx[i] = amax / 127.f;
      int8_t* qb = r.q.data() + i * kQK;
      for (int p = 0; p < kQK; ++p) qb[p] = vals[order[p]];
      for (int j = 0; j < 16; ++j) {
        int32_t s = 0;
        for (int k = 0; k < 16; ++k) s += vals[16 * j + k];
        r.sum16[i * 16 + j] = static_cast<float>(s) * r.dx[i];
        r.isum16[i * 16 + j] = s;
      }
    }
  });
  return r;
}

inline void prefetch_block(const uint8_t* blk, int bytes) {
  if (kPrefetch)
    for (int l = 0; l < bytes; l += 64) simd::prefetch(blk + kPrefetch + l);
}

// Each kernel below decodes a super-block's weight side once for the R activation rows of a tile: the 4 vectors
// of q, `scale` (lane l: the multiplier of its integer sum) and `offset` (what each unit of the lane's activation
// sum costs: Q4_K dmin·mn, Q6_K 32·d·sc). The row side of super-block b, shared by both block types: per row,
// `simd::dot` gives lane l's integer dot product over its 16 values (wv: the block's 4 weight vectors; kMaxQ the
// largest weight, for the AVX2 saturation bound), then
// acc += float(isum)·(scale·dx) − offset·(dx·Σq over the lane's 16 values).
template <int R, int kMaxQ>
inline void accumulate_rows(simd::F32 (&acc)[R], const simd::Q& wv, simd::F32 scale, simd::F32 offset,
                            const QuantRows& a, int64_t m0, int64_t b, int64_t nb, int64_t K) {
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r, i = m * nb + b;
    const int8_t* xq = a.q.data() + m * K + b * kQK;
    const simd::I32 isum = simd::dot<kMaxQ>(wv, xq);
    acc[r] = simd::fmadd(simd::to_float(isum), simd::mul(scale, simd::set1(a.dx[i])), acc[r]);
    acc[r] = simd::fnmadd(offset, simd::load(a.sum16.data() + i * 16), acc[r]);
  }
}

template <int R>
void q4k_rows(const uint8_t* wrow, int64_t nb, const QuantRows& a, int64_t m0, int64_t K, float* out,
              int64_t ldo) {
  simd::F32 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = simd::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * kQ4KPacked;
    prefetch_block(blk, kQ4KPacked);
    simd::F32 scale, offset;
    simd::q4k_scales(blk, scale, offset);
    const simd::Q wv = simd::decode_q4k(blk);
    accumulate_rows<R, 15>(acc, wv, scale, offset, a, m0, b, nb, K);
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = simd::sum(acc[r]);
}

template <int R>
void q6k_rows(const uint8_t* wrow, int64_t nb, const QuantRows& a, int64_t m0, int64_t K, float* out,
              int64_t ldo) {
  simd::F32 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = simd::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * kQ6KBytes;
    prefetch_block(blk, kQ6KBytes);
    simd::F32 scale, offset;
    simd::q6k_scales(blk, scale, offset);
    // ql: byte 64h + t holds positions 128h + t (low nibble) and 128h + 64 + t (high); qh: byte t holds the 2
    // high bits of positions t, 64 + t, 128 + t, 192 + t (bits 0-1, 2-3, 4-5, 6-7)
    const simd::Q wv = simd::decode_q6k(blk);
    accumulate_rows<R, 63>(acc, wv, scale, offset, a, m0, b, nb, K);
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = simd::sum(acc[r]);
}

// Q8_0 / Q5_0: the super-block's weights (`simd::S`), one integer dot product per lane (`simd::sdot`: Σ w·x over the
// lane's 16 values, exact in every variant — x86 multiplies unsigned bytes and takes the offset off in the integers,
// kq_simd.h) and acc += float(isum)·(d[l / 2]·dx) — no float offset term: Q5_0's q − 16 and Q8_0's sign are taken
// in the integers, so nothing cancels in float32 (|isum| ≤ 16 · 128 · 127 < 2^24: its float is exact).
template <int R, bool kQ5>
void q32_rows(const uint8_t* wrow, int64_t nb, const QuantRows& a, int64_t m0, int64_t K, float* out,
              int64_t ldo) {
  constexpr int kBytes = kQ5 ? kQ5_0Packed : kQ8_0Packed;
  simd::F32 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = simd::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * kBytes;
    prefetch_block(blk, kBytes);
    const simd::F32 scale = simd::d32_scales(blk);
    const simd::S wv = kQ5 ? simd::decode_q5_0(blk) : simd::decode_q8_0(blk);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, i = m * nb + b;
      const simd::I32 isum = simd::sdot<kQ5>(wv, a.q.data() + m * K + b * kQK, a.isum16.data() + i * 16);
      acc[r] = simd::fmadd(simd::to_float(isum), simd::mul(scale, simd::set1(a.dx[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = simd::sum(acc[r]);
}

using RowsFn = void (*)(const uint8_t*, int64_t, const QuantRows&, int64_t, int64_t, float*, int64_t);

template <int R>
RowsFn pick(int64_t type) {
  switch (type) {
    case kQ4K: return q4k_rows<R>;
    case kQ6K: return q6k_rows<R>;
    case kQ8_0: return q32_rows<R, false>;
    default: return q32_rows<R, true>;  // (kQ5_0: the callers check the type)
  }
}

template <int... Rs>
struct RowFns {
  static void fill(int64_t type, RowsFn* fns) {
    int i = 0;
    ((fns[i++] = pick<Rs>(type)), ...);
  }
};

// out[m·ldo + n] = Σ_k x[m, k]·W[n, k] over whole super-blocks (see redwood_kq::matmul in kquant.h)
void matmul_rows(const float* x, int64_t M, int64_t k_in, int64_t ldx, const uint8_t* wp, int64_t N,
                 int64_t row_bytes, int64_t type, float* op, int64_t ldo) {
  const int64_t nb = row_bytes / block_bytes(type), K = nb * kQK;
  if (M == 0 || N == 0) return;
  std::vector<float> padded;  // rows of K values (zeros past k_in) where x is not already that
  if (k_in != K || ldx != K) {
    padded.assign(M * K, 0.f);
    for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * K, x + m * ldx, k_in * sizeof(float));
    x = padded.data();
  }
  const QuantRows a = quantize(x, M, K);
  RowsFn fns[8];
  static_assert(kRowTile == 4 || kRowTile == 8, "row tiles of 4 or 8");
  if constexpr (kRowTile == 8) RowFns<1, 2, 3, 4, 5, 6, 7, 8>::fill(type, fns);
  else RowFns<1, 2, 3, 4>::fill(type, fns);
  const int64_t chunk = kMChunk > 0 ? kMChunk : M;
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t c1 = std::min(M, c0 + chunk);
    parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* wrow = wp + n * row_bytes;
        for (int64_t m0 = c0; m0 < c1; m0 += kRowTile) {
          const int64_t rows = std::min<int64_t>(kRowTile, c1 - m0);
          fns[rows - 1](wrow, nb, a, m0, K, op + m0 * ldo + n, ldo);
        }
      }
    });
  }
}

// The kernel's layouts, from the file's (positions p = kernel order, `value_at`):
//   Q4_K: d, dmin, sc[8], mn[8], then 128 bytes: byte 64h + t has position 128h + t in its low nibble and
//         128h + 64 + t in its high nibble;
//   Q6_K: 128 bytes of low nibbles (byte 64h + t: positions 128h + t low, 128h + 64 + t high), 64 bytes of
//         high bits (byte t: positions t, 64 + t, 128 + t, 192 + t in bits 0-1, 2-3, 4-5, 6-7), sc[16], d.
void pack_q4k(const uint8_t* s, uint8_t* o) {
  std::memcpy(o, s, 4);  // d, dmin
  const uint8_t* k = s + 4;
  for (int j = 0; j < 4; ++j) {  // the 6-bit fields: sc / mn 0-3 in the low bits of bytes 0-7, 4-7 split
    o[4 + j] = k[j] & 63;
    o[12 + j] = k[j + 4] & 63;
    o[8 + j] = (k[j + 8] & 0x0F) | ((k[j] >> 6) << 4);
    o[16 + j] = (k[j + 8] >> 4) | ((k[j + 4] >> 6) << 4);
  }
  uint8_t q[kQK];  // by value; the file: each 32 bytes give sub-block 2i (low nibbles) and 2i + 1 (high)
  for (int i = 0; i < 4; ++i)
    for (int l = 0; l < 32; ++l) {
      q[64 * i + l] = s[16 + 32 * i + l] & 0x0F;
      q[64 * i + 32 + l] = s[16 + 32 * i + l] >> 4;
    }
  uint8_t* qs = o + 20;
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 64; ++t)
      qs[64 * h + t] = q[value_at(128 * h + t)] | (q[value_at(128 * h + 64 + t)] << 4);
}

void pack_q6k(const uint8_t* s, uint8_t* o) {
  uint8_t q[kQK];  // by value; the file: value 128h + p takes its low nibble from ql[64h + p % 64] (low
                   // nibble for p < 64, high above) and its high bits from qh[32h + p % 32], bits 2·(p / 32)
  for (int v = 0; v < kQK; ++v) {
    const int h = v >> 7, p = v & 127;
    const uint8_t lo = (s[64 * h + (p & 63)] >> (p < 64 ? 0 : 4)) & 0x0F;
    const uint8_t hi = (s[128 + 32 * h + (p & 31)] >> (2 * (p >> 5))) & 3;
    q[v] = lo | (hi << 4);
  }
  std::memset(o, 0, 192);
  for (int pos = 0; pos < kQK; ++pos) {
    const uint8_t v = q[value_at(pos)];
    const int h = pos >> 7, p = pos & 127;
    o[64 * h + (p & 63)] |= (v & 0x0F) << (p < 64 ? 0 : 4);
    o[128 + (pos & 63)] |= (v >> 4) << (2 * (pos >> 6));
  }
  std::memcpy(o + 192, s + 192, 18);  // scales, d
}

// Q8_0 / Q5_0: up to 8 file blocks (`have`, consecutive at s; the rest of the super-block zero blocks: d = 0,
// value 0) as one kernel super-block:
//   Q8_0: d[8] (the files' fp16), then 256 int8 q by kernel position;
//   Q5_0: d[8], 128 bytes of nibbles as Q4_K's (byte 64h + t: position 128h + t low, 128h + 64 + t high), then 32
//         bytes of high bits (bit k of byte t: position 32k + t), q = nibble | high << 4 in 0..31, value (q − 16)·d.
// The file: Q8_0 = fp16 d, 32 int8; Q5_0 = fp16 d, a little-endian uint32 of high bits (bit i: value i), 16 bytes
// of nibbles (values 0-15 low, 16-31 high).
void pack_q8_0(const uint8_t* s, int have, uint8_t* o) {
  int8_t q[kQK] = {};  // by value
  std::memset(o, 0, 16);
  for (int j = 0; j < have; ++j) {
    std::memcpy(o + 2 * j, s + kQ8_0File * j, 2);
    std::memcpy(q + 32 * j, s + kQ8_0File * j + 2, 32);
  }
  for (int p = 0; p < kQK; ++p) o[16 + p] = static_cast<uint8_t>(q[value_at(p)]);
}

void pack_q5_0(const uint8_t* s, int have, uint8_t* o) {
  uint8_t q[kQK];  // by value, 0..31; padding 16 (value 0)
  std::memset(q, 16, sizeof(q));
  std::memset(o, 0, kQ5_0Packed);
  for (int j = 0; j < have; ++j) {
    const uint8_t* b = s + kQ5_0File * j;
    std::memcpy(o + 2 * j, b, 2);
    const uint32_t qh = uint32_t{b[2]} | uint32_t{b[3]} << 8 | uint32_t{b[4]} << 16 | uint32_t{b[5]} << 24;
    for (int i = 0; i < 32; ++i) {
      const uint8_t nib = i < 16 ? (b[6 + i] & 0x0F) : (b[6 + i - 16] >> 4);
      q[32 * j + i] = static_cast<uint8_t>(nib | (((qh >> i) & 1u) << 4));
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 64; ++t)
      o[16 + 64 * h + t] = (q[value_at(128 * h + t)] & 0x0F) | ((q[value_at(128 * h + 64 + t)] & 0x0F) << 4);
  for (int pos = 0; pos < kQK; ++pos) o[144 + (pos & 31)] |= (q[value_at(pos)] >> 4) << (pos >> 5);
}

}  // namespace

#define KQ_STR2(x) #x
#define KQ_STR(x) KQ_STR2(x)
const char* variant() { return KQ_STR(KQ_VARIANT); }

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4K: return kQ4KPacked;
    case kQ6K: return kQ6KBytes;
    case kQ8_0: return kQ8_0Packed;
    case kQ5_0: return kQ5_0Packed;
    default: return -1;
  }
}

int64_t file_block_values(int64_t type) {
  return type == kQ4K || type == kQ6K ? kQK : type == kQ8_0 || type == kQ5_0 ? 32 : -1;
}

int64_t file_block_bytes(int64_t type) {
  switch (type) {
    case kQ4K: return kQ4KFile;
    case kQ6K: return kQ6KBytes;
    case kQ8_0: return kQ8_0File;
    case kQ5_0: return kQ5_0File;
    default: return -1;
  }
}

void matmul(const float* x, int64_t M, int64_t k_in, int64_t ldx, const uint8_t* w, int64_t N, int64_t row_bytes,
            int64_t type, float* out, int64_t ldo) {
  matmul_rows(x, M, k_in, ldx, w, N, row_bytes, type, out, ldo);
}

void pack_rows(const uint8_t* src, int64_t N, int64_t file_row_bytes, int64_t type, uint8_t* dst) {
  const int64_t fb = file_block_bytes(type), per = kQK / file_block_values(type);  // file blocks a super-block
  const int64_t blocks = file_row_bytes / fb, nb = (blocks + per - 1) / per, bb = block_bytes(type);
  parallel_for(0, N * nb, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / nb, b = i % nb;
      const uint8_t* s = src + n * file_row_bytes + b * per * fb;
      uint8_t* o = dst + i * bb;
      const int have = static_cast<int>(std::min<int64_t>(per, blocks - b * per));
      switch (type) {
        case kQ4K: pack_q4k(s, o); break;
        case kQ6K: pack_q6k(s, o); break;
        case kQ8_0: pack_q8_0(s, have, o); break;
        default: pack_q5_0(s, have, o); break;
      }
    }
  });
}

}  // namespace KQ_VARIANT
}  // namespace redwood_kq
