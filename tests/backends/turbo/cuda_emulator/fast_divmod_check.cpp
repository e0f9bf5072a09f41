// FastDivmod (csrc/cuda/common.cuh) against the / and % operators, for the tests.
#include <cstdint>

#include "cuda_emulator.h"
#include "common.cuh"

// Dividends checked: every n below `dense`, then a sparse sweep up to 2^31 - 1.
extern "C" int64_t turbo_emulator_fast_divmod_mismatches(uint32_t divisor, uint32_t dense) {
  const turbo_cuda::FastDivmod fast(divisor);
  int64_t mismatches = 0;
  auto check = [&](uint32_t n) {
    uint32_t q, r;
    fast.divmod(n, q, r);
    mismatches += q != n / divisor || r != n % divisor;
  };
  for (uint32_t n = 0; n < dense; ++n) check(n);
  for (uint64_t n = dense; n < (1ull << 31); n = n * 1.0001 + 7919) check(static_cast<uint32_t>(n));
  check((1u << 31) - 1);
  return mismatches;
}
