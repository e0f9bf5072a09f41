// Tensor-core and async-copy instructions of sm_80+ (Ampere, Hopper) as device functions.
//
// Fragment layouts (PTX ISA, "warp-level matrix fragment" of mma.m16n8k16), for lane l,
// g = l / 4 and t = l % 4; each 32-bit register holds two 16-bit elements, the one with
// the smaller column (A, C) or row (B) index in the low half:
//   A 16x16 row-major: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8 col-major:  b0 (2t..2t+1, g), b1 (2t+8..2t+9, g)
//   C 16x8 fp32:       c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)
// The CPU emulator of the tests provides the same functions (emulated_ptx.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#ifdef TURBO_CUDA_EMULATOR
#include "emulated_ptx.h"
#else

// cp.async and bf16 mma need sm_80. Built for an older GPU (turbo takes them too), the
// functions trap; the binding never launches the tensor-core kernel there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define TURBO_SM80(...) __trap()
#else
#define TURBO_SM80(...) __VA_ARGS__
#endif

namespace turbo_cuda {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit elements from shared memory: lanes 8i..8i+7 give the
// addresses of the 8 (16-byte) rows of matrix i; register i of lane l gets elements
// (l / 4, 2 (l % 4) + {0, 1}) of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  TURBO_SM80(asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                          : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                          : "r"(shared_address(row))));
}

// The same, transposed: register i of lane l gets elements (2 (l % 4) + {0, 1}, l / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  TURBO_SM80(asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(shared_address(row))));
}

// d += a b with a 16x16, b 16x8 of T (bfloat16 or half) and d 16x8 fp32.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    TURBO_SM80(asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)));
  } else {
    static_assert(std::is_same_v<T, __half>, "tensor-core mma runs bfloat16 or half");
    TURBO_SM80(asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)));
  }
}

// Copies 16 bytes from global to shared memory asynchronously, or writes 16 zero bytes
// when !valid (then src is not read).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  TURBO_SM80(asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                          :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0)
                          : "memory"));
}

__device__ __forceinline__ void cp_async_commit() {
  TURBO_SM80(asm volatile("cp.async.commit_group;\n" ::: "memory"));
}

// Waits for all but the most recently committed group of this thread's copies.
__device__ __forceinline__ void cp_async_wait_all_but_newest() {
  TURBO_SM80(asm volatile("cp.async.wait_group 1;\n" ::: "memory"));
}

// Waits for every copy this thread issued (the caller then syncs the block).
__device__ __forceinline__ void cp_async_wait_all() {
  TURBO_SM80(asm volatile("cp.async.wait_group 0;\n" ::: "memory"));
}

}  // namespace turbo_cuda

#endif  // TURBO_CUDA_EMULATOR

#include "common.cuh"

namespace turbo_cuda {

// Shared-memory tiles hold rows of kChunks 16-byte chunks; chunk c of row r is stored at
// c ^ (r % 8), so the 8 rows an ldmatrix phase reads fall in 8 different bank groups.
template <int kChunks>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kChunks + (chunk ^ (row & 7));
}

// Packs two floats into the 32-bit register of a T pair (the first in the low half): an
// fp32 accumulator fragment becomes an A operand this way.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  return static_cast<uint32_t>(bits_of(from_float<T>(lo))) |
         (static_cast<uint32_t>(bits_of(from_float<T>(hi))) << 16);
}

}  // namespace turbo_cuda
