// The core's parallel_for (kquant.h) for the standalone test programs: chunks of `grain` in turn, on one thread (no
// result of the core depends on the split).
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>

#include "kquant.h"

namespace redwood_kq {
inline namespace KQ_VARIANT {
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t step = std::max<int64_t>(grain, 1);
  for (int64_t b = begin; b < end; b += step) fn(b, std::min(end, b + step));
}
}  // namespace KQ_VARIANT
}  // namespace redwood_kq
