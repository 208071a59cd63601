// The kquant product as a C++ call, for other kernels of the same extension (layer.cpp); defined in kquant.cpp.
#pragma once
#include <cstdint>

namespace redwood_kq {

// Bytes of one super-block of 256 values in the kernel's layout: Q4_K (type 12) 148, Q6_K (14) 210, else -1.
int64_t block_bytes(int64_t type);

// out[m·ldo + n] = Σ_k x[m·ldx + k]·W[n, k] for M float32 rows of k_in values and N packed weight rows of
// `row_bytes` (= K / 256 · block_bytes, K ≥ k_in: values past k_in are zero weights' padding, the rows are
// read as if padded with zeros). The same numbers as redwood_cpu::kquant_linear, bit for bit, at any M.
void matmul(const float* x, int64_t M, int64_t k_in, int64_t ldx, const uint8_t* w, int64_t N, int64_t row_bytes,
            int64_t type, float* out, int64_t ldo);

}  // namespace redwood_kq
