// The few vector operations kquant.cpp and layer.cpp are written in, one implementation per variant (kquant.h).
//
// F32: 16 float lanes (avx512: one __m512; avx2 / avxvnni: two __m256, lanes 0-7 and 8-15; portable: float[16]).
// Every variant does the same IEEE operation per lane — a fused multiply-add where avx512 fuses (std::fma in the
// portable build: the sources build with -ffp-contract=off, so nothing else fuses), max / min with SSE's NaN rule,
// round half to even — and `sum` adds the 16 lanes in one fixed tree (GCC's _mm512_reduce_add_ps tree). So the float
// results are bit-identical across variants.
//
// Weights (`Q`): a super-block's 4 vectors of 64 unsigned weights in kernel order (kquant.cpp), decoded from the
// packed bytes; `dot` gives 32-bit lane l = Σ over the 16 values of lane l (bytes 4l..4l+3 of each of the 4
// vectors) of weight × activation — exact integer arithmetic in every variant:
//   avx512   4 × vpdpbusd (u8 × s8, summed into s32 without intermediate rounding or saturation);
//   avxvnni  the same with the VEX vpdpbusd on each 32-byte half;
//   avx2     vpmaddubsw (u8 × s8 → the sum of a byte pair in s16, SATURATING), then vpmaddwd with ones (pairs of s16
//            → s32). Saturation bound: activations are |x| ≤ 127 (kquant.cpp quantizes to ±127; even −128 would fit
//            below), weights 0 ≤ q ≤ kMaxQ, so a pair is at most 2·kMaxQ·128 in magnitude: Q4_K (q ≤ 15) 3 840, Q6_K
//            (q ≤ 63) 16 128, both < 32 767. Adding s16 pairs before vpmaddwd: Q4_K sums all 4 vectors' pairs in s16
//            (≤ 4 · 3 840 = 15 360), Q6_K two at a time (≤ 2 · 16 128 = 32 256 < 32 767), never 4 (64 512 would
//            wrap). So no sum saturates or wraps and the lane sums equal vpdpbusd's;
//   neon     aarch64 DOTPROD's sdot on each 16-byte quarter (weights ≤ 63 are valid int8, so the signed product
//            is the same; exact int32 sums, as vpdpbusd);
//   portable plain loops the compiler vectorizes (int16 sums within the same kind of bound: `dot` below).
//
// The 32-value block types (`S`, `sdot`: Q8_0, Q5_0) give lane l = Σ w·x with the SIGNED weight w (Q8_0's q in
// −128..127, Q5_0's q − 16 in −16..15) — exact in every variant, however computed: avx512 / avxvnni feed unsigned
// bytes u = w + o to vpdpbusd (Q8_0: o = 128, Q5_0: o = 16) and subtract o·Σx over the lane (integer activation
// sums); avx2 does the same for Q5_0 (u ≤ 31: every int16 sum within bound) and for Q8_0 moves w's sign onto the
// activations (|w| ≤ 128 with ±x: a pair ≤ 32 512, no saturation); neon's sdot and portable multiply w itself.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kquant.h"

#if defined(KQ_ISA_NEON)
#include <arm_neon.h>
#elif !defined(KQ_ISA_PORTABLE)
#include <immintrin.h>
#endif

