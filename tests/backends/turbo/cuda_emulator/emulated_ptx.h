// ptx.cuh's tensor-core and async-copy functions for the CPU emulator, written from the
// PTX ISA's definitions (fragment layouts in ptx.cuh). Warp-collective instructions
// gather every lane's operands with turbo_emu::warp_exchange.
#pragma once

#include <cstring>

namespace turbo_cuda {

namespace emulated {

template <typename T>
inline float half_to_float(uint16_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

inline uint16_t half_of(uint32_t reg, int which) {
  return static_cast<uint16_t>(which ? reg >> 16 : reg & 0xffffu);
}

template <bool kTransposed>
inline void ldmatrix(uint32_t (&r)[4], const void* row) {
  const void* rows[32];
  turbo_emu::warp_exchange(&row, rows, sizeof(row));
  const int lane = turbo_emu::lane_id();
  for (int i = 0; i < 4; ++i) {
    uint16_t element[2];
    for (int j = 0; j < 2; ++j) {
      // Element (row, col) of matrix i is column `col` of the row lane 8i + row gave.
      const int matrix_row = kTransposed ? 2 * (lane % 4) + j : lane / 4;
      const int matrix_col = kTransposed ? lane / 4 : 2 * (lane % 4) + j;
      std::memcpy(&element[j], static_cast<const char*>(rows[8 * i + matrix_row]) + 2 * matrix_col, 2);
    }
    r[i] = element[0] | (static_cast<uint32_t>(element[1]) << 16);
  }
}

}  // namespace emulated

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emulated::ldmatrix<false>(r, row); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  emulated::ldmatrix<true>(r, row);
}

template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  // Each lane converts its own operands once; then every lane sees all of them.
  struct Operands {
    float a[8], b[4];  // a[2 r + h]: half h of register r
  };
  Operands mine;
  const uint32_t b[2] = {b0, b1};
  for (int i = 0; i < 8; ++i) mine.a[i] = emulated::half_to_float<T>(emulated::half_of(a[i / 2], i % 2));
  for (int i = 0; i < 4; ++i) mine.b[i] = emulated::half_to_float<T>(emulated::half_of(b[i / 2], i % 2));
  Operands all[32];
  turbo_emu::warp_exchange(&mine, all, sizeof(mine));
  auto a_at = [&](int row, int k) {  // the A layout of ptx.cuh, inverted
    const int lane = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return all[lane].a[2 * reg + k % 2];
  };
  auto b_at = [&](int k, int col) {
    const int lane = col * 4 + (k % 8) / 2;
    return all[lane].b[2 * (k >= 8 ? 1 : 0) + k % 2];
  };
  const int lane = turbo_emu::lane_id(), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + i % 2;
    float sum = d[i];
    for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
    d[i] = sum;
  }
}

// cp.async as the PTX ISA defines it: a copy lands when a wait_group covers its group,
// not before, so a kernel that reads shared memory too early reads stale data.
inline void cp_async_16(void* dst, const void* src, bool valid) {
  turbo_emu::async_copy(dst, src, valid ? 16 : 0);
}
inline void cp_async_commit() { turbo_emu::async_commit(); }
inline void cp_async_wait_all_but_newest() { turbo_emu::async_wait(1); }
inline void cp_async_wait_all() { turbo_emu::async_wait(0); }

}  // namespace turbo_cuda
