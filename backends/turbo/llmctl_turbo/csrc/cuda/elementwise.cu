// Row-wise CUDA kernels: RMSNorm (optionally with the residual add), rotary embedding
// (alone, or fused with the KV-cache write), SiLU-and-mul and the KV-cache write (float,
// or int8 with a scale per token and KV head).
// fp32 arithmetic; rounding through the storage type where transformers rounds (see
// ../cpu_kernels.cpp). Rows whose length, pointers and strides allow it are read and
// written as 16-byte vectors (kN elements per access); others one element at a time.
#include <initializer_list>

#include "common.cuh"

namespace turbo_cuda {
namespace {

constexpr int kRowThreads = 256;

// kN consecutive elements as floats: one 16-byte vector, or kN = 1 scalars.
template <typename T, int kN>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[kN]) {
  if constexpr (kN == kVecElems<T>) {
    unpack<T>(load16(p), out);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) out[i] = to_float(p[i]);
  }
}

template <typename T, int kN>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[kN]) {
  if constexpr (kN == kVecElems<T>) {
    store16(p, pack<T>(in));
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) p[i] = from_float<T>(in[i]);
  }
}

// Whether rows of `elems` elements at these pointers and strides allow 16-byte accesses.
template <typename T>
bool vectorizable(int64_t elems, std::initializer_list<const void*> pointers,
                  std::initializer_list<int64_t> strides) {
  bool ok = elems % kVecElems<T> == 0;
  for (const void* p : pointers) ok &= p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
  for (int64_t s : strides) ok &= s % kVecElems<T> == 0;
  return ok;
}

// One block per row.
template <typename T, int kN>
__global__ void rms_norm_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                                T* residual, int64_t residual_stride, const T* weight,
                                int64_t dim, float eps) {
  __shared__ float scratch[kRowThreads / kWarp];
  const int64_t row = blockIdx.x;
  const T* in = x + row * x_stride;
  T* res = residual == nullptr ? nullptr : residual + row * residual_stride;
  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x * kN; i < dim; i += blockDim.x * kN) {
    float v[kN];
    load_floats<T, kN>(in + i, v);
    if (res != nullptr) {
      float r[kN];
      load_floats<T, kN>(res + i, r);
#pragma unroll
      for (int e = 0; e < kN; ++e) v[e] = round_through<T>(r[e] + v[e]);
      store_floats<T, kN>(res + i, v);
    }
#pragma unroll
    for (int e = 0; e < kN; ++e) sum_sq += v[e] * v[e];
  }
  sum_sq = block_reduce<false>(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(dim) + eps);
  const T* normed_in = res != nullptr ? res : in;  // each thread re-reads what it wrote
  T* o = out + row * out_stride;
  for (int64_t i = threadIdx.x * kN; i < dim; i += blockDim.x * kN) {
    float v[kN], w[kN];
    load_floats<T, kN>(normed_in + i, v);
    load_floats<T, kN>(weight + i, w);
#pragma unroll
    for (int e = 0; e < kN; ++e) v[e] = w[e] * round_through<T>(v[e] * inv_rms);
    store_floats<T, kN>(o + i, v);
  }
}

// One token's K and V rows [num_kv_heads, head_dim] quantized into an int8 cache slot, as
// llmctl.engine.quant.quantize_kv: one warp per (K or V, KV head) row takes its absmax,
// scale = absmax / 127 (1 for an all-zero row), q = round-half-even(x / scale) clamped.
template <typename T>
__device__ void quantize_kv_rows(const T* key, const T* value, int64_t num_kv_heads,
                                 int64_t head_dim, int8_t* k_cache, int8_t* v_cache,
                                 float* k_scale, float* v_scale) {
  const int lane = threadIdx.x % kWarp;
  const int num_warps = blockDim.x / kWarp;
  for (int64_t r = threadIdx.x / kWarp; r < 2 * num_kv_heads; r += num_warps) {
    const bool is_key = r < num_kv_heads;
    const int64_t head = is_key ? r : r - num_kv_heads;
    const T* x = (is_key ? key : value) + head * head_dim;
    int8_t* q = (is_key ? k_cache : v_cache) + head * head_dim;
    float absmax = 0.f;
    for (int64_t d = lane; d < head_dim; d += kWarp) absmax = fmaxf(absmax, fabsf(to_float(x[d])));
    absmax = warp_max(absmax);
    const float scale = absmax > 0.f ? absmax / 127.f : 1.f;
    for (int64_t d = lane; d < head_dim; d += kWarp) {
      const int v = __float2int_rn(to_float(x[d]) / scale);  // a true division, as torch
      q[d] = static_cast<int8_t>(max(-127, min(127, v)));
    }
    if (lane == 0) (is_key ? k_scale : v_scale)[head] = scale;
  }
}