namespace redwood_kq {
inline namespace KQ_VARIANT {
namespace simd {

constexpr float kLog2e = 1.44269504088896341f;

// ---------------------------------------------------------------------------------------------------------- avx512
#if defined(KQ_ISA_AVX512)

struct F32 {
  __m512 v;
};
inline __mmask16 tail(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }
inline F32 zero() { return {_mm512_setzero_ps()}; }
inline F32 set1(float a) { return {_mm512_set1_ps(a)}; }
inline F32 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F32 load_n(const float* p, int64_t left) { return {_mm512_maskz_loadu_ps(tail(left), p)}; }  // zeros past left
inline void store_n(float* p, F32 a, int64_t left) { _mm512_mask_storeu_ps(p, tail(left), a.v); }
inline F32 keep_n(F32 a, int64_t left) { return {_mm512_maskz_mov_ps(tail(left), a.v)}; }  // lanes past left: +0
inline F32 add(F32 a, F32 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F32 sub(F32 a, F32 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F32 mul(F32 a, F32 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32 div(F32 a, F32 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F32 max(F32 a, F32 b) { return {_mm512_max_ps(a.v, b.v)}; }  // a > b ? a : b (b where either is NaN)
inline F32 min(F32 a, F32 b) { return {_mm512_min_ps(a.v, b.v)}; }  // a < b ? a : b
inline F32 fmadd(F32 a, F32 b, F32 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a·b + c, one rounding
inline F32 fnmadd(F32 a, F32 b, F32 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c − a·b, one rounding
inline F32 round_even(F32 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// p · 2^n for integral n in [−126, 128] (the only use: layer.cpp's exp, whose n is clamped there)
inline F32 scale_pow2(F32 p, F32 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline float sum(F32 a) {  // ((l0+l8)+(l4+l12)) ... : the tree of GCC's _mm512_reduce_add_ps, spelled out
  const __m256 lo = _mm512_castps512_ps256(a.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

struct I32 {
  __m512i v;
};
inline F32 to_float(I32 a) { return {_mm512_cvtepi32_ps(a.v)}; }

struct Q {
  __m512i v[4];
};
inline Q decode_q4k(const uint8_t* blk) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  Q w;
  for (int h = 0; h < 2; ++h) {  // 64 bytes: positions 128h + t (low nibbles), 128h + 64 + t (high)
    const __m512i q = _mm512_loadu_si512(blk + 20 + 64 * h);
    w.v[2 * h] = _mm512_and_si512(q, low4);
    w.v[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
  }
  return w;
}
inline Q decode_q6k(const uint8_t* blk) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
  const __m512i l0 = _mm512_loadu_si512(blk), l1 = _mm512_loadu_si512(blk + 64), qh = _mm512_loadu_si512(blk + 128);
  return {{_mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), high2)),
           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
                           _mm512_and_si512(_mm512_slli_epi16(qh, 2), high2)),
           _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(qh, high2)),
           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                           _mm512_and_si512(_mm512_srli_epi16(qh, 2), high2))}};
}
template <int kMaxQ>
inline I32 dot(const Q& w, const int8_t* xq) {
  __m512i isum = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) isum = _mm512_dpbusd_epi32(isum, w.v[c], _mm512_loadu_si512(xq + 64 * c));
  return {isum};
}
// Q4_K: lane l: scale d·sc[l / 2], offset dmin·mn[l / 2] (d and dmin converted together: lanes 0-7 ← d, 8-15 ←
// dmin; `both`: lanes 0-7 d·sc[j], 8-15 dmin·mn[j])
inline void q4k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i mins = _mm512_add_epi32(pairs, _mm512_set1_epi32(8));
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  int32_t dd;
  std::memcpy(&dd, blk, 4);
  const __m512 ddmin = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(dd))));
  const __m512 both = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)))), ddmin);
  scale.v = _mm512_permutexvar_ps(pairs, both);
  offset.v = _mm512_permutexvar_ps(mins, both);
}
inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
// Q6_K: lane l: scale d·sc[l], offset 32·d·sc[l] (q's offset of 32; exact: a power of 2)
inline void q6k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  scale.v = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))),
      _mm512_set1_ps(fp16(blk + 208)));
  offset.v = _mm512_mul_ps(scale.v, _mm512_set1_ps(32.f));
}
// The 32-value block types (Q8_0, Q5_0): a super-block's 256 weights in kernel order as UNSIGNED bytes u = w + o
// (Q8_0: w in −128..127, o = 128, u = w XOR 0x80; Q5_0: u = q, the file's 5-bit value, w = q − 16, o = 16), so
// vpdpbusd (u8 × s8) takes them as they are; `sdot` then subtracts o·Σx over each lane's 16 activations (xsum: exact
// int32, kquant.cpp's quantize) — Σ u·x − o·Σ x = Σ w·x exactly, the integer every variant computes.
struct S {
  __m512i u[4];
};
inline S decode_q8_0(const uint8_t* blk) {  // 16 bytes of d, then the 4 vectors of int8 q
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  S w;
  for (int c = 0; c < 4; ++c) w.u[c] = _mm512_xor_si512(_mm512_loadu_si512(blk + 16 + 64 * c), flip);
  return w;
}
inline S decode_q5_0(const uint8_t* blk) {  // 16 bytes of d, 128 of nibbles (as Q4_K's), 32 of high bits
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  __m512i nib[4];
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_loadu_si512(blk + 16 + 64 * h);
    nib[2 * h] = _mm512_and_si512(q, low4);
    nib[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
  }
  // bit k of high-bit byte t: position 32k + t; vector c's bytes 0-31 take bit 2c, bytes 32-63 bit 2c + 1
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 144)));
  S w;
  for (int c = 0; c < 4; ++c) {
    const __m512i sel = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8(static_cast<char>(1 << (2 * c)))),
                                           _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1))), 1);
    w.u[c] = _mm512_mask_add_epi8(nib[c], _mm512_test_epi8_mask(qh, sel), nib[c], bit4);  // q = nibble + 16·high
  }
  return w;
}
template <bool kQ5>
inline I32 sdot(const S& w, const int8_t* xq, const int32_t* xsum) {
  __m512i isum = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) isum = _mm512_dpbusd_epi32(isum, w.u[c], _mm512_loadu_si512(xq + 64 * c));
  return {_mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_loadu_si512(xsum), kQ5 ? 4 : 7))};  // − o·Σx
}
// Q8_0 / Q5_0: lane l: scale d[l / 2] (block l / 2 of the super-block's 8; fp16 → float32 is exact)
inline F32 d32_scales(const uint8_t* blk) {
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  return {_mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(d))};
}
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA); }

