// Row-wise CUDA kernels: RMSNorm (optionally with the residual add), rotary embedding,
// SiLU-and-mul and the KV-cache write. fp32 arithmetic; rounding through the storage
// type where transformers rounds (see ../cpu_kernels.cpp).
#include "common.cuh"

namespace turbo_cuda {
namespace {

constexpr int kRowThreads = 256;

// One block per row.
template <typename T>
__global__ void rms_norm_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                                T* residual, int64_t residual_stride, const T* weight,
                                int64_t dim, float eps) {
  __shared__ float scratch[kRowThreads / kWarp];
  const int64_t row = blockIdx.x;
  const T* in = x + row * x_stride;
  T* res = residual == nullptr ? nullptr : residual + row * residual_stride;
  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = to_float(in[i]);
    if (res != nullptr) {
      const T sum = from_float<T>(to_float(res[i]) + v);
      res[i] = sum;
      v = to_float(sum);
    }
    sum_sq += v * v;
  }
  sum_sq = block_reduce<false>(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(dim) + eps);
  const T* normed_in = res != nullptr ? res : in;  // each thread re-reads what it wrote
  T* o = out + row * out_stride;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float normed = round_through<T>(to_float(normed_in[i]) * inv_rms);
    o[i] = from_float<T>(to_float(weight[i]) * normed);
  }
}

// One block per token; threads over (head, pair) of q's then k's heads.
template <typename T>
__global__ void rotary_kernel(const int32_t* positions, T* q, int64_t q_stride,
                              int64_t num_heads, T* k, int64_t k_stride, int64_t num_kv_heads,
                              const float* cos_sin, int64_t head_dim) {
  const int64_t t = blockIdx.x;
  const int64_t half = head_dim / 2;
  const float* cos = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
  const float* sin = cos + half;
  for (int64_t i = threadIdx.x; i < (num_heads + num_kv_heads) * half; i += blockDim.x) {
    const int64_t head = i / half, pair = i % half;
    T* x = head < num_heads ? q + t * q_stride + head * head_dim
                            : k + t * k_stride + (head - num_heads) * head_dim;
    const float x1 = to_float(x[pair]), x2 = to_float(x[pair + half]);
    x[pair] = from_float<T>(x1 * cos[pair] - x2 * sin[pair]);
    x[pair + half] = from_float<T>(x2 * cos[pair] + x1 * sin[pair]);
  }
}

template <typename T>
__global__ void silu_and_mul_kernel(T* out, int64_t out_stride, const T* gate_up,
                                    int64_t in_stride, int64_t width) {
  const int64_t row = blockIdx.x;
  const T* gate = gate_up + row * in_stride;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float g = to_float(gate[i]);
    const float act = round_through<T>(g / (1.f + __expf(-g)));
    out[row * out_stride + i] = from_float<T>(act * to_float(gate[width + i]));
  }
}

template <typename T>
__global__ void write_kv_kernel(const T* key, int64_t key_stride, const T* value,
                                int64_t value_stride, T* k_cache, T* v_cache,
                                const int32_t* slots, int64_t row_elems) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
    k_cache[slot * row_elems + i] = key[t * key_stride + i];
    v_cache[slot * row_elems + i] = value[t * value_stride + i];
  }
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

extern "C" cudaError_t turbo_cuda_rms_norm(int dtype, void* out, int64_t out_stride,
                                           const void* x, int64_t x_stride, void* residual,
                                           int64_t residual_stride, const void* weight,
                                           int64_t rows, int64_t dim, float eps,
                                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  TURBO_CUDA_DISPATCH(dtype, rms_norm_kernel<T><<<rows, kRowThreads, 0, stream>>>(
                                 static_cast<T*>(out), out_stride, static_cast<const T*>(x),
                                 x_stride, static_cast<T*>(residual), residual_stride,
                                 static_cast<const T*>(weight), dim, eps));
}

extern "C" cudaError_t turbo_cuda_rotary_embedding(int dtype, const int32_t* positions, void* q,
                                                   int64_t q_stride, int64_t num_heads, void* k,
                                                   int64_t k_stride, int64_t num_kv_heads,
                                                   const float* cos_sin, int64_t num_tokens,
                                                   int64_t head_dim, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  TURBO_CUDA_DISPATCH(dtype, rotary_kernel<T><<<num_tokens, kRowThreads, 0, stream>>>(
                                 positions, static_cast<T*>(q), q_stride, num_heads,
                                 static_cast<T*>(k), k_stride, num_kv_heads, cos_sin, head_dim));
}

extern "C" cudaError_t turbo_cuda_silu_and_mul(int dtype, void* out, int64_t out_stride,
                                               const void* gate_up, int64_t in_stride,
                                               int64_t rows, int64_t width,
                                               cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  TURBO_CUDA_DISPATCH(dtype, silu_and_mul_kernel<T><<<rows, kRowThreads, 0, stream>>>(
                                 static_cast<T*>(out), out_stride,
                                 static_cast<const T*>(gate_up), in_stride, width));
}

extern "C" cudaError_t turbo_cuda_write_kv_cache(int dtype, const void* key, int64_t key_stride,
                                                 const void* value, int64_t value_stride,
                                                 void* k_cache, void* v_cache,
                                                 const int32_t* slots, int64_t num_tokens,
                                                 int64_t row_elems, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  TURBO_CUDA_DISPATCH(dtype, write_kv_kernel<T><<<num_tokens, kRowThreads, 0, stream>>>(
                                 static_cast<const T*>(key), key_stride,
                                 static_cast<const T*>(value), value_stride,
                                 static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots,
                                 row_elems));
}
