// One pre-norm decoder layer (Llama / Qwen2 shape) for a few new tokens on the CPU, in one call:
//
//   redwood_cpu::decoder_layer(x, weights, types, biases, groups, norm1, norm2, eps, cos, sin, k_buf, v_buf,
//                              write_at, block_table, tokens_per_row, range_ptr, ranges, num_heads, num_kv_heads)
//
//   h = rms_norm(x; norm1);  q | k | v = h · [Wq; Wk; Wv]ᵀ + b;  rotate q, k (rotate-half);  store k, v in the
//   paged cache;  a = attention of each query over the slots its ranges name;  x += a · Woᵀ + bo;
//   h = rms_norm(x; norm2);  x += (silu(h · Wgᵀ + bg) * (h · Wuᵀ + bu)) · Wdᵀ + bd
//
// Every projection is a kquant product (kquant.h: the GGUF file's Q4_K / Q6_K blocks × int8 activations).
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
#include "kquant.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// e^x for x in [-87.3, 88.7] (clamped there): 2^n · e^r with n = round(x · log2 e), r = x − n · ln 2 (ln 2 in
// two parts), e^r by its Taylor series to r^7 (|r| ≤ ln2 / 2: truncation < 6e-9 relative, below float32's ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  const float c[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// Σ a[i]·b[i] over n values: 16 lanes of FMAs in index order, then the lanes' tree sum.
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
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

struct Proj {
  const uint8_t* w;
  int64_t n, row_bytes, type;
  const float* bias;
};

// y[m·ldy + col0 + n] = x[m] · Wᵀ (+ bias) for each member of a group, side by side from col0
int64_t project(const std::vector<Proj>& group, const float* x, int64_t M, int64_t k_in, float* y, int64_t ldy,
                int64_t col0) {
  for (const Proj& p : group) {
    redwood_kq::matmul(x, M, k_in, k_in, p.w, p.n, p.row_bytes, p.type, y + col0, ldy);
    if (p.bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < p.n; ++n) y[m * ldy + col0 + n] += p.bias[n];
    col0 += p.n;
  }
  return col0;
}

Proj proj_of(const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& bias, int64_t k_in,
             const char* what) {
  const int64_t bb = redwood_kq::block_bytes(type);
  TORCH_CHECK(bb > 0, "decoder_layer: ", what, ": type must be Q4_K (12) or Q6_K (14), got ", type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % bb == 0 &&
                  w.size(1) / bb * 256 >= k_in && w.size(1) / bb * 256 < k_in + 256,
              "decoder_layer: ", what, " must be contiguous uint8 [N, K / 256 · ", bb, "] rows for ", k_in,
              " inputs");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "decoder_layer: ", what, "'s bias must be float32 [", w.size(0), "]");
    b = bias->data_ptr<float>();
  }
  return {w.data_ptr<uint8_t>(), w.size(0), w.size(1), type, b};
}

void check_float(const at::Tensor& t, int64_t dims, const char* what) {
  TORCH_CHECK(t.dim() == dims && t.scalar_type() == at::kFloat && t.is_contiguous(), "decoder_layer: ", what,
              " must be a contiguous float32 tensor of ", dims, " dims");
}