// ---------------------------------------------------------------------------------------------- avx2 / avxvnni
#elif defined(KQ_ISA_AVX2)

struct F32 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
// lanes i < left all ones (as int32 masks: maskload / maskstore / and)
inline void tail(int64_t left, __m256i& lo, __m256i& hi) {
  const __m256i n = _mm256_set1_epi32(static_cast<int32_t>(left >= 16 ? 16 : left));
  lo = _mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  hi = _mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
}
inline F32 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline F32 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F32 load_n(const float* p, int64_t left) {
  if (left >= 16) return load(p);
  __m256i lo, hi;
  tail(left, lo, hi);
  return {_mm256_maskload_ps(p, lo), _mm256_maskload_ps(p + 8, hi)};
}
inline void store_n(float* p, F32 a, int64_t left) {
  if (left >= 16) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  __m256i lo, hi;
  tail(left, lo, hi);
  _mm256_maskstore_ps(p, lo, a.lo);
  _mm256_maskstore_ps(p + 8, hi, a.hi);
}
inline F32 keep_n(F32 a, int64_t left) {
  __m256i lo, hi;
  tail(left, lo, hi);
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lo)), _mm256_and_ps(a.hi, _mm256_castsi256_ps(hi))};
}
inline F32 add(F32 a, F32 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F32 sub(F32 a, F32 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F32 mul(F32 a, F32 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F32 div(F32 a, F32 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F32 max(F32 a, F32 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F32 min(F32 a, F32 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F32 fmadd(F32 a, F32 b, F32 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F32 fnmadd(F32 a, F32 b, F32 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F32 round_even(F32 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
// p · 2^n for integral n in [−126, 128]: p · 2^min(n, 127) · 2^(n − min(n, 127)), each power of two built from its
// exponent bits (2^128 is no float). The second factor is 1 unless n = 128, where the first product is exact, so
// the result is one rounding of p · 2^n, as vscalefps gives.
inline __m256 pow2(__m256 n) {  // n integral in [−126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline __m256 scale_pow2(__m256 p, __m256 n) {
  const __m256 n1 = _mm256_min_ps(n, _mm256_set1_ps(127.f));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(_mm256_sub_ps(n, n1)));
}
inline F32 scale_pow2(F32 p, F32 n) { return {scale_pow2(p.lo, n.lo), scale_pow2(p.hi, n.hi)}; }
inline float sum(F32 a) {  // the tree of simd::sum (avx512)
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

struct I32 {
  __m256i lo, hi;
};
inline F32 to_float(I32 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }

struct Q {
  __m256i v[4][2];  // vector c, half j (bytes 32j..32j+31: lanes 8j..8j+7)
};
inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Q decode_q4k(const uint8_t* blk) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  Q w;
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 2; ++j) {
      const __m256i q = load256(blk + 20 + 64 * h + 32 * j);
      w.v[2 * h][j] = _mm256_and_si256(q, low4);
      w.v[2 * h + 1][j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    }
  return w;
}
inline Q decode_q6k(const uint8_t* blk) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  Q w;
  for (int j = 0; j < 2; ++j) {
    const __m256i l0 = load256(blk + 32 * j), l1 = load256(blk + 64 + 32 * j), qh = load256(blk + 128 + 32 * j);
    w.v[0][j] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2));
    w.v[1][j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2));
    w.v[2][j] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(qh, high2));
    w.v[3][j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2));
  }
  return w;
}
// kMaxQ: the largest weight (15 for Q4_K, 63 for Q6_K), which bounds the s16 sums (the header comment)
template <int kMaxQ>
inline __m256i dot_half(const Q& w, const int8_t* xq, int j) {
  __m256i x[4];
  for (int c = 0; c < 4; ++c) x[c] = load256(xq + 64 * c + 32 * j);
#if defined(KQ_ISA_AVXVNNI)
  __m256i isum = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) isum = _mm256_dpbusd_avx_epi32(isum, w.v[c][j], x[c]);
  return isum;
#else
  constexpr int kPair = 2 * kMaxQ * 128;  // |one vpmaddubsw lane| at most
  static_assert(2 * kPair <= 32767, "two vpmaddubsw results must add in int16 without wrapping");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[4];
  for (int c = 0; c < 4; ++c) p[c] = _mm256_maddubs_epi16(w.v[c][j], x[c]);
  if constexpr (4 * kPair <= 32767) {  // Q4_K: all four in int16, then one vpmaddwd
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    return _mm256_madd_epi16(s, ones);
  }
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),  // Q6_K: two at a time
                          _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
#endif
}
template <int kMaxQ>
inline I32 dot(const Q& w, const int8_t* xq) {
  return {dot_half<kMaxQ>(w, xq, 0), dot_half<kMaxQ>(w, xq, 1)};
}
inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline void q4k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  int32_t dd;
  std::memcpy(&dd, blk, 4);
  const __m128 ddmin = _mm_cvtph_ps(_mm_cvtsi32_si128(dd));  // d, dmin, 0, 0
  const __m256 d = _mm256_broadcastss_ps(ddmin), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(ddmin));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));  // sc[8], mn[8]
  const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), d);
  const __m256 mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))), dmin);
  const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  scale = {_mm256_permutevar8x32_ps(sc, lo), _mm256_permutevar8x32_ps(sc, hi)};
  offset = {_mm256_permutevar8x32_ps(mn, lo), _mm256_permutevar8x32_ps(mn, hi)};
}
inline void q6k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  const __m256 d = _mm256_set1_ps(fp16(blk + 208));
  scale = {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),
           _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d)};
  offset = mul(scale, set1(32.f));
}
// The 32-value block types. avxvnni: as avx512 (unsigned u = w + o in `a`, then − o·Σx). avx2: Q5_0 the same
// (u = q ≤ 31: vpmaddubsw's pairs ≤ 2 · 31 · 127 = 7 874, the 4 vectors' sum ≤ 31 496 fits int16); Q8_0's u would
// reach 255 (pairs up to 64 770: saturation), so Q8_0 takes the sign transfer instead: a = |w| (≤ 128: pairs ≤
// 32 512, one vector at a time through vpmaddwd), s = w, whose signs `sdot` moves onto the activations (vpsignb:
// x, −x or 0 where w > 0, < 0, = 0; |x| ≤ 127, so −x is exact) — a·sign(x, w) = w·x. Every path: Σ w·x exactly.
struct S {
  __m256i a[4][2], s[4][2];  // vector c, half j
};
inline S decode_q8_0(const uint8_t* blk) {
  S w;
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 2; ++j) {
      const __m256i q = load256(blk + 16 + 64 * c + 32 * j);
#if defined(KQ_ISA_AVXVNNI)
      w.a[c][j] = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
      w.s[c][j] = q;
      w.a[c][j] = _mm256_abs_epi8(q);  // (|−128| = 0x80: 128 as the unsigned operand)
#endif
    }
  return w;
}
inline S decode_q5_0(const uint8_t* blk) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i qh = load256(blk + 144);  // bit k of byte t: position 32k + t (vector c, half j: bit 2c + j)
  S w;
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 2; ++j) {
      const __m256i q = load256(blk + 16 + 64 * h + 32 * j);
      const __m256i nib[2] = {_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4)};
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * h + e;
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + j)));
        const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), bit4);
        w.a[c][j] = _mm256_or_si256(nib[e], high);  // q = nibble | high << 4
      }
    }
  return w;
}
template <bool kQ5>
inline __m256i sdot_half(const S& w, const int8_t* xq, const int32_t* xsum, int j) {
  __m256i x[4];
  for (int c = 0; c < 4; ++c) x[c] = load256(xq + 64 * c + 32 * j);
  const __m256i offset = _mm256_slli_epi32(load256(xsum + 8 * j), kQ5 ? 4 : 7);  // o·Σx of lanes 8j..8j+7
#if defined(KQ_ISA_AVXVNNI)
  __m256i isum = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) isum = _mm256_dpbusd_avx_epi32(isum, w.a[c][j], x[c]);
  return _mm256_sub_epi32(isum, offset);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[4];
  if constexpr (kQ5) {
    static_assert(4 * 2 * 31 * 127 <= 32767, "Q5_0's 4 vectors of pairs must add in int16 without wrapping");
    for (int c = 0; c < 4; ++c) p[c] = _mm256_maddubs_epi16(w.a[c][j], x[c]);
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    return _mm256_sub_epi32(_mm256_madd_epi16(s, ones), offset);
  } else {
    static_assert(2 * 128 * 127 <= 32767, "one Q8_0 pair (|w| ≤ 128, |x| ≤ 127) must not saturate");
    (void)offset;  // (the sign transfer multiplies by w itself: no offset)
    for (int c = 0; c < 4; ++c) p[c] = _mm256_maddubs_epi16(w.a[c][j], _mm256_sign_epi8(x[c], w.s[c][j]));
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones)),
                            _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones)));
  }
