// The kquant core (src/redwood/cpu_kernels/kquant.h) without torch: packs file rows and multiplies, for
// tests/cpu_kernels/test_variants.py (which builds it with each variant's flags, no torch headers on the include path)
// and for a cross-compiled build run under an emulator.
//
// stdin:  int64 M, K, N, type; float32 x [M, K]; uint8 file rows [N, K / file block values · file block bytes]
// stdout: the variant's name and a newline; uint8 packed rows [N, ceil(K / 256) · block bytes]; float32 y [M, N]
// (K: a multiple of the type's file block, 256 or 32; a row of 32-value blocks is padded to whole super-blocks)
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kq_serial_for.h"
#include "kquant.h"

template <typename T>
static bool read_all(std::vector<T>& v) {
  return std::fread(v.data(), sizeof(T), v.size(), stdin) == v.size();
}

int main() {
  std::vector<int64_t> hdr(4);
  if (!read_all(hdr)) return 2;
  const int64_t M = hdr[0], K = hdr[1], N = hdr[2], type = hdr[3];
  const int64_t fb = redwood_kq::file_block_bytes(type), fv = redwood_kq::file_block_values(type);
  const int64_t bb = redwood_kq::block_bytes(type), nb = (K + 255) / 256;
  if (fb < 0 || K % fv) return 3;
  const int64_t row = K / fv * fb;
  std::vector<float> x(M * K);
  std::vector<uint8_t> rows(N * row), packed(N * nb * bb);
  if (!read_all(x) || !read_all(rows)) return 4;
  redwood_kq::pack_rows(rows.data(), N, row, type, packed.data());
  std::vector<float> y(M * N);
  redwood_kq::matmul(x.data(), M, K, K, packed.data(), N, nb * bb, type, y.data(), N);
  std::printf("%s\n", redwood_kq::variant());
  std::fwrite(packed.data(), 1, packed.size(), stdout);
  std::fwrite(y.data(), sizeof(float), y.size(), stdout);
  return 0;
}
