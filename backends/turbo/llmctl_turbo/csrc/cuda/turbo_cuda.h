/* turbo's CUDA kernels behind a C ABI: raw pointers, sizes, strides and a stream.
 *
 * Included by the .cu files and by the C++ binding (cuda_ops.cpp); needs only the CUDA
 * runtime headers, no torch. Semantics and layouts are those of ../kernels.h; every
 * stride counts elements, not bytes. Each function launches asynchronously on `stream`
 * and returns the launch's cudaError_t (cudaSuccess == 0).
 */
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Storage type of every floating tensor of one call. */
enum turbo_dtype { TURBO_FLOAT32 = 0, TURBO_BFLOAT16 = 1, TURBO_FLOAT16 = 2 };

/* Largest head_dim the attention kernel supports. */
#define TURBO_CUDA_MAX_HEAD_DIM 256

/* out[r] = x[r] / rms(x[r]) * weight. With residual != NULL: residual[r] += x[r] first
 * and the norm is of the sum. */
cudaError_t turbo_cuda_rms_norm(int dtype, void* out, int64_t out_stride, const void* x,
                                int64_t x_stride, void* residual, int64_t residual_stride,
                                const void* weight, int64_t rows, int64_t dim, float eps,
                                cudaStream_t stream);

/* Rotate-half RoPE of q [T, H, D] and k [T, KVH, D] in place; cos_sin is fp32
 * [max_positions, D] (cos in the first half of a row, sin in the second). */
cudaError_t turbo_cuda_rotary_embedding(int dtype, const int32_t* positions, void* q,
                                        int64_t q_stride, int64_t num_heads, void* k,
                                        int64_t k_stride, int64_t num_kv_heads,
                                        const float* cos_sin, int64_t num_tokens,
                                        int64_t head_dim, cudaStream_t stream);

/* out [rows, width] = silu(gate_up[:, :width]) * gate_up[:, width:] */
cudaError_t turbo_cuda_silu_and_mul(int dtype, void* out, int64_t out_stride,
                                    const void* gate_up, int64_t in_stride, int64_t rows,
                                    int64_t width, cudaStream_t stream);

/* Copies row t of key/value (row_elems = KVH * D elements) to cache slot slots[t];
 * a negative slot skips the token. */
cudaError_t turbo_cuda_write_kv_cache(int dtype, const void* key, int64_t key_stride,
                                      const void* value, int64_t value_stride, void* k_cache,
                                      void* v_cache, const int32_t* slots, int64_t num_tokens,
                                      int64_t row_elems, cudaStream_t stream);

/* Causal paged attention; the queries of sequence b are the last q_len tokens of its
 * context_lens[b]. head_dim <= TURBO_CUDA_MAX_HEAD_DIM. */
cudaError_t turbo_cuda_paged_attention(int dtype, void* out, int64_t out_stride, const void* q,
                                       int64_t q_stride, const void* k_cache,
                                       const void* v_cache, const int32_t* block_tables,
                                       int64_t table_stride, const int32_t* query_start_loc,
                                       const int32_t* context_lens, int64_t num_seqs,
                                       int64_t num_tokens, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
