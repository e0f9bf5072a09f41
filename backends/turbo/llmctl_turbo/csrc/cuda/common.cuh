// Helpers shared by turbo's .cu files: storage-type conversion, 16-byte vectors, block
// reductions, fast division and the dtype switch of the C ABI. CUDA headers only.
//
// The same sources also compile as plain C++ for the CPU emulator of the tests
// (tests/backends/turbo/cuda_emulator), which defines TURBO_LAUNCH and
// TURBO_DYNAMIC_SHARED itself; nothing else here knows about it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "turbo_cuda.h"

// kernel<<<grid, block, shared_bytes, stream>>>(args...) is written
// TURBO_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...).
#ifndef TURBO_LAUNCH
#define TURBO_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  kernel<<<grid, block, shared_bytes, stream>>>
#endif

// The block's dynamic shared memory as an array of `type`, 16-byte aligned.
#ifndef TURBO_DYNAMIC_SHARED
#define TURBO_DYNAMIC_SHARED(type, name)            \
  extern __shared__ __align__(16) char name##_raw[]; \
  type* name = reinterpret_cast<type*>(name##_raw)
#endif

namespace turbo_cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(int8_t v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Rounds through the storage type, where transformers rounds between two ops.
template <typename T>
__device__ __forceinline__ float round_through(float v) {
  return to_float(from_float<T>(v));
}

// ------------------------------------------------------------------ 16-byte vectors

// Elements of T in one 16-byte load (uint4): 4 floats or 8 halves.
template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

// Unpacks a 16-byte vector of T into floats (two halves per word, the lower address in
// the low 16 bits).
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[kVecElems<T>]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = __uint_as_float(words[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[2 * i] = __uint_as_float(words[i] << 16);  // bf16 is the top half of a float
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    } else {
      out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i])));
      out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
    }
  }
}

__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 v) {
  return __bfloat16_as_ushort(v);
}
__device__ __forceinline__ unsigned short bits_of(__half v) { return __half_as_ushort(v); }

// Packs floats into a 16-byte vector of T (round to nearest even).
template <typename T>
__device__ __forceinline__ uint4 pack(const float (&in)[kVecElems<T>]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      words[i] = __float_as_uint(in[i]);
    } else {
      words[i] = static_cast<uint32_t>(bits_of(from_float<T>(in[2 * i]))) |
                 (static_cast<uint32_t>(bits_of(from_float<T>(in[2 * i + 1]))) << 16);
    }
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

__device__ __forceinline__ uint4 load16(const void* p) { return *static_cast<const uint4*>(p); }
__device__ __forceinline__ void store16(void* p, const uint4& v) { *static_cast<uint4*>(p) = v; }

// ------------------------------------------------------------------ reductions

constexpr int kWarp = 32;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum (or max) over the whole block, returned to every thread. `scratch` holds one float
// per warp; blockDim.x must be a multiple of 32.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : (kMax ? -INFINITY : 0.f);
  return kMax ? warp_max(v) : warp_sum(v);
}

// ------------------------------------------------------------------ fast division

// n / d and n % d for a divisor fixed at launch and 0 <= n < 2^31, by a multiply-high
// and a shift (CUTLASS's FastDivmod): integer division is ~20 instructions on the GPU,
// and the attention kernels divide every token index by the block size.
struct FastDivmod {
  uint32_t divisor = 1, multiplier = 0, shift = 0;

  FastDivmod() = default;
  __host__ __device__ explicit FastDivmod(uint32_t d) : divisor(d) {
    if (d == 1) return;
    uint32_t log2_ceil = 0;
    while ((1u << log2_ceil) < d) ++log2_ceil;
    const uint32_t p = 31 + log2_ceil;
    multiplier = static_cast<uint32_t>(((1ull << p) + d - 1) / d);
    shift = p - 32;
  }

  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return divisor == 1 ? n : __umulhi(n, multiplier) >> shift;
  }
  __device__ __forceinline__ void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

// Row of the paged cache holding token `token` of a sequence whose block table is
// `table`: table[token / block_size] * block_size + token % block_size.
__device__ __forceinline__ int64_t cache_row(const int32_t* table, int token,
                                             const FastDivmod& block_size) {
  uint32_t block, offset;
  block_size.divmod(static_cast<uint32_t>(token), block, offset);
  return static_cast<int64_t>(table[block]) * block_size.divisor + offset;
}

// ------------------------------------------------------------------ paged attention

// What every paged-attention kernel reads, typed (layouts: ../kernels.h).
template <typename T>
struct PagedAttentionArgs {
  T* out;
  int64_t out_stride;
  const T* q;
  int64_t q_stride;
  const T* k_cache;
  const T* v_cache;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* context_lens;
  int num_heads, num_kv_heads, head_dim, group;  // group: query heads per KV head
  FastDivmod block_size;
  float scale_log2;  // softmax scale * log2(e): the kernels exponentiate in base 2
};

template <typename T>
PagedAttentionArgs<T> paged_attention_args(void* out, int64_t out_stride, const void* q,
                                           int64_t q_stride, const void* k_cache,
                                           const void* v_cache, const int32_t* block_tables,
                                           int64_t table_stride, const int32_t* context_lens,
                                           int64_t num_heads, int64_t num_kv_heads,
                                           int64_t head_dim, int64_t block_size, float scale) {
  constexpr float kLog2e = 1.4426950408889634f;
  return {static_cast<T*>(out),
          out_stride,
          static_cast<const T*>(q),
          q_stride,
          static_cast<const T*>(k_cache),
          static_cast<const T*>(v_cache),
          block_tables,
          table_stride,
          context_lens,
          static_cast<int>(num_heads),
          static_cast<int>(num_kv_heads),
          static_cast<int>(head_dim),
          static_cast<int>(num_heads / num_kv_heads),
          FastDivmod(static_cast<uint32_t>(block_size)),
          scale * kLog2e};
}

// ------------------------------------------------------------------ the C ABI's dtype

// Runs the statements with `T` bound to the storage type named by `dtype`, then returns
// the launch's error (an unknown dtype is cudaErrorInvalidValue).
#define TURBO_CUDA_DISPATCH(dtype, ...)   \
  switch (dtype) {                        \
    case TURBO_FLOAT32: {                 \
      using T = float;                    \
      __VA_ARGS__;                        \
      break;                              \
    }                                     \
    case TURBO_BFLOAT16: {                \
      using T = __nv_bfloat16;            \
      __VA_ARGS__;                        \
      break;                              \
    }                                     \
    case TURBO_FLOAT16: {                 \
      using T = __half;                   \
      __VA_ARGS__;                        \
      break;                              \
    }                                     \
    default:                              \
      return cudaErrorInvalidValue;       \
  }                                       \
  return cudaGetLastError()

inline unsigned int blocks_for(int64_t n, int threads) {
  return static_cast<unsigned int>((n + threads - 1) / threads);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace turbo_cuda
