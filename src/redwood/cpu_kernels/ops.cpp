// The torch operators over the torch-free core (kquant.h): argument checks, tensors to pointers, and the core's
// parallel_for as at::parallel_for. Built once per variant with that variant's flags, its operators in the
// namespace KQ_NS (kquant.py: redwood_kq_<variant>), so every variant the CPU runs can load in one process:
//
//   kquant_linear(Tensor x, Tensor w, int type) -> Tensor      (kquant.cpp)
//   kquant_pack(Tensor w, int type) -> Tensor                  (kquant.cpp)
//   decoder_layer(...) -> ()                                   (layer.cpp; the arguments below)
//   variant() -> str                                           (the variant this build computes with)
//
// The Python wrappers check their arguments before calling these (kquant.py: a C++ exception kills the process on
// some torch builds); the checks here are the last guard.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "kquant.h"

namespace redwood_kq {
inline namespace KQ_VARIANT {

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(begin, end, grain, fn);
}

namespace {

constexpr int64_t kQK = 256;

void check_type(int64_t type, const char* op) {
  TORCH_CHECK(block_bytes(type) > 0, op, ": type must be Q4_K (12), Q6_K (14), Q8_0 (8) or Q5_0 (6), got ", type);
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  check_type(type, "kquant_linear");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kquant_linear: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "kquant_linear: w must be a contiguous uint8 [N, row bytes] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), fv = file_block_values(type);
  const int64_t row = (K + kQK - 1) / kQK * block_bytes(type);  // (32-value blocks: padded to super-blocks)
  TORCH_CHECK(K % fv == 0 && w.size(1) == row, "kquant_linear: K = ", K, " needs whole ",
              fv == kQK ? "super-blocks of 256" : "blocks of 32", " and packed rows of ", row, " bytes, got ", w.size(1));
  at::Tensor out = at::empty({M, N}, x.options());
  matmul(x.data_ptr<float>(), M, K, K, w.data_ptr<uint8_t>(), N, w.size(1), type, out.data_ptr<float>(), N);
  return out;
}

at::Tensor kquant_pack(const at::Tensor& w, int64_t type) {
  check_type(type, "kquant_pack");
  const int64_t file_bytes = file_block_bytes(type), fv = file_block_values(type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % file_bytes == 0,
              "kquant_pack: w must be a contiguous uint8 [N, K / ", fv, " * ", file_bytes, "] tensor");
  const int64_t N = w.size(0), K = w.size(1) / file_bytes * fv;
  at::Tensor out = at::empty({N, (K + kQK - 1) / kQK * block_bytes(type)}, w.options());
  pack_rows(w.data_ptr<uint8_t>(), N, w.size(1), type, out.data_ptr<uint8_t>());
  return out;
}

Projection proj_of(const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& bias, int64_t k_in,
                   const char* what) {
  const int64_t bb = block_bytes(type);
  TORCH_CHECK(bb > 0, "decoder_layer: ", what, ": type must be Q4_K (12), Q6_K (14), Q8_0 (8) or Q5_0 (6), got ",
              type);
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

// The tensors of layer.cpp's decoder layer (its header says what each is), checked, as a LayerArgs.
void decoder_layer_op(at::Tensor x, at::TensorList weights, at::IntArrayRef types,
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

  LayerArgs a;
  size_t i = 0;
  for (; i < static_cast<size_t>(groups[0]); ++i)
    a.qkv.push_back(proj_of(weights[i], types[i], biases[i], H, "q|k|v"));
  a.o = proj_of(weights[i], types[i], biases[i], Nq, "o");
  ++i;
  for (int64_t g = 0; g < groups[1]; ++g, ++i)
    a.gate_up.push_back(proj_of(weights[i], types[i], biases[i], H, "gate|up"));
  int64_t Ngu = 0;
  for (const Projection& p : a.gate_up) Ngu += p.n;
  TORCH_CHECK(Ngu % 2 == 0, "decoder_layer: gate|up must have an even number of outputs");
  a.down = proj_of(weights[i], types[i], biases[i], Ngu / 2, "down");
  int64_t Nsum = 0;
  for (const Projection& p : a.qkv) Nsum += p.n;
  TORCH_CHECK(Nsum == Nqkv && a.o.n == H && a.down.n == H, "decoder_layer: projection sizes do not match the heads");

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

  a.x = x.data_ptr<float>();
  a.M = M;
  a.H = H;
  a.norm1 = norm1.data_ptr<float>();
  a.norm2 = norm2.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.k_buf = k_buf.data_ptr<float>();
  a.v_buf = v_buf.data_ptr<float>();
  a.page_size = ps;
  a.head_dim = D;
  a.num_heads = Hq;
  a.num_kv_heads = Hkv;
  a.write_at = wa;
  a.block_table = bt;
  a.table_width = W;
  a.tokens_per_row = tokens_per_row;
  a.range_ptr = rp;
  a.ranges = rg;
  decoder_layer(a);
}

std::string variant_op() { return variant(); }

}  // namespace
}  // namespace KQ_VARIANT
}  // namespace redwood_kq

// KQ_NS: the operator namespace (kquant.py: redwood_kq_<variant>; benchmarks/cpu_kquant.py builds trial variants
// side by side under other names)
#ifndef KQ_NS
#define KQ_NS redwood_kq
#endif
// (one more macro level, so that KQ_NS expands before TORCH_LIBRARY pastes and quotes it)
#define KQ_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define KQ_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

KQ_LIBRARY(KQ_NS, m) {
  m.def("kquant_linear(Tensor x, Tensor w, int type) -> Tensor");
  m.def("kquant_pack(Tensor w, int type) -> Tensor");
  m.def("decoder_layer(Tensor(a!) x, Tensor[] weights, int[] types, Tensor?[] biases, int[] groups, Tensor norm1, "
        "Tensor norm2, float eps, Tensor cos, Tensor sin, Tensor(b!) k_buf, Tensor(c!) v_buf, Tensor write_at, "
        "Tensor block_table, int tokens_per_row, Tensor range_ptr, Tensor ranges, int num_heads, "
        "int num_kv_heads) -> ()");
  m.def("variant() -> str", &redwood_kq::variant_op);  // (no tensors: one kernel for every dispatch key)
}

KQ_LIBRARY_IMPL(KQ_NS, m) {
  m.impl("kquant_linear", &redwood_kq::kquant_linear);
  m.impl("kquant_pack", &redwood_kq::kquant_pack);
  m.impl("decoder_layer", &redwood_kq::decoder_layer_op);
}
