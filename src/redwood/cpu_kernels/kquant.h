// The CPU kernels' torch-free core (kquant.cpp: the kquant product; layer.cpp: the fused decoder layer), one build
// per variant; ops.cpp binds it to torch operators. Nothing here includes a torch header, so the core also builds
// alone (a standalone test, a cross compiler) with a `parallel_for` of its own.
//
// VARIANTS, chosen by the compiler's target flags (kquant.py passes each variant's flags):
//   avx512   AVX-512 F/BW/VL/DQ + VNNI + F16C + FMA: `vpdpbusd` over 64-byte vectors;
//   avxvnni  AVX2 + FMA + F16C + AVX-VNNI (VEX `vpdpbusd` over two 32-byte halves);
//   avx2     AVX2 + FMA + F16C: `vpmaddubsw` (u8 × s8 → s16 pairs) + `vpmaddwd` with ones (→ s32);
//   neon     aarch64 with DOTPROD (ARMv8.2+: Graviton 2+, Apple M1+, Cortex-A76+): `sdot` over 16-byte quarters;
//   portable plain C++ loops (any CPU, ARM included).
// All variants compute the same bits (kq_simd.h says how); each lives in its own inline namespace, so several
// variants' libraries can sit in one process without their symbols meeting.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__) && defined(__F16C__) && defined(__FMA__)
#define KQ_ISA_AVX512 1
#define KQ_VARIANT avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define KQ_ISA_AVX2 1
#define KQ_ISA_AVXVNNI 1
#define KQ_VARIANT avxvnni
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_ISA_AVX2 1
#define KQ_VARIANT avx2
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define KQ_ISA_NEON 1
#define KQ_VARIANT neon
#else
#define KQ_ISA_PORTABLE 1
#define KQ_VARIANT portable
#endif

namespace redwood_kq {
inline namespace KQ_VARIANT {

// This build's variant: "avx512", "avxvnni", "avx2" or "portable".
const char* variant();

// Runs fn(b, e) over chunks [b, e) covering [begin, end), chunks of at least `grain` (the torch binding: at::parallel_for;
// a standalone build: any split, a serial loop included — no result depends on it). Defined by whoever links the core.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Bytes of one super-block of 256 values in the kernel's layout: Q4_K (type 12) 148, Q6_K (14) 210, Q8_0 (8) 272,
// Q5_0 (6) 176, else -1.
int64_t block_bytes(int64_t type);

// Values in one block of the GGUF file: 256 (Q4_K, Q6_K), 32 (Q8_0, Q5_0), else -1.
int64_t file_block_values(int64_t type);

// Bytes of one block of the GGUF file (file_block_values values): Q4_K 144, Q6_K 210, Q8_0 34, Q5_0 22, else -1.
int64_t file_block_bytes(int64_t type);

// out[m·ldo + n] = Σ_k x[m·ldx + k]·W[n, k] for M float32 rows of k_in values and N packed weight rows of
// `row_bytes` (= K / 256 · block_bytes, K ≥ k_in: values past k_in are zero weights' padding, the rows are
// read as if padded with zeros). The same numbers bit for bit at any M, thread split — and in every variant.
void matmul(const float* x, int64_t M, int64_t k_in, int64_t ldx, const uint8_t* w, int64_t N, int64_t row_bytes,
            int64_t type, float* out, int64_t ldo);

// N rows of the file's blocks (src: `file_row_bytes` each, a whole number of file blocks) in the kernel's layout
// (dst: ceil(K / 256) · block_bytes each, K = the row's values): a row of 32-value blocks whose K is not a multiple
// of 256 is padded with zero blocks (d = 0, q = 0) to whole super-blocks.
void pack_rows(const uint8_t* src, int64_t N, int64_t file_row_bytes, int64_t type, uint8_t* dst);

// One packed projection of the decoder layer: N output rows of `row_bytes`, an optional float32 bias [N].
struct Projection {
  const uint8_t* w;
  int64_t n, row_bytes, type;
  const float* bias;
};

// The decoder layer's arguments (ops.cpp's `decoder_layer` checks them; layer.cpp says what each is).
struct LayerArgs {
  float* x;  // [M, H], updated in place
  int64_t M, H;
  std::vector<Projection> qkv, gate_up;  // outputs side by side: q | k | v, gate | up
  Projection o, down;
  const float *norm1, *norm2;
  float eps;
  const float *cos, *sin;  // [M, D]
  float *k_buf, *v_buf;    // [pages, Hkv, page_size, D]
  int64_t page_size, head_dim, num_heads, num_kv_heads;
  const int64_t* write_at;      // [M, 2]
  const int32_t* block_table;   // [B, table_width]
  int64_t table_width, tokens_per_row;
  const int64_t* range_ptr;     // [M + 1]
  const int64_t* ranges;        // [R, 2]
};

void decoder_layer(const LayerArgs& a);

}  // namespace KQ_VARIANT
}  // namespace redwood_kq