#endif
}
template <bool kQ5>
inline I32 sdot(const S& w, const int8_t* xq, const int32_t* xsum) {
  return {sdot_half<kQ5>(w, xq, xsum, 0), sdot_half<kQ5>(w, xq, xsum, 1)};
}
inline F32 d32_scales(const uint8_t* blk) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  return {_mm256_permutevar8x32_ps(d, lo), _mm256_permutevar8x32_ps(d, hi)};
}
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA); }

// ------------------------------------------------------------------------------------------------------------ neon
#elif defined(KQ_ISA_NEON)

struct F32 {
  float32x4_t v[4];  // lanes 0-3, 4-7, 8-11, 12-15
};
inline F32 set1(float a) { return {{vdupq_n_f32(a), vdupq_n_f32(a), vdupq_n_f32(a), vdupq_n_f32(a)}}; }
inline F32 zero() { return set1(0.f); }
inline F32 load(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline F32 load_n(const float* p, int64_t left) {  // zeros past left
  if (left >= 16) return load(p);
  float t[16] = {};
  std::memcpy(t, p, static_cast<size_t>(left) * sizeof(float));
  return load(t);
}
inline void store_n(float* p, F32 a, int64_t left) {
  float t[16];
  for (int i = 0; i < 4; ++i) vst1q_f32(t + 4 * i, a.v[i]);
  std::memcpy(p, t, static_cast<size_t>(left >= 16 ? 16 : left) * sizeof(float));
}
#define KQ_NEON2(expr)                       \
  F32 r;                                     \
  for (int i = 0; i < 4; ++i) r.v[i] = (expr); \
  return r
inline F32 keep_n(F32 a, int64_t left) {  // lanes past left: +0
  const int32x4_t n = vdupq_n_s32(static_cast<int32_t>(left >= 16 ? 16 : left));
  const int32_t base[4] = {0, 1, 2, 3};
  const int32x4_t idx = vld1q_s32(base);
  KQ_NEON2(vreinterpretq_f32_u32(
      vandq_u32(vreinterpretq_u32_f32(a.v[i]), vcltq_s32(vaddq_s32(idx, vdupq_n_s32(4 * i)), n))));
}
inline F32 add(F32 a, F32 b) { KQ_NEON2(vaddq_f32(a.v[i], b.v[i])); }
inline F32 sub(F32 a, F32 b) { KQ_NEON2(vsubq_f32(a.v[i], b.v[i])); }
inline F32 mul(F32 a, F32 b) { KQ_NEON2(vmulq_f32(a.v[i], b.v[i])); }
inline F32 div(F32 a, F32 b) { KQ_NEON2(vdivq_f32(a.v[i], b.v[i])); }
// SSE's rule (a > b ? a : b, b where either is NaN), not vmaxq's (NaN where either is)
inline F32 max(F32 a, F32 b) { KQ_NEON2(vbslq_f32(vcgtq_f32(a.v[i], b.v[i]), a.v[i], b.v[i])); }
inline F32 min(F32 a, F32 b) { KQ_NEON2(vbslq_f32(vcltq_f32(a.v[i], b.v[i]), a.v[i], b.v[i])); }
inline F32 fmadd(F32 a, F32 b, F32 c) { KQ_NEON2(vfmaq_f32(c.v[i], a.v[i], b.v[i])); }   // c + a·b, one rounding
inline F32 fnmadd(F32 a, F32 b, F32 c) { KQ_NEON2(vfmsq_f32(c.v[i], a.v[i], b.v[i])); }  // c − a·b, one rounding
inline F32 round_even(F32 a) { KQ_NEON2(vrndnq_f32(a.v[i])); }
inline float32x4_t pow2(float32x4_t n) {  // n integral in [−126, 127]
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}
inline float32x4_t scale_pow2(float32x4_t p, float32x4_t n) {  // as the avx2 one
  const float32x4_t n1 = vminq_f32(n, vdupq_n_f32(127.f));  // (n is never NaN here)
  return vmulq_f32(vmulq_f32(p, pow2(n1)), pow2(vsubq_f32(n, n1)));
}
inline F32 scale_pow2(F32 p, F32 n) { KQ_NEON2(scale_pow2(p.v[i], n.v[i])); }
inline float sum(F32 a) {  // the tree of simd::sum (avx512): lanes i + 8, then i + 4, then i + 2, then i + 1
  const float32x4_t t6 = vaddq_f32(vaddq_f32(a.v[3], a.v[1]), vaddq_f32(a.v[2], a.v[0]));
  const float32x2_t t8 = vadd_f32(vget_low_f32(t6), vget_high_f32(t6));
  return vget_lane_f32(t8, 0) + vget_lane_f32(t8, 1);
}

struct I32 {
  int32x4_t v[4];
};
inline F32 to_float(I32 a) { KQ_NEON2(vcvtq_f32_s32(a.v[i])); }
#undef KQ_NEON2

struct Q {
  uint8x16_t v[4][4];  // vector c, quarter j (bytes 16j..16j+15: lanes 4j..4j+3)
};
inline Q decode_q4k(const uint8_t* blk) {
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  Q w;
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) {
      const uint8x16_t q = vld1q_u8(blk + 20 + 64 * h + 16 * j);
      w.v[2 * h][j] = vandq_u8(q, low4);
      w.v[2 * h + 1][j] = vshrq_n_u8(q, 4);
    }
  return w;
}
inline Q decode_q6k(const uint8_t* blk) {
  const uint8x16_t low4 = vdupq_n_u8(0x0F), high2 = vdupq_n_u8(0x30);
  Q w;
  for (int j = 0; j < 4; ++j) {
    const uint8x16_t l0 = vld1q_u8(blk + 16 * j), l1 = vld1q_u8(blk + 64 + 16 * j), qh = vld1q_u8(blk + 128 + 16 * j);
    w.v[0][j] = vorrq_u8(vandq_u8(l0, low4), vandq_u8(vshlq_n_u8(qh, 4), high2));
    w.v[1][j] = vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(vshlq_n_u8(qh, 2), high2));
    w.v[2][j] = vorrq_u8(vandq_u8(l1, low4), vandq_u8(qh, high2));
    w.v[3][j] = vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(vshrq_n_u8(qh, 2), high2));
  }
  return w;
}
template <int kMaxQ>
inline I32 dot(const Q& w, const int8_t* xq) {
  static_assert(kMaxQ <= 127, "weights must be valid int8 for sdot");
  I32 r;
  for (int j = 0; j < 4; ++j) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int c = 0; c < 4; ++c) acc = vdotq_s32(acc, vreinterpretq_s8_u8(w.v[c][j]), vld1q_s8(xq + 64 * c + 16 * j));
    r.v[j] = acc;
  }
  return r;
}
inline float fp16(const uint8_t* p) {  // IEEE binary16 → float32 (exact)
  float16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}