// One block per token: q's heads, then k's, rotated in place. With k_cache != nullptr
// the token's rotated k and its v are then copied to cache slot slots[t] (the KV write
// fused in: the row is still in cache, and one launch is saved per layer); with k_scale
// != nullptr the cache is int8 and they are quantized (quantize_kv_rows).
template <typename T>
__global__ void rotary_kernel(const int32_t* positions, T* q, int64_t q_stride,
                              int64_t num_heads, T* k, int64_t k_stride, const T* v,
                              int64_t v_stride, int64_t num_kv_heads, const float* cos_sin,
                              int64_t head_dim, void* k_cache, void* v_cache,
                              const int32_t* slots, float* k_scale, float* v_scale) {
  const int64_t t = blockIdx.x;
  const int64_t half = head_dim / 2;
  const float* cos = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
  const float* sin = cos + half;
  // Each thread owns pairs of the flattened (head, pair) index, q's heads first.
  for (int64_t i = threadIdx.x; i < (num_heads + num_kv_heads) * half; i += blockDim.x) {
    const int64_t head = i / half, pair = i % half;
    T* x = head < num_heads ? q + t * q_stride + head * head_dim
                            : k + t * k_stride + (head - num_heads) * head_dim;
    const float x1 = to_float(x[pair]), x2 = to_float(x[pair + half]);
    x[pair] = from_float<T>(x1 * cos[pair] - x2 * sin[pair]);
    x[pair + half] = from_float<T>(x2 * cos[pair] + x1 * sin[pair]);
  }
  if (k_cache == nullptr) return;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  __syncthreads();  // the rotated k row is complete
  const int64_t row_elems = num_kv_heads * head_dim;
  if (k_scale != nullptr) {
    quantize_kv_rows<T>(k + t * k_stride, v + t * v_stride, num_kv_heads, head_dim,
                        static_cast<int8_t*>(k_cache) + slot * row_elems,
                        static_cast<int8_t*>(v_cache) + slot * row_elems,
                        k_scale + slot * num_kv_heads, v_scale + slot * num_kv_heads);
    return;
  }
  for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
    static_cast<T*>(k_cache)[slot * row_elems + i] = k[t * k_stride + i];
    static_cast<T*>(v_cache)[slot * row_elems + i] = v[t * v_stride + i];
  }
}

template <typename T, int kN>
__global__ void silu_and_mul_kernel(T* out, int64_t out_stride, const T* gate_up,
                                    int64_t in_stride, int64_t width) {
  const int64_t row = blockIdx.x;
  const T* gate = gate_up + row * in_stride;
  for (int64_t i = threadIdx.x * kN; i < width; i += blockDim.x * kN) {
    float g[kN], up[kN];
    load_floats<T, kN>(gate + i, g);
    load_floats<T, kN>(gate + width + i, up);
#pragma unroll
    for (int e = 0; e < kN; ++e) g[e] = round_through<T>(g[e] / (1.f + __expf(-g[e]))) * up[e];
    store_floats<T, kN>(out + row * out_stride + i, g);
  }
}

template <typename T, int kN>
__global__ void write_kv_kernel(const T* key, int64_t key_stride, const T* value,
                                int64_t value_stride, T* k_cache, T* v_cache,
                                const int32_t* slots, int64_t row_elems) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  for (int64_t i = threadIdx.x * kN; i < row_elems; i += blockDim.x * kN) {
    if constexpr (kN == kVecElems<T>) {
      store16(k_cache + slot * row_elems + i, load16(key + t * key_stride + i));
      store16(v_cache + slot * row_elems + i, load16(value + t * value_stride + i));
    } else {
      k_cache[slot * row_elems + i] = key[t * key_stride + i];
      v_cache[slot * row_elems + i] = value[t * value_stride + i];
    }
  }
}

// One block per token into an int8 cache (quantize_kv_rows).
template <typename T>
__global__ void write_kv_int8_kernel(const T* key, int64_t key_stride, const T* value,
                                     int64_t value_stride, int8_t* k_cache, int8_t* v_cache,
                                     float* k_scale, float* v_scale, const int32_t* slots,
                                     int64_t num_kv_heads, int64_t head_dim) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t row_elems = num_kv_heads * head_dim;
  quantize_kv_rows<T>(key + t * key_stride, value + t * value_stride, num_kv_heads, head_dim,
                      k_cache + slot * row_elems, v_cache + slot * row_elems,
                      k_scale + slot * num_kv_heads, v_scale + slot * num_kv_heads);
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

// Launches kernel<T, kVecElems<T>> when `vector` holds, else kernel<T, 1>.
#define TURBO_LAUNCH_VECTORIZED(kernel, vector, grid, block, stream, ...)                \
  do {                                                                                 \
    if (vector) {                                                                      \
      const auto wide = kernel<T, kVecElems<T>>;                                       \
      TURBO_LAUNCH(wide, grid, block, 0, stream)(__VA_ARGS__);                         \
    } else {                                                                           \
      const auto narrow = kernel<T, 1>;                                                \
      TURBO_LAUNCH(narrow, grid, block, 0, stream)(__VA_ARGS__);                       \
    }                                                                                  \
  } while (0)

