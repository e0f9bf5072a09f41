// Helpers shared by turbo's .cu files: storage-type conversion, block reductions and the
// dtype switch of the C ABI. CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "turbo_cuda.h"

namespace turbo_cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
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

}  // namespace turbo_cuda