inline void q4k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  const float d = fp16(blk), dmin = fp16(blk + 2);
  float s[16], o[16];
  for (int l = 0; l < 16; ++l) {
    s[l] = static_cast<float>(blk[4 + l / 2]) * d;
    o[l] = static_cast<float>(blk[12 + l / 2]) * dmin;
  }
  scale = load(s);
  offset = load(o);
}
inline void q6k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  const float d = fp16(blk + 208);
  float s[16];
  for (int l = 0; l < 16; ++l) s[l] = static_cast<float>(static_cast<int8_t>(blk[192 + l])) * d;
  scale = load(s);
  offset = mul(scale, set1(32.f));
}
// The 32-value block types: signed weights as they are (sdot is s8 × s8: no sign transfer needed).
struct S {
  int8x16_t v[4][4];  // vector c, quarter j
};
inline S decode_q8_0(const uint8_t* blk) {
  S w;
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 4; ++j) w.v[c][j] = vld1q_s8(reinterpret_cast<const int8_t*>(blk + 16 + 64 * c + 16 * j));
  return w;
}
inline S decode_q5_0(const uint8_t* blk) {
  const uint8x16_t low4 = vdupq_n_u8(0x0F), sixteen = vdupq_n_u8(16);
  // bit k of high-bit byte t: position 32k + t; vector c's quarter j: bit 2c + j / 2 of bytes 16 (j % 2) + 0..15
  const uint8x16_t qh[2] = {vld1q_u8(blk + 144), vld1q_u8(blk + 160)};
  S w;
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) {
      const uint8x16_t q = vld1q_u8(blk + 16 + 64 * h + 16 * j);
      const uint8x16_t nib[2] = {vandq_u8(q, low4), vshrq_n_u8(q, 4)};
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * h + e;
        const uint8x16_t high = vandq_u8(vtstq_u8(qh[j % 2], vdupq_n_u8(static_cast<uint8_t>(1 << (2 * c + j / 2)))),
                                         sixteen);
        w.v[c][j] = vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(nib[e], high), sixteen));
      }
    }
  return w;
}
template <bool kQ5>
inline I32 sdot(const S& w, const int8_t* xq, const int32_t* /*xsum: signed weights need no offset*/) {
  I32 r;
  for (int j = 0; j < 4; ++j) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int c = 0; c < 4; ++c) acc = vdotq_s32(acc, w.v[c][j], vld1q_s8(xq + 64 * c + 16 * j));
    r.v[j] = acc;
  }
  return r;
}
inline F32 d32_scales(const uint8_t* blk) {
  float s[16];
  for (int l = 0; l < 16; ++l) s[l] = fp16(blk + 2 * (l / 2));
  return load(s);
}
inline void prefetch(const uint8_t* p) { __builtin_prefetch(p, 0, 0); }

