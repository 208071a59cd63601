// One pre-norm decoder layer (Llama / Qwen2 shape) for a few new tokens on the CPU, in one call:
//
//   decoder_layer(x, weights, types, biases, groups, norm1, norm2, eps, cos, sin, k_buf, v_buf, write_at,
//                 block_table, tokens_per_row, range_ptr, ranges, num_heads, num_kv_heads)
//
//   h = rms_norm(x; norm1);  q | k | v = h · [Wq; Wk; Wv]ᵀ + b;  rotate q, k (rotate-half);  store k, v in the
//   paged cache;  a = attention of each query over the slots its ranges name;  x += a · Woᵀ + bo;
//   h = rms_norm(x; norm2);  x += (silu(h · Wgᵀ + bg) * (h · Wuᵀ + bu)) · Wdᵀ + bd
//
// Every projection is a kquant product (kquant.h: the GGUF file's Q4_K / Q6_K blocks × int8 activations). This file
// is the torch-free core, one build per variant (kq_simd.h's operations: the same bits in every variant); ops.cpp
// checks the tensors and calls it.
// Why one call: besides those products, a decode step spent a large share of its time in the ~25 PyTorch ops a
// layer and the Python between them (norms, bias adds, rotary, the cache write and page gather, attention's
// matmuls and softmax, SiLU, residual adds: each a dispatch and an allocation over a few KB). Here they are
// loops over the same few KB. (The profile: docs/perf/cpu.md, session 17.)
//
// Shapes: x float32 [M, H] (M = B·T new tokens, row-major over (b, t)), updated in place (the residual stream);
// weights: the layer's packed projections in order — `groups[0]` tensors whose outputs side by side are
// q | k | v, o, `groups[1]` tensors giving gate | up, down — with their ggml types and float32 biases (or None);
// cos, sin float32 [M, D]; k_buf, v_buf float32 [pages, Hkv, page_size, D] (this layer's cache); write_at int64
// [M, 2] (page, offset) where each new token's k / v go; block_table int32 [B, W]; token m belongs to row
// m / tokens_per_row; its keys are the logical slots of ranges[range_ptr[m] .. range_ptr[m + 1]) (int64 [R, 2]
// half-open), read in that order through the row's table (slot s: page table[b, s / page_size], offset s %
// page_size). A query with no keys outputs zeros.
//
// Exactness: each output row is computed by the same sequence of operations whatever M, the thread count and
// which other queries share the call (the kquant product's rows are exact; norms, rotary, attention and SiLU
// here are per row / per query loops), so a verify over T tokens scores each exactly as T decode steps do —
// and a query's keys split over several ranges (a tree verify's context + ancestors) are summed in the same
// order as one contiguous range over the same values.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kq_simd.h"
#include "kquant.h"

