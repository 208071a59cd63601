// The C++ decoder layer (src/redwood/cpu_kernels/layer.cpp) without torch, on a synthetic layer built here from a
// fixed pseudo-random stream — so the same program cross-compiled for another ISA (or run under an emulator) sees
// the same inputs, and every build's output can be compared bit for bit (tests/cpu_kernels/test_variants.py). It
// exercises what the kquant product alone does not: rms_norm, rotary, the cache write, attention's dot products,
// exp, softmax with masked tails, SiLU, and the other vector operations of kq_simd.h.
//
// argv[1]: M, the new tokens (one row, after 20 tokens of context already in the cache; default 5)
// stdout: the variant's name and a newline; float32 x [M, 256] after the layer; k_buf, v_buf [4, 2, 16, 64]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kq_serial_for.h"
#include "kquant.h"

namespace {

// xorshift64*: the same stream on every machine
struct Rng {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  uint32_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return static_cast<uint32_t>((s * 0x2545F4914F6CDD1Dull) >> 32);
  }
  float uniform(float lo, float hi) {  // exact: a 24-bit fraction scaled by a power of two, then one fma-free affine
    const float u = static_cast<float>(next() >> 8) * (1.f / 16777216.f);
    return lo + (hi - lo) * u;
  }
};

std::vector<float> floats(Rng& r, size_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (float& f : v) f = r.uniform(lo, hi);
  return v;
}

// n rows of K values as GGUF file blocks (Q4_K: 144 bytes, Q6_K: 210, Q8_0: 34, Q5_0: 22), random bytes with small
// fp16 scales (2^-11 .. 2^-10: activations stay far from overflow), packed into the kernel's layout
std::vector<uint8_t> weight(Rng& r, int64_t type, int64_t n, int64_t K) {
  const int64_t fb = redwood_kq::file_block_bytes(type), row = K / redwood_kq::file_block_values(type) * fb;
  std::vector<uint8_t> file(n * row);
  for (uint8_t& b : file) b = static_cast<uint8_t>(r.next());
  for (int64_t i = 0; i < n * row / fb; ++i) {
    uint8_t* blk = file.data() + i * fb;
    for (int at : type == 12 ? std::vector<int>{0, 2} : type == 14 ? std::vector<int>{208} : std::vector<int>{0}) {
      const uint16_t h = static_cast<uint16_t>(0x1000 | (r.next() & 0x3FF));
      std::memcpy(blk + at, &h, 2);
    }
  }
  std::vector<uint8_t> packed(n * ((K + 255) / 256) * redwood_kq::block_bytes(type));
  redwood_kq::pack_rows(file.data(), n, row, type, packed.data());
  return packed;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t M = argc > 1 ? std::atoll(argv[1]) : 5, L = 20;
  constexpr int64_t H = 256, Hq = 4, Hkv = 2, D = 64, F = 512, ps = 16, pages = 4, W = 4;
  if (M < 1 || L + M > W * ps) return 3;
  Rng r;
  const int64_t Q4K = 12, Q6K = 14, Q8_0 = 8, Q5_0 = 6;
  const std::vector<uint8_t> wqkv = weight(r, Q4K, (Hq + 2 * Hkv) * D, H), wo = weight(r, Q5_0, H, Hq * D);
  const std::vector<uint8_t> wg = weight(r, Q4K, F, H), wu = weight(r, Q8_0, F, H), wd = weight(r, Q6K, H, F);
  const std::vector<float> bqkv = floats(r, (Hq + 2 * Hkv) * D, -0.5f, 0.5f);
  const std::vector<float> norm1 = floats(r, H, 0.5f, 1.5f), norm2 = floats(r, H, 0.5f, 1.5f);
  std::vector<float> x = floats(r, M * H, -1.f, 1.f);
  const std::vector<float> cs = floats(r, M * D, -1.f, 1.f), sn = floats(r, M * D, -1.f, 1.f);
  std::vector<float> kb = floats(r, pages * Hkv * ps * D, -1.f, 1.f), vb = floats(r, pages * Hkv * ps * D, -1.f, 1.f);
  const int32_t table[W] = {2, 0, 3, 1};
  std::vector<int64_t> write_at(2 * M), range_ptr(M + 1), ranges(2 * M);
  for (int64_t t = 0; t < M; ++t) {
    write_at[2 * t] = table[(L + t) / ps];
    write_at[2 * t + 1] = (L + t) % ps;
    range_ptr[t + 1] = t + 1;
    ranges[2 * t] = 0;
    ranges[2 * t + 1] = L + t + 1;  // causal: the context and the new tokens up to itself
  }
  auto proj = [](const std::vector<uint8_t>& w, int64_t type, int64_t n, int64_t K, const float* bias) {
    return redwood_kq::Projection{w.data(), n, K / 256 * redwood_kq::block_bytes(type), type, bias};
  };
  redwood_kq::LayerArgs a;
  a.x = x.data();
  a.M = M;
  a.H = H;
  a.qkv = {proj(wqkv, Q4K, (Hq + 2 * Hkv) * D, H, bqkv.data())};
  a.o = proj(wo, Q5_0, H, Hq * D, nullptr);
  a.gate_up = {proj(wg, Q4K, F, H, nullptr), proj(wu, Q8_0, F, H, nullptr)};
  a.down = proj(wd, Q6K, H, F, nullptr);
  a.norm1 = norm1.data();
  a.norm2 = norm2.data();
  a.eps = 1e-6f;
  a.cos = cs.data();
  a.sin = sn.data();
  a.k_buf = kb.data();
  a.v_buf = vb.data();
  a.page_size = ps;
  a.head_dim = D;
  a.num_heads = Hq;
  a.num_kv_heads = Hkv;
  a.write_at = write_at.data();
  a.block_table = table;
  a.table_width = W;
  a.tokens_per_row = M;
  a.range_ptr = range_ptr.data();
  a.ranges = ranges.data();
  redwood_kq::decoder_layer(a);
  std::printf("%s\n", redwood_kq::variant());
  std::fwrite(x.data(), sizeof(float), x.size(), stdout);
  std::fwrite(kb.data(), sizeof(float), kb.size(), stdout);
  std::fwrite(vb.data(), sizeof(float), vb.size(), stdout);
  return 0;
}
