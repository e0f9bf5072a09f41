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

/* Copies row t of key/value [T, KVH, D] to cache slot slots[t]; a negative slot skips
 * the token. With k_scale == NULL the cache is in `dtype`; else it is int8 and each
 * (token, KV head) row is quantized as llmctl.engine.quant.quantize_kv (scale = absmax /
 * 127, 1 for an all-zero row; round-half-even of x / scale, clamped to +-127), its fp32
 * scale written to k_scale / v_scale [slots, KVH] at the same slot. */
cudaError_t turbo_cuda_write_kv_cache(int dtype, const void* key, int64_t key_stride,
                                      const void* value, int64_t value_stride, void* k_cache,
                                      void* v_cache, const int32_t* slots, float* k_scale,
                                      float* v_scale, int64_t num_tokens, int64_t num_kv_heads,
                                      int64_t head_dim, cudaStream_t stream);

/* Rotary embedding fused with the KV-cache write: rotates q [T, H, D] and k [T, KVH, D]
 * in place (as turbo_cuda_rotary_embedding) and copies the rotated k and v [T, KVH, D]
 * to cache slot slots[t] (as turbo_cuda_write_kv_cache: a negative slot skips, scales
 * given mean an int8 cache). */
cudaError_t turbo_cuda_rotary_write_kv(int dtype, const int32_t* positions, void* q,
                                       int64_t q_stride, int64_t num_heads, void* k,
                                       int64_t k_stride, const void* v, int64_t v_stride,
                                       int64_t num_kv_heads, const float* cos_sin,
                                       void* k_cache, void* v_cache, const int32_t* slots,
                                       float* k_scale, float* v_scale, int64_t num_tokens,
                                       int64_t head_dim, cudaStream_t stream);

/* Causal paged attention; the queries of sequence b are the last q_len tokens of its
 * context_lens[b]. head_dim <= TURBO_CUDA_MAX_HEAD_DIM. One thread block per (query
 * token, head), SIMT, any head_dim: the reference path (fp32 prefill, odd head_dims), and
 * the only one for an int8 cache: k_scale / v_scale fp32 [num_blocks * block_size, KVH]
 * (NULL: the cache is in `dtype`). Allocates nothing. */
cudaError_t turbo_cuda_paged_attention(int dtype, void* out, int64_t out_stride, const void* q,
                                       int64_t q_stride, const void* k_cache,
                                       const void* v_cache, const int32_t* block_tables,
                                       int64_t table_stride, const int32_t* query_start_loc,
                                       const int32_t* context_lens, int64_t num_seqs,
                                       int64_t num_tokens, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, const float* k_scale,
                                       const float* v_scale, cudaStream_t stream);

/* ---- Paged decode attention: one query token per sequence, split-K (flash-decoding).
 *
 * Sequence b's context (context_lens[b] <= max_context tokens) is cut into at most
 * num_splits pieces; one thread block per (split, KV head, sequence) serves all query
 * heads of its KV head, so each K/V row is read once per step. Splits of one sequence
 * write fp32 partial outputs into the workspace, combined by a second kernel. The
 * caller picks num_splits with turbo_cuda_decode_num_splits and allocates
 * turbo_cuda_decode_workspace_bytes: both depend on shapes only (never on the lengths
 * stored on the device), so a CUDA graph captured for a batch size stays valid. */

/* Whether the split-K decode kernel serves this shape (else use
 * turbo_cuda_paged_attention): head_dim a multiple of 8 and at most 256. */
int turbo_cuda_decode_supported(int64_t head_dim);

/* Number of splits for num_seqs x num_kv_heads over contexts of up to max_context
 * tokens on a GPU of num_sms multiprocessors. */
int turbo_cuda_decode_num_splits(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t max_context, int num_sms);

/* Bytes of workspace the decode needs (0 with one split). */
int64_t turbo_cuda_decode_workspace_bytes(int64_t num_seqs, int64_t num_heads,
                                          int64_t head_dim, int num_splits);

/* use_tensor_cores (bf16 / fp16 on sm_80+): the mma kernel; else the SIMT one (also the
 * only one for fp32). Both write the same partials, combined by the same kernel. */
cudaError_t turbo_cuda_paged_decode_attention(
    int dtype, void* out, int64_t out_stride, const void* q, int64_t q_stride,
    const void* k_cache, const void* v_cache, const int32_t* block_tables,
    int64_t table_stride, const int32_t* context_lens, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_context,
    float scale, int num_splits, void* workspace, int use_tensor_cores, cudaStream_t stream);

/* ---- Paged prefill attention on tensor cores (bfloat16 / float16 only).
 *
 * Same semantics as turbo_cuda_paged_attention (any mix of prompt chunks and decodes).
 * Rows of one tile are (query token, query head) pairs of one KV head, so K/V tiles are
 * shared by the whole GQA group. */

/* Whether the tensor-core kernel serves this dtype and head_dim (multiple of 8, <= 256). */
int turbo_cuda_prefill_supported(int dtype, int64_t head_dim);

