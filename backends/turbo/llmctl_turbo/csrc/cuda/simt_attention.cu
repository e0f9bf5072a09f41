// Paged attention on CUDA, SIMT: one thread block per (query token, query head).
//
// The general path: any head_dim up to 256, any dtype. turbo uses it for fp32 prefill
// and for head_dims the vectorised kernels do not take (decode_attention.cu,
// prefill_attention.cu); it is also their reference in the GPU checks.
//
// Keys are taken in tiles of kThreads, one key per thread: each thread scores its key,
// the block agrees on the running max (online softmax, rescaling what was accumulated),
// then threads switch to one output dimension each and sum the tile's values, so value
// rows are read coalesced. head_dim <= 2 * kThreads = TURBO_CUDA_MAX_HEAD_DIM.
//
// It alone reads an int8 KV cache (kv_cache_dtype=int8; C = int8_t): a float32 scale per
// cache row and KV head, the K scale folded into the key's score, the V scale into the
// key's softmax weight, so rows are never dequantized into memory.
#include <type_traits>

#include "common.cuh"

namespace turbo_cuda {
namespace {

constexpr int kThreads = 128;
static_assert(2 * kThreads == TURBO_CUDA_MAX_HEAD_DIM, "each thread owns two output dims");

// C: the cache's storage type, T or int8_t (then k_scale / v_scale [rows, num_kv_heads]).
template <typename T, typename C>
__global__ void paged_attention_kernel(T* out, int64_t out_stride, const T* q, int64_t q_stride,
                                       const C* k_cache, const C* v_cache,
                                       const float* k_scale, const float* v_scale,
                                       const int32_t* block_tables, int64_t table_stride,
                                       const int32_t* query_start_loc,
                                       const int32_t* context_lens, int64_t num_seqs,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  __shared__ float q_scaled[TURBO_CUDA_MAX_HEAD_DIM];
  __shared__ float probs[kThreads];
  __shared__ int64_t key_rows[kThreads];  // cache row (block * block_size + offset) per key
  __shared__ float scratch[kThreads / kWarp];

  const int64_t t = blockIdx.x, head = blockIdx.y;
  const int64_t kv_head = head / (num_heads / num_kv_heads);
  const int64_t row_elems = num_kv_heads * head_dim;

  // The sequence of token t: the last b with query_start_loc[b] <= t.
  int64_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t b = lo;
  const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
  const int64_t num_keys = context_lens[b] - q_len + (t - query_start_loc[b]) + 1;
  const int32_t* table = block_tables + b * table_stride;

  for (int64_t d = threadIdx.x; d < head_dim; d += kThreads) {
    q_scaled[d] = to_float(q[t * q_stride + head * head_dim + d]) * scale;
  }
  __syncthreads();

  float running_max = -INFINITY, running_sum = 0.f;
  float acc[2] = {0.f, 0.f};
  for (int64_t tile = 0; tile < num_keys; tile += kThreads) {
    const int64_t j = tile + threadIdx.x;
    float score = -INFINITY;
    if (j < num_keys) {
      const int64_t row = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
      key_rows[threadIdx.x] = row;
      const C* k = k_cache + row * row_elems + kv_head * head_dim;
      score = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) score += q_scaled[d] * to_float(k[d]);
      if constexpr (kInt8) score *= k_scale[row * num_kv_heads + kv_head];
    }
    const float new_max = fmaxf(running_max, block_reduce<true>(score, scratch));
    const float p = j < num_keys ? __expf(score - new_max) : 0.f;
    float weight = p;  // an int8 cache: the value row's scale rides on its weight
    if constexpr (kInt8) {
      if (j < num_keys) weight *= v_scale[key_rows[threadIdx.x] * num_kv_heads + kv_head];
    }
    probs[threadIdx.x] = weight;
    const float correction = __expf(running_max - new_max);  // 0 on the first tile
    running_sum = running_sum * correction + block_reduce<false>(p, scratch);
    running_max = new_max;
    // block_reduce synchronised the block: probs and key_rows are visible to all.

    const int64_t count = min(static_cast<int64_t>(kThreads), num_keys - tile);
    for (int i = 0; i < 2; ++i) {
      const int64_t d = threadIdx.x + i * kThreads;
      if (d >= head_dim) break;
      float a = acc[i] * correction;
      for (int64_t jj = 0; jj < count; ++jj) {
        a += probs[jj] * to_float(v_cache[key_rows[jj] * row_elems + kv_head * head_dim + d]);
      }
      acc[i] = a;
    }
    __syncthreads();  // the next tile overwrites probs and key_rows
  }

  for (int i = 0; i < 2; ++i) {
    const int64_t d = threadIdx.x + i * kThreads;
    // No keys (a CUDA-graph batch's padding, context length 0): a zero output, not NaN.
    const float o = running_sum > 0.f ? acc[i] / running_sum : 0.f;
    if (d < head_dim) out[t * out_stride + head * head_dim + d] = from_float<T>(o);
  }
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

extern "C" cudaError_t turbo_cuda_paged_attention(
    int dtype, void* out, int64_t out_stride, const void* q, int64_t q_stride,
    const void* k_cache, const void* v_cache, const int32_t* block_tables, int64_t table_stride,
    const int32_t* query_start_loc, const int32_t* context_lens, int64_t num_seqs,
    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, const float* k_scale, const float* v_scale,
    cudaStream_t stream) {
  if (head_dim > TURBO_CUDA_MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned int>(num_tokens), static_cast<unsigned int>(num_heads));
  if (k_scale != nullptr) {
    TURBO_CUDA_DISPATCH(dtype, const auto kernel = paged_attention_kernel<T, int8_t>;
                        TURBO_LAUNCH(kernel, grid, kThreads, 0, stream)(
                            static_cast<T*>(out), out_stride, static_cast<const T*>(q),
                            q_stride, static_cast<const int8_t*>(k_cache),
                            static_cast<const int8_t*>(v_cache), k_scale, v_scale,
                            block_tables, table_stride, query_start_loc, context_lens,
                            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale));
  }
  TURBO_CUDA_DISPATCH(dtype, const auto kernel = paged_attention_kernel<T, T>;
                     TURBO_LAUNCH(kernel, grid, kThreads, 0, stream)(
                                 static_cast<T*>(out), out_stride, static_cast<const T*>(q),
                                 q_stride, static_cast<const T*>(k_cache),
                                 static_cast<const T*>(v_cache), nullptr, nullptr,
                                 block_tables, table_stride, query_start_loc, context_lens,
                                 num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                 scale));
}