// -------------------------------------------------------------------------------------------------------- portable
#else

struct F32 {
  float v[16];
};
inline F32 set1(float a) {
  F32 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a;
  return r;
}
inline F32 zero() { return set1(0.f); }
inline F32 load(const float* p) {
  F32 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline F32 load_n(const float* p, int64_t left) {
  F32 r;
  for (int i = 0; i < 16; ++i) r.v[i] = i < left ? p[i] : 0.f;
  return r;
}
inline void store_n(float* p, F32 a, int64_t left) {
  for (int i = 0; i < 16; ++i)
    if (i < left) p[i] = a.v[i];
}
inline F32 keep_n(F32 a, int64_t left) {
  for (int i = 0; i < 16; ++i)
    if (i >= left) a.v[i] = 0.f;
  return a;
}
#define KQ_LANES(expr)                            \
  F32 r;                                          \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr);   \
  return r
inline F32 add(F32 a, F32 b) { KQ_LANES(a.v[i] + b.v[i]); }
inline F32 sub(F32 a, F32 b) { KQ_LANES(a.v[i] - b.v[i]); }
inline F32 mul(F32 a, F32 b) { KQ_LANES(a.v[i] * b.v[i]); }
inline F32 div(F32 a, F32 b) { KQ_LANES(a.v[i] / b.v[i]); }
inline F32 max(F32 a, F32 b) { KQ_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }  // (maxps: b where either is NaN)
inline F32 min(F32 a, F32 b) { KQ_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
inline F32 fmadd(F32 a, F32 b, F32 c) { KQ_LANES(std::fma(a.v[i], b.v[i], c.v[i])); }
inline F32 fnmadd(F32 a, F32 b, F32 c) { KQ_LANES(std::fma(-a.v[i], b.v[i], c.v[i])); }
inline F32 round_even(F32 a) { KQ_LANES(std::nearbyint(a.v[i])); }  // (the default rounding mode: half to even)
inline float pow2(float n) {  // n integral in [−126, 127]
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float scale_pow2(float p, float n) {  // as the avx2 one
  const float n1 = n < 127.f ? n : 127.f;
  return (p * pow2(n1)) * pow2(n - n1);
}
inline F32 scale_pow2(F32 p, F32 n) { KQ_LANES(scale_pow2(p.v[i], n.v[i])); }
#undef KQ_LANES
inline float sum(F32 a) {  // the tree of simd::sum (avx512)
  float t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = a.v[i + 8] + a.v[i];
  for (int i = 0; i < 4; ++i) t6[i] = t3[i + 4] + t3[i];
  return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

struct I32 {
  int32_t v[16];
};
inline F32 to_float(I32 a) {
  F32 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return r;
}

struct Q {
  uint8_t v[4][64];
};
inline Q decode_q4k(const uint8_t* blk) {
  Q w;
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 64; ++t) {
      const uint8_t q = blk[20 + 64 * h + t];
      w.v[2 * h][t] = q & 0x0F;
      w.v[2 * h + 1][t] = q >> 4;
    }
  return w;
}
inline Q decode_q6k(const uint8_t* blk) {
  Q w;
  for (int t = 0; t < 64; ++t) {
    const uint8_t l0 = blk[t], l1 = blk[64 + t], qh = blk[128 + t];
    w.v[0][t] = static_cast<uint8_t>((l0 & 0x0F) | ((qh << 4) & 0x30));
    w.v[1][t] = static_cast<uint8_t>((l0 >> 4) | ((qh << 2) & 0x30));
    w.v[2][t] = static_cast<uint8_t>((l1 & 0x0F) | (qh & 0x30));
    w.v[3][t] = static_cast<uint8_t>((l1 >> 4) | ((qh >> 2) & 0x30));
  }
  return w;
}
// The 4 vectors' products added position by position in int16 — |Σ| ≤ 4 · kMaxQ · 127 (Q6_K: 32 004) fits, so
// nothing wraps and the sums are exact — then each lane's 4 positions in int32. Written so that the compiler
// vectorizes it (byte widening, 16-bit multiplies and adds: SSE2, NEON), which the lane-by-lane loop was not.
template <int kMaxQ>
inline I32 dot(const Q& w, const int8_t* xq) {
  static_assert(4 * kMaxQ * 127 <= 32767, "the 4 vectors' products must add in int16 without wrapping");
  int16_t p[64] = {};
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 64; ++i)
      p[i] = static_cast<int16_t>(p[i] + static_cast<int16_t>(w.v[c][i]) * static_cast<int16_t>(xq[64 * c + i]));
  I32 r;
  for (int l = 0; l < 16; ++l) r.v[l] = int32_t{p[4 * l]} + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3];
  return r;
}
inline float fp16(const uint8_t* p) {  // IEEE binary16 → float32 (exact)
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13) | (man ? 0x400000u : 0u);  // inf; NaN quieted (as vcvtph2ps)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // ±man · 2^−24 (exact), ±0 included
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void q4k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  const float d = fp16(blk), dmin = fp16(blk + 2);
  for (int l = 0; l < 16; ++l) {
    scale.v[l] = static_cast<float>(blk[4 + l / 2]) * d;
    offset.v[l] = static_cast<float>(blk[12 + l / 2]) * dmin;
  }
}
inline void q6k_scales(const uint8_t* blk, F32& scale, F32& offset) {
  const float d = fp16(blk + 208);
  for (int l = 0; l < 16; ++l) {
    scale.v[l] = static_cast<float>(static_cast<int8_t>(blk[192 + l])) * d;
    offset.v[l] = scale.v[l] * 32.f;
  }
}
// The 32-value block types: signed weights, products summed in int32 (Q8_0's 4 · 128 · 127 would wrap int16).
struct S {
  int8_t v[4][64];
};
inline S decode_q8_0(const uint8_t* blk) {
  S w;
  std::memcpy(w.v, blk + 16, 256);
  return w;
}
inline S decode_q5_0(const uint8_t* blk) {
  S w;
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 64; ++t) {
      const uint8_t q = blk[16 + 64 * h + t];
      const uint8_t nib[2] = {static_cast<uint8_t>(q & 0x0F), static_cast<uint8_t>(q >> 4)};
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * h + e, pos = 64 * c + t;  // its high bit: bit pos / 32 of byte pos % 32
        const int high = (blk[144 + (pos & 31)] >> (pos >> 5)) & 1;
        w.v[c][t] = static_cast<int8_t>((nib[e] | (high << 4)) - 16);
      }
    }
  return w;
}
template <bool kQ5>
inline I32 sdot(const S& w, const int8_t* xq, const int32_t* /*xsum: signed weights need no offset*/) {
  int32_t p[64] = {};
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 64; ++i) p[i] += int32_t{w.v[c][i]} * int32_t{xq[64 * c + i]};
  I32 r;
  for (int l = 0; l < 16; ++l) r.v[l] = p[4 * l] + p[4 * l + 1] + p[4 * l + 2] + p[4 * l + 3];
  return r;
}
inline F32 d32_scales(const uint8_t* blk) {
  F32 r;
  for (int l = 0; l < 16; ++l) r.v[l] = fp16(blk + 2 * (l / 2));
  return r;
}
inline void prefetch(const uint8_t* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 0);
#else
  (void)p;
#endif
}

#endif

}  // namespace simd
}  // namespace KQ_VARIANT
}  // namespace redwood_kq
