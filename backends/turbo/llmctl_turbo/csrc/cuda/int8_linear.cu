// The int8-weight linear layer for decode: out[r, n] = (x[r] . q[n]) * scale[n] + bias[n],
// q an int8 [N, K] matrix (row-major, llmctl.engine.quant's symmetric per-output-channel
// scheme), x in the model dtype, fp32 accumulation.
//
// Decode is bound by reading the weight, so each warp streams whole 16-byte runs of
// int8 weights for kFeatures output features, dequantizes them in registers and
// multiplies them with every row of its tile of up to kMaxRows activation rows: the
// weight is read once per tile of rows. The scale is applied once per output, after the
// warp's sum. Rows, K and pointers that do not allow 16-byte runs (K % 16 != 0,
// unaligned rows) take the same kernel one element per lane at a time.
#include "common.cuh"

namespace turbo_cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kFeatures = 2;     // output features per warp
constexpr int kRun = 16;         // int8 weights per 16-byte load
constexpr int kMaxRows = 8;      // activation rows per tile (a block serves one tile)

// kRun consecutive elements of x as floats (one or more 16-byte vectors, or scalars).
template <typename T, bool kVector>
__device__ __forceinline__ void load_run(const T* p, float (&out)[kRun]) {
  if constexpr (kVector) {
#pragma unroll
    for (int v = 0; v < kRun / kVecElems<T>; ++v) {
      float part[kVecElems<T>];
      unpack<T>(load16(p + v * kVecElems<T>), part);
#pragma unroll
      for (int e = 0; e < kVecElems<T>; ++e) out[v * kVecElems<T> + e] = part[e];
    }
  } else {
    out[0] = to_float(p[0]);
  }
}

// The kRun int8 weights at p as floats (kVector), or the one at p.
template <bool kVector>
__device__ __forceinline__ void load_weights(const int8_t* p, float (&out)[kRun]) {
  if constexpr (kVector) {
    const uint4 raw = load16(p);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        out[4 * i + b] = static_cast<float>(static_cast<int8_t>(words[i] >> (8 * b)));
      }
    }
  } else {
    out[0] = static_cast<float>(p[0]);
  }
}

// Grid: (feature tiles of kWarpsPerBlock * kFeatures, row tiles of kMaxRows).
template <typename T, bool kVector>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    int8_linear_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                       const int8_t* weight, const float* scale, const T* bias, int64_t rows,
                       int64_t features, int64_t in_features) {
  constexpr int kStep = kVector ? kRun : 1;  // elements of K per lane per load
  constexpr int kUsed = kVector ? kRun : 1;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t first_feature =
      (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * kFeatures;
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kMaxRows;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kMaxRows), rows - first_row));
  if (first_feature >= features) return;  // whole warps only: the shuffles below stay full
  const int tile_features =
      static_cast<int>(min(static_cast<int64_t>(kFeatures), features - first_feature));

  float acc[kMaxRows][kFeatures] = {};
  for (int64_t k = static_cast<int64_t>(lane) * kStep; k < in_features; k += kWarp * kStep) {
    float w[kFeatures][kRun];
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
      if (f < tile_features) {
        load_weights<kVector>(weight + (first_feature + f) * in_features + k, w[f]);
      } else {
#pragma unroll
        for (int e = 0; e < kUsed; ++e) w[f][e] = 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= tile_rows) break;
      float xs[kRun];
      load_run<T, kVector>(x + (first_row + r) * x_stride + k, xs);
#pragma unroll
      for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
        for (int e = 0; e < kUsed; ++e) acc[r][f] += xs[e] * w[f][e];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= tile_rows) break;
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
      const float sum = warp_sum(acc[r][f]);
      const int64_t n = first_feature + f;
      if (lane == 0 && f < tile_features) {
        const float value = sum * scale[n] + (bias == nullptr ? 0.f : to_float(bias[n]));
        out[(first_row + r) * out_stride + n] = from_float<T>(value);
      }
    }
  }
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

extern "C" int turbo_cuda_int8_linear_vectorized(int dtype, const void* x, int64_t x_stride,
                                                 const void* weight, int64_t in_features) {
  const int64_t elem_bytes = dtype == TURBO_FLOAT32 ? 4 : 2;
  return in_features % kRun == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && (x_stride * elem_bytes) % 16 == 0;
}

extern "C" cudaError_t turbo_cuda_int8_linear(int dtype, void* out, int64_t out_stride,
                                              const void* x, int64_t x_stride,
                                              const int8_t* weight, const float* scale,
                                              const void* bias, int64_t rows, int64_t features,
                                              int64_t in_features, cudaStream_t stream) {
  if (rows == 0 || features == 0) return cudaSuccess;
  const dim3 grid(blocks_for(features, kWarpsPerBlock * kFeatures),
                  blocks_for(rows, kMaxRows));
  const bool vector = turbo_cuda_int8_linear_vectorized(dtype, x, x_stride, weight, in_features);
  TURBO_CUDA_DISPATCH(
      dtype, const auto kernel = vector ? int8_linear_kernel<T, true> : int8_linear_kernel<T, false>;
      TURBO_LAUNCH(kernel, grid, kWarpsPerBlock * kWarp, 0, stream)(
          static_cast<T*>(out), out_stride, static_cast<const T*>(x), x_stride, weight, scale,
          static_cast<const T*>(bias), rows, features, in_features));
}