extern "C" cudaError_t turbo_cuda_rms_norm(int dtype, void* out, int64_t out_stride,
                                           const void* x, int64_t x_stride, void* residual,
                                           int64_t residual_stride, const void* weight,
                                           int64_t rows, int64_t dim, float eps,
                                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  TURBO_CUDA_DISPATCH(
      dtype,
      const bool vector = vectorizable<T>(dim, {out, x, residual, weight},
                                          {out_stride, x_stride, residual_stride});
      TURBO_LAUNCH_VECTORIZED(rms_norm_kernel, vector, static_cast<unsigned int>(rows),
                              kRowThreads, stream, static_cast<T*>(out), out_stride,
                              static_cast<const T*>(x), x_stride, static_cast<T*>(residual),
                              residual_stride, static_cast<const T*>(weight), dim, eps));
}

extern "C" cudaError_t turbo_cuda_rotary_embedding(int dtype, const int32_t* positions, void* q,
                                                   int64_t q_stride, int64_t num_heads, void* k,
                                                   int64_t k_stride, int64_t num_kv_heads,
                                                   const float* cos_sin, int64_t num_tokens,
                                                   int64_t head_dim, cudaStream_t stream) {
  return turbo_cuda_rotary_write_kv(dtype, positions, q, q_stride, num_heads, k, k_stride,
                                    nullptr, 0, num_kv_heads, cos_sin, nullptr, nullptr,
                                    nullptr, nullptr, nullptr, num_tokens, head_dim, stream);
}

extern "C" cudaError_t turbo_cuda_rotary_write_kv(int dtype, const int32_t* positions, void* q,
                                                  int64_t q_stride, int64_t num_heads, void* k,
                                                  int64_t k_stride, const void* v,
                                                  int64_t v_stride, int64_t num_kv_heads,
                                                  const float* cos_sin, void* k_cache,
                                                  void* v_cache, const int32_t* slots,
                                                  float* k_scale, float* v_scale,
                                                  int64_t num_tokens, int64_t head_dim,
                                                  cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  TURBO_CUDA_DISPATCH(dtype, const auto kernel = rotary_kernel<T>;
                      TURBO_LAUNCH(kernel, static_cast<unsigned int>(num_tokens), kRowThreads,
                                   0, stream)(positions, static_cast<T*>(q), q_stride, num_heads,
                                              static_cast<T*>(k), k_stride,
                                              static_cast<const T*>(v), v_stride, num_kv_heads,
                                              cos_sin, head_dim, k_cache, v_cache, slots,
                                              k_scale, v_scale));
}

extern "C" cudaError_t turbo_cuda_silu_and_mul(int dtype, void* out, int64_t out_stride,
                                               const void* gate_up, int64_t in_stride,
                                               int64_t rows, int64_t width,
                                               cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  TURBO_CUDA_DISPATCH(
      dtype, const bool vector = vectorizable<T>(width, {out, gate_up}, {out_stride, in_stride});
      TURBO_LAUNCH_VECTORIZED(silu_and_mul_kernel, vector, static_cast<unsigned int>(rows),
                              kRowThreads, stream, static_cast<T*>(out), out_stride,
                              static_cast<const T*>(gate_up), in_stride, width));
}

extern "C" cudaError_t turbo_cuda_write_kv_cache(int dtype, const void* key, int64_t key_stride,
                                                 const void* value, int64_t value_stride,
                                                 void* k_cache, void* v_cache,
                                                 const int32_t* slots, float* k_scale,
                                                 float* v_scale, int64_t num_tokens,
                                                 int64_t num_kv_heads, int64_t head_dim,
                                                 cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t row_elems = num_kv_heads * head_dim;
  if (k_scale != nullptr) {
    TURBO_CUDA_DISPATCH(dtype, const auto kernel = write_kv_int8_kernel<T>;
                        TURBO_LAUNCH(kernel, static_cast<unsigned int>(num_tokens), kRowThreads,
                                     0, stream)(static_cast<const T*>(key), key_stride,
                                                static_cast<const T*>(value), value_stride,
                                                static_cast<int8_t*>(k_cache),
                                                static_cast<int8_t*>(v_cache), k_scale, v_scale,
                                                slots, num_kv_heads, head_dim));
  }
  TURBO_CUDA_DISPATCH(
      dtype,
      const bool vector = vectorizable<T>(row_elems, {key, value, k_cache, v_cache},
                                          {key_stride, value_stride});
      TURBO_LAUNCH_VECTORIZED(write_kv_kernel, vector, static_cast<unsigned int>(num_tokens),
                              kRowThreads, stream, static_cast<const T*>(key), key_stride,
                              static_cast<const T*>(value), value_stride,
                              static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots,
                              row_elems));
}