namespace redwood_kq {
inline namespace KQ_VARIANT {
namespace {

using simd::F32;

// e^x for x in [-87.3, 88.7] (clamped there): 2^n · e^r with n = round(x · log2 e), r = x − n · ln 2 (ln 2 in
// two parts), e^r by its Taylor series to r^7 (|r| ≤ ln2 / 2: truncation < 6e-9 relative, below float32's ulp).
// (n is then in [−126, 128]: simd::scale_pow2's range.)
inline F32 exp16(F32 x) {
  x = simd::min(simd::max(x, simd::set1(-87.3f)), simd::set1(88.7f));
  const F32 n = simd::round_even(simd::mul(x, simd::set1(simd::kLog2e)));
  F32 r = simd::fnmadd(n, simd::set1(0.693359375f), x);
  r = simd::fnmadd(n, simd::set1(-2.12194440e-4f), r);
  const float c[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  F32 p = simd::set1(c[0]);
  for (int i = 1; i < 8; ++i) p = simd::fmadd(p, r, simd::set1(c[i]));
  return simd::scale_pow2(p, n);
}

// Σ a[i]·b[i] over n values: 16 lanes of FMAs in index order, then the lanes' tree sum.
inline float dot(const float* a, const float* b, int64_t n) {
  F32 acc = simd::zero();
  for (int64_t i = 0; i < n; i += 16) acc = simd::fmadd(simd::load_n(a + i, n - i), simd::load_n(b + i, n - i), acc);
  return simd::sum(acc);
}

// out = x · rsqrt(mean(x²) + eps) · w, one row of n values
void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float r = 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

// The rotate-half rotary of one head in place: x · cos + rotate_half(x) · sin, rotate_half(x) = (−x2, x1).
void rotate(float* x, const float* cs, const float* sn, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = x[i], x2 = x[i + h];
    x[i] = x1 * cs[i] + (-x2) * sn[i];
    x[i + h] = x2 * cs[i + h] + x1 * sn[i + h];
  }
}

// y[m·ldy + col0 + n] = x[m] · Wᵀ (+ bias) for each member of a group, side by side from col0
int64_t project(const std::vector<Projection>& group, const float* x, int64_t M, int64_t k_in, float* y, int64_t ldy,
                int64_t col0) {
  for (const Projection& p : group) {
    matmul(x, M, k_in, k_in, p.w, p.n, p.row_bytes, p.type, y + col0, ldy);
    if (p.bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < p.n; ++n) y[m * ldy + col0 + n] += p.bias[n];
    col0 += p.n;
  }
  return col0;
}

}  // namespace

void decoder_layer(const LayerArgs& a) {
  const int64_t M = a.M, H = a.H, Hq = a.num_heads, Hkv = a.num_kv_heads, ps = a.page_size, D = a.head_dim;
  const int64_t Nq = Hq * D, Nkv = Hkv * D, Nqkv = Nq + 2 * Nkv, W = a.table_width;
  int64_t Ngu = 0;
  for (const Projection& p : a.gate_up) Ngu += p.n;
  const int64_t F = Ngu / 2;
  float* xs = a.x;
  float* kb = a.k_buf;
  float* vb = a.v_buf;
  const float* cs = a.cos;
  const float* sn = a.sin;
  const int64_t* rp = a.range_ptr;
  const int64_t* rg = a.ranges;
  const int32_t* bt = a.block_table;
  const int64_t* wa = a.write_at;
  const int64_t tokens_per_row = a.tokens_per_row;

  // attention block: norm → q|k|v (+ bias) → rotary → cache write
  std::vector<float> h(M * H), qkvs(M * Nqkv);
  for (int64_t m = 0; m < M; ++m) rms_norm(xs + m * H, a.norm1, a.eps, H, h.data() + m * H);
  project(a.qkv, h.data(), M, H, qkvs.data(), Nqkv, 0);
  for (int64_t m = 0; m < M; ++m) {
    float* row = qkvs.data() + m * Nqkv;
    for (int64_t hd = 0; hd < Hq + Hkv; ++hd) rotate(row + hd * D, cs + m * D, sn + m * D, D);
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t pos = (wa[2 * m] * Hkv + g) * ps + wa[2 * m + 1];
      std::memcpy(kb + pos * D, row + Nq + g * D, D * sizeof(float));
      std::memcpy(vb + pos * D, row + Nq + Nkv + g * D, D * sizeof(float));
    }
  }

  // attention, one (token, KV head) at a time: for each of the G query heads sharing the KV head, softmax(q·k / √D)
  // over the token's keys, times v. The G heads walk the keys together (each key's k and v rows read once for all
  // G: a sixth of the cache reads on the 1.5B's 12 / 2 heads), but each head's numbers are its own sequence of
  // operations, the same as one head alone — whatever M, the thread split or how the heads are grouped.
  std::vector<float> att(M * Nq);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t G = Hq / Hkv;
  parallel_for(0, M * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;       // [G, n]: head i's scores, then its softmax numerators
    std::vector<int64_t> rows;  // the keys' rows of this KV head in k_buf / v_buf, in key order
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / Hkv, g = task % Hkv, b = m / tokens_per_row;
      const float* q = qkvs.data() + m * Nqkv + g * G * D;  // the group's G query heads, side by side
      float* out = att.data() + m * Nq + g * G * D;
      rows.clear();
      for (int64_t r = rp[m]; r < rp[m + 1]; ++r)
        for (int64_t slot = rg[2 * r]; slot < rg[2 * r + 1]; ++slot)
          rows.push_back((static_cast<int64_t>(bt[b * W + slot / ps]) * Hkv + g) * ps + slot % ps);
      const int64_t n = static_cast<int64_t>(rows.size());
      if (n == 0) {
        std::fill(out, out + G * D, 0.f);
        continue;
      }
      s.resize(G * n);
      for (int64_t j = 0; j < n; ++j) {
        const float* k = kb + rows[j] * D;
        for (int64_t i = 0; i < G; ++i) s[i * n + j] = dot(q + i * D, k, D) * scale;
      }
      std::vector<float> inv(G);
      for (int64_t i = 0; i < G; ++i) {
        float* si = s.data() + i * n;
        float mx = si[0];
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, si[j]);
        F32 sum16 = simd::zero();
        for (int64_t j = 0; j < n; j += 16) {
          const F32 e = exp16(simd::sub(simd::load_n(si + j, n - j), simd::set1(mx)));
          simd::store_n(si + j, e, n - j);
          sum16 = simd::add(sum16, simd::keep_n(e, n - j));
        }
        inv[i] = 1.f / simd::sum(sum16);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vb + rows[j] * D;
        for (int64_t i = 0; i < G; ++i) {
          const F32 p = simd::set1(s[i * n + j] * inv[i]);
          float* ai = acc.data() + i * D;
          for (int64_t d = 0; d < D; d += 16)
            simd::store_n(ai + d, simd::fmadd(p, simd::load_n(v + d, D - d), simd::load_n(ai + d, D - d)), D - d);
        }
      }
      std::copy(acc.begin(), acc.end(), out);
    }
  });

  // x += a · Woᵀ + bo
  std::vector<float> y(M * std::max(H, Ngu));
  project({a.o}, att.data(), M, Nq, y.data(), H, 0);
  for (int64_t j = 0; j < M * H; ++j) xs[j] = xs[j] + y[j];

  // MLP block: norm → gate|up (+ bias) → silu(gate) · up → down (+ bias) → residual
  for (int64_t m = 0; m < M; ++m) rms_norm(xs + m * H, a.norm2, a.eps, H, h.data() + m * H);
  project(a.gate_up, h.data(), M, H, y.data(), Ngu, 0);
  std::vector<float> act(M * F);
  for (int64_t m = 0; m < M; ++m) {
    const float* gt = y.data() + m * Ngu;
    const float* up = gt + F;
    float* out = act.data() + m * F;
    for (int64_t f = 0; f < F; f += 16) {  // silu(g) = g / (1 + e^−g)
      const F32 g = simd::load_n(gt + f, F - f);
      const F32 silu = simd::div(g, simd::add(simd::set1(1.f), exp16(simd::sub(simd::zero(), g))));
      simd::store_n(out + f, simd::mul(silu, simd::load_n(up + f, F - f)), F - f);
    }
  }
  project({a.down}, act.data(), M, F, y.data(), H, 0);
  for (int64_t j = 0; j < M * H; ++j) xs[j] = xs[j] + y[j];
}

}  // namespace KQ_VARIANT
}  // namespace redwood_kq