cudaError_t turbo_cuda_paged_prefill_attention(
    int dtype, void* out, int64_t out_stride, const void* q, int64_t q_stride,
    const void* k_cache, const void* v_cache, const int32_t* block_tables,
    int64_t table_stride, const int32_t* query_start_loc, const int32_t* context_lens,
    int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, cudaStream_t stream);

/* ---- Linear layer with int8 weights (quantization=int8), for decode-sized batches.
 *
 * out [rows, features] = x [rows, in_features] @ (weight * scale[:, None])^T (+ bias):
 * weight int8 [features, in_features] row-major (row stride in_features), scale fp32
 * [features], bias NULL or [features] in the activation dtype; fp32 accumulation. The
 * weight is streamed once per tile of 8 rows, so it suits decode (a few rows); any
 * in_features works, 16-byte weight runs where turbo_cuda_int8_linear_vectorized says so
 * (in_features % 16 == 0 and 16-byte aligned rows). Allocates nothing. */
int turbo_cuda_int8_linear_vectorized(int dtype, const void* x, int64_t x_stride,
                                      const void* weight, int64_t in_features);

cudaError_t turbo_cuda_int8_linear(int dtype, void* out, int64_t out_stride, const void* x,
                                   int64_t x_stride, const int8_t* weight, const float* scale,
                                   const void* bias, int64_t rows, int64_t features,
                                   int64_t in_features, cudaStream_t stream);

/* ---- Linear layer with GGUF block weights (quantization=gguf), for decode-sized batches.
 *
 * out [rows, features] = x [rows, in_features] @ dequantize(weight)^T (+ bias): weight is a
 * GGUF file's matrix as stored, row n its blocks back to back (uint8 [features,
 * in_features / block weights * block bytes], 2-byte aligned), of GGML type `ggml_type`:
 * Q8_0 (8), Q4_0 (2), Q4_1 (3), Q4_K (12), Q5_K (13) or Q6_K (14), block geometry in
 * ../gguf_types.h; in_features a multiple of the type's block weights. Blocks are
 * dequantized in registers with gguf.quants' fp32 arithmetic, the product accumulated in
 * fp32. The weight is streamed once per tile of 8 rows; x rows are read 4 elements at a
 * time where turbo_cuda_gguf_linear_vectorized says so. Another type, or a weight that
 * does not fit, is cudaErrorInvalidValue. Allocates nothing. */
int turbo_cuda_gguf_linear_vectorized(int dtype, const void* x, int64_t x_stride);

cudaError_t turbo_cuda_gguf_linear(int dtype, int64_t ggml_type, void* out, int64_t out_stride,
                                   const void* x, int64_t x_stride, const uint8_t* weight,
                                   const void* bias, int64_t rows, int64_t features,
                                   int64_t in_features, cudaStream_t stream);

/* The same weight dequantized into out, a contiguous [features, in_features] matrix in
 * `dtype` (one rounding of each fp32 weight): prompt-sized batches run it through cuBLAS. */
cudaError_t turbo_cuda_gguf_dequantize(int dtype, int64_t ggml_type, void* out,
                                       const uint8_t* weight, int64_t features,
                                       int64_t in_features, cudaStream_t stream);

/* ---- Multi-LoRA: the adapter pass after a linear layer (lora.cu), for any batch.
 *
 * slots int32 [rows] on the device: each token row's adapter slot, -1 for the base model
 * (its rows are left alone); a slot >= num_slots traps. Nothing is read on the host, so
 * a CUDA graph may capture both calls. A and Bt are float32, contiguous.
 *
 * shrink: h [rows, hr] fp32 (row stride h_stride) = x [rows, in_features] @ A[slot]^T,
 * A [num_slots, hr, in_features] (hr = parts x rank: the parts' A stacked); rows of
 * slot -1 are not written. */
cudaError_t turbo_cuda_lora_shrink(int dtype, float* h, int64_t h_stride, const void* x,
                                   int64_t x_stride, const float* a, const int32_t* slots,
                                   int64_t num_slots, int64_t rows, int64_t hr,
                                   int64_t in_features, cudaStream_t stream);

/* Most output parts of one fused linear (q, k, v). */
#define TURBO_CUDA_LORA_MAX_PARTS 3

/* expand: for each part p (1 .. TURBO_CUDA_LORA_MAX_PARTS, sizes[p] features),
 * out[t, out_offsets[p] + c] += h[t, p rank .. p rank + rank - 1] . Bt[slot, :, b_p + c]
 * with Bt [num_slots, rank, sum of sizes] (each part's B * scale transposed, side by side;
 * b_p the sum of the sizes before p), summed in fp32 and added with one rounding to
 * `dtype`. out_offsets and sizes are host arrays (copied into the launch). */
cudaError_t turbo_cuda_lora_expand(int dtype, void* out, int64_t out_stride, const float* h,
                                   int64_t h_stride, const float* bt, const int32_t* slots,
                                   int64_t num_slots, int64_t rows, int64_t rank,
                                   int64_t num_parts, const int64_t* out_offsets,
                                   const int64_t* sizes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