void decoder_layer(at::Tensor x, at::TensorList weights, at::IntArrayRef types,
                   const std::vector<c10::optional<at::Tensor>>& biases, at::IntArrayRef groups,
                   const at::Tensor& norm1, const at::Tensor& norm2, double eps, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& write_at,
                   const at::Tensor& block_table, int64_t tokens_per_row, const at::Tensor& range_ptr,
                   const at::Tensor& ranges, int64_t num_heads, int64_t num_kv_heads) {
  check_float(x, 2, "x");
  check_float(k_buf, 4, "k_buf");
  check_float(v_buf, 4, "v_buf");
  const int64_t M = x.size(0), H = x.size(1), Hq = num_heads, Hkv = num_kv_heads;
  const int64_t P = k_buf.size(0), ps = k_buf.size(2), D = k_buf.size(3);
  TORCH_CHECK(v_buf.sizes() == k_buf.sizes() && k_buf.size(1) == Hkv && Hkv > 0 && Hq % Hkv == 0 && D % 2 == 0,
              "decoder_layer: k_buf / v_buf must be [pages, ", Hkv, ", page_size, D] alike, heads ", Hq, " / ", Hkv);
  check_float(cos, 2, "cos");
  check_float(sin, 2, "sin");
  TORCH_CHECK(cos.size(0) == M && cos.size(1) == D && sin.sizes() == cos.sizes(), "decoder_layer: cos / sin must be [",
              M, ", ", D, "]");
  check_float(norm1, 1, "norm1");
  check_float(norm2, 1, "norm2");
  TORCH_CHECK(norm1.numel() == H && norm2.numel() == H, "decoder_layer: norms must have ", H, " weights");
  TORCH_CHECK(groups.size() == 2 && groups[0] >= 1 && groups[1] >= 1 &&
                  static_cast<int64_t>(weights.size()) == groups[0] + groups[1] + 2 &&
                  types.size() == weights.size() && biases.size() == weights.size(),
              "decoder_layer: weights / types / biases must hold the q|k|v group, o, the gate|up group and down");
  TORCH_CHECK(write_at.dim() == 2 && write_at.size(0) == M && write_at.size(1) == 2 &&
                  write_at.scalar_type() == at::kLong && write_at.is_contiguous(),
              "decoder_layer: write_at must be int64 [", M, ", 2]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  tokens_per_row > 0 && block_table.size(0) * tokens_per_row == M,
              "decoder_layer: block_table must be int32 [B, W] with B · tokens_per_row = ", M);
  TORCH_CHECK(range_ptr.dim() == 1 && range_ptr.numel() == M + 1 && range_ptr.scalar_type() == at::kLong &&
                  range_ptr.is_contiguous() && ranges.dim() == 2 && ranges.size(1) == 2 &&
                  ranges.scalar_type() == at::kLong && ranges.is_contiguous(),
              "decoder_layer: range_ptr must be int64 [M + 1] and ranges int64 [R, 2]");
  const int64_t Nq = Hq * D, Nkv = Hkv * D, Nqkv = Nq + 2 * Nkv;

  std::vector<Proj> qkv, gate_up;
  size_t i = 0;
  for (; i < static_cast<size_t>(groups[0]); ++i) qkv.push_back(proj_of(weights[i], types[i], biases[i], H, "q|k|v"));
  const Proj o = proj_of(weights[i], types[i], biases[i], Nq, "o");
  ++i;
  for (int64_t g = 0; g < groups[1]; ++g, ++i) gate_up.push_back(proj_of(weights[i], types[i], biases[i], H, "gate|up"));
  int64_t Ngu = 0;
  for (const Proj& p : gate_up) Ngu += p.n;
  TORCH_CHECK(Ngu % 2 == 0, "decoder_layer: gate|up must have an even number of outputs");
  const int64_t F = Ngu / 2;
  const Proj down = proj_of(weights[i], types[i], biases[i], F, "down");
  int64_t Nsum = 0;
  for (const Proj& p : qkv) Nsum += p.n;
  TORCH_CHECK(Nsum == Nqkv && o.n == H && down.n == H, "decoder_layer: projection sizes do not match the heads");

  const int64_t* rp = range_ptr.data_ptr<int64_t>();
  const int64_t* rg = ranges.data_ptr<int64_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t W = block_table.size(1), R = ranges.size(0);
  TORCH_CHECK(rp[0] == 0 && rp[M] == R, "decoder_layer: range_ptr must run from 0 to ", R);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(rp[m] <= rp[m + 1], "decoder_layer: range_ptr must not decrease");
    const int64_t b = m / tokens_per_row;
    for (int64_t r = rp[m]; r < rp[m + 1]; ++r)
      TORCH_CHECK(0 <= rg[2 * r] && rg[2 * r] <= rg[2 * r + 1] && rg[2 * r + 1] <= W * ps,
                  "decoder_layer: key range [", rg[2 * r], ", ", rg[2 * r + 1], ") of token ", m, " is outside its ",
                  W * ps, " slots");
    if (m % tokens_per_row == 0)
      for (int64_t s = 0; s < W; ++s)
        TORCH_CHECK(bt[b * W + s] >= 0 && bt[b * W + s] < P, "decoder_layer: row ", b, "'s table names page ",
                    bt[b * W + s], " of ", P);
  }
  const int64_t* wa = write_at.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(0 <= wa[2 * m] && wa[2 * m] < P && 0 <= wa[2 * m + 1] && wa[2 * m + 1] < ps,
                "decoder_layer: write position of token ", m, " is outside the cache");

  float* xs = x.data_ptr<float>();
  float* kb = k_buf.data_ptr<float>();
  float* vb = v_buf.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const float epsf = static_cast<float>(eps);

  // attention block: norm → q|k|v (+ bias) → rotary → cache write
  std::vector<float> h(M * H), qkvs(M * Nqkv);
  for (int64_t m = 0; m < M; ++m) rms_norm(xs + m * H, norm1.data_ptr<float>(), epsf, H, h.data() + m * H);
  project(qkv, h.data(), M, H, qkvs.data(), Nqkv, 0);
  for (int64_t m = 0; m < M; ++m) {
    float* row = qkvs.data() + m * Nqkv;
    for (int64_t hd = 0; hd < Hq + Hkv; ++hd) rotate(row + hd * D, cs + m * D, sn + m * D, D);
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t pos = (wa[2 * m] * Hkv + g) * ps + wa[2 * m + 1];
      std::memcpy(kb + pos * D, row + Nq + g * D, D * sizeof(float));
      std::memcpy(vb + pos * D, row + Nq + Nkv + g * D, D * sizeof(float));
    }
  }

  // attention, one (token, query head) at a time: softmax(q·k / √D) over its keys, times v
  std::vector<float> att(M * Nq);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, M * Hq, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    std::vector<int64_t> rows;  // the keys' rows of this KV head in k_buf / v_buf, in key order
    std::vector<float> acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / Hq, hq = task % Hq, g = hq / (Hq / Hkv), b = m / tokens_per_row;
      const float* q = qkvs.data() + m * Nqkv + hq * D;
      float* out = att.data() + m * Nq + hq * D;
      s.clear();
      rows.clear();
      for (int64_t r = rp[m]; r < rp[m + 1]; ++r)
        for (int64_t slot = rg[2 * r]; slot < rg[2 * r + 1]; ++slot) {
          rows.push_back((static_cast<int64_t>(bt[b * W + slot / ps]) * Hkv + g) * ps + slot % ps);
          s.push_back(dot(q, kb + rows.back() * D, D) * scale);
        }
      const int64_t n = static_cast<int64_t>(s.size());
      if (n == 0) {
        std::fill(out, out + D, 0.f);
        continue;
      }
      float mx = s[0];
      for (float v : s) mx = std::max(mx, v);
      __m512 sum16 = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = tail(n - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s.data() + j), _mm512_set1_ps(mx)));
        _mm512_mask_storeu_ps(s.data() + j, k, e);
        sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(k, e));
      }
      const float inv = 1.f / _mm512_reduce_add_ps(sum16);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 p = _mm512_set1_ps(s[j] * inv);
        const float* v = vb + rows[j] * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 k = tail(D - d);
          _mm512_mask_storeu_ps(acc.data() + d, k,
                                _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(k, v + d), _mm512_maskz_loadu_ps(k, acc.data() + d)));
        }
      }
      std::copy(acc.begin(), acc.end(), out);
    }
  });

  // x += a · Woᵀ + bo
  std::vector<float> y(M * std::max(H, Ngu));
  project({o}, att.data(), M, Nq, y.data(), H, 0);
  for (int64_t j = 0; j < M * H; ++j) xs[j] = xs[j] + y[j];

  // MLP block: norm → gate|up (+ bias) → silu(gate) · up → down (+ bias) → residual
  for (int64_t m = 0; m < M; ++m) rms_norm(xs + m * H, norm2.data_ptr<float>(), epsf, H, h.data() + m * H);
  project(gate_up, h.data(), M, H, y.data(), Ngu, 0);
  std::vector<float> act(M * F);
  for (int64_t m = 0; m < M; ++m) {
    const float* gt = y.data() + m * Ngu;
    const float* up = gt + F;
    float* a = act.data() + m * F;
    for (int64_t f = 0; f < F; f += 16) {  // silu(g) = g / (1 + e^−g)
      const __mmask16 k = tail(F - f);
      const __m512 g = _mm512_maskz_loadu_ps(k, gt + f);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(a + f, k, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(k, up + f)));
    }
  }
  project({down}, act.data(), M, F, y.data(), H, 0);
  for (int64_t j = 0; j < M * H; ++j) xs[j] = xs[j] + y[j];
}

}  // namespace

#ifndef KQ_NS
#define KQ_NS redwood_cpu
#endif

TORCH_LIBRARY_FRAGMENT(KQ_NS, m) {
  m.def("decoder_layer(Tensor(a!) x, Tensor[] weights, int[] types, Tensor?[] biases, int[] groups, Tensor norm1, "
        "Tensor norm2, float eps, Tensor cos, Tensor sin, Tensor(b!) k_buf, Tensor(c!) v_buf, Tensor write_at, "
        "Tensor block_table, int tokens_per_row, Tensor range_ptr, Tensor ranges, int num_heads, "
        "int num_kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(KQ_NS, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
