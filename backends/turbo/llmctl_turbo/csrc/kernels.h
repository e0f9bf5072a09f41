// The kernels turbo's ops and native step are made of, on tensors, for any device.
//
// Each function checks nothing: callers (ops.cpp for Python, llama_step.cpp for its own
// buffers) have checked shapes and dtypes already. Each picks the CPU or the CUDA
// implementation from the device of its first tensor argument.
//
// Shapes (T = tokens in the step, B = sequences, H / KVH = query / key-value heads,
// D = head_dim). Token rows may be strided (views into a fused qkv buffer); each row's
// heads and elements are contiguous.
//   KV cache of one layer:   [num_blocks, block_size, KVH, D]
//   block_tables:            int32 [B, max_blocks_per_seq]
//   query_start_loc:         int32 [B + 1], sequence b's queries are rows qsl[b]..qsl[b+1]-1
//   context_lens:            int32 [B], tokens in b's cache once this step has written
//   positions, slot_mapping: int32 [T]; a negative slot means "do not write this token"
//   cos_sin_cache:           float32 [max_positions, D]: cos in the first D/2, sin after
//
// The KV cache is the model dtype, or int8 (kv_cache_dtype=int8) with float32 scales
// [num_blocks, block_size, KVH] beside each of K and V: one per token and kv head,
// llmctl.engine.quant.quantize_kv's scheme. k_scale / v_scale are empty (undefined) for a
// float cache. On CUDA only the SIMT attention kernel reads an int8 cache.
#pragma once

#include <ATen/core/Tensor.h>

namespace turbo {

// Linear layers. A weight is the checkpoint's [N, K] matrix (rows contiguous), or, for
// turbo's own CPU kernels (fp32, bf16), that matrix packed by pack_linear_weight into
// [panels, K, 16]: panel p holds output features 16p .. 16p + 15 side by side for each
// input feature, zero-padded. Packed weights run on the CPU kernels (cpu/row_kernels.h),
// the others through ATen's matmul.
//
// quantization=int8: a packed weight may be int8 (llmctl.engine.quant's symmetric
// per-output-channel int8), with `scale` its float32 scales packed the same way (the
// [N, 1] column of scales through pack_linear_weight: [panels * 16]); `scale` is an
// empty tensor for float weights.
//
// On CUDA an int8 weight stays the [N, K] matrix (contiguous), `scale` float32 [N]
// beside it: cuda/int8_linear.cu streams it for decode-sized batches. A GGUF weight
// (quantization=gguf) on CUDA is the file's rows as stored, viewed as uint8 [N, K / block
// weights, block bytes] (contiguous; the block size names the type: gguf_types.h), read
// by cuda/gguf_linear.cu; no `scale`.
//
// `groups` packs equal row groups separately (each padded to whole panels): 2 for the
// MLP's [gate; up], so that each gate panel has a matching up panel.
constexpr int64_t kPanelWidth = 16;
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t groups);

// quantization=gguf: a packed weight may be GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and
// the K-quants Q4_K, Q5_K, Q6_K; ggml's type ids below), repacked by pack_gguf_weight from the
// file's rows (`raw`: uint8 [N, row bytes], K a multiple of 32, of 256 for K-quants) into
// uint8 [panels, K / 32, bytes per 32 inputs] (layouts in cpu/block_layout.h and
// cpu/block_kernels.h), `groups` as for pack_linear_weight; no `scale`. CPU only. With
// `offsets`, Q4_0 and Q8_0 keep their blocks' offsets c (the layouts of Q4_1 and Q5_0),
// so that they join parts of those types in one fused matrix.
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ5_0 = 6, kGgmlQ5_1 = 7, kGgmlQ8_0 = 8;
constexpr int64_t kGgmlQ4_K = 12, kGgmlQ5_K = 13, kGgmlQ6_K = 14;
constexpr int kGgufBlock = 32;  // weights per GGUF block (a K-quant's sub-block)
// A packed block's scales: fp16 d[16] and c[16], one each per feature of the panel.
constexpr int64_t kGgufScaleBytes = 2 * kPanelWidth * 2;
// The bytes of one block of the file (32 weights; a K-quant's super-block: 256), 0 for a
// type turbo has no kernel for; gguf_block_weights: the weights it holds.
int64_t gguf_block_bytes(int64_t ggml_type);
int64_t gguf_block_weights(int64_t ggml_type);
at::Tensor pack_gguf_weight(const at::Tensor& raw, int64_t ggml_type, int64_t groups,
                            bool offsets = false);
// The type of GGUF rows of `row_bytes` for `features` values (-1: none turbo reads).
int64_t gguf_row_type(int64_t row_bytes, int64_t features);
// out[t] = the dequantized row ids[t] of a GGUF file's rows `raw` (uint8 [vocab, row
// bytes] of `ggml_type` blocks): the embedding lookup of quantization=gguf, so that the
// table stays the file's bytes instead of a float copy. CPU only.
void embedding_gguf(at::Tensor& out, const at::Tensor& raw, const at::Tensor& ids,
                    int64_t ggml_type);

// out [T, N] = x [T, K] @ (weight * scale)^T (+ bias [N]; an empty bias is none).
// `argmax` (int64 [T]; undefined: none) gets each row's first largest output, as
// torch.argmax (a greedy step's LM head): turbo's CPU kernels find it while they write
// the row (cpu/row_kernels.h, RowArgmax), other weights by an argmax after.
void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
            const at::Tensor& bias, const at::Tensor& scale, const at::Tensor& argmax = {});

// out [T, I] = silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up] ([2I, K], or packed
// with groups = 2). Unpacked, the product goes through `gate_up_buffer` ([T, 2I],
// allocated here on first use and reused by later calls).
void linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                     const at::Tensor& scale, at::Tensor& gate_up_buffer);

// out[t] = embed[ids[t]]: the embedding lookup (ids int32; checked by the caller).
void embedding(at::Tensor& out, const at::Tensor& embed, const at::Tensor& ids);

// out[t] = x[t] / rms(x[t]) * weight
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);

// residual += x, then out = rms_norm(residual): the residual add fused into the next norm.
void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps);

// Rotates q [T, H, D] and k [T, KVH, D] in place (rotate-half / GPT-NeoX layout, as
// transformers' Llama does).
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache);

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up);

// k_cache/v_cache[slot / block_size, slot % block_size] = key/value[t] for slot = slots[t]
// (an int8 cache: quantized, the scales written at the same place of k_scale / v_scale).
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& k_scale, const at::Tensor& v_scale);

// rotary_embedding, then write_kv_cache of the rotated k and of v: one kernel on CUDA, one
// parallel loop over the tokens on the CPU.
void rotary_embedding_and_write_kv(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                   at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale);

// Causal attention of each sequence's queries over its paged cache. The queries of
// sequence b are the LAST q_len tokens of its context_lens[b] tokens, so query i sees
// keys 0 .. context_lens[b] - q_len + i. Decode is the case q_len == 1.
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale);

// A decode step's attention after the qkv projection in one pass over the sequences, on the
// CPU: each sequence's new q and k rotated (as rotary_embedding), k and v written to the
// cache (as write_kv_cache), then attention (as paged_attention). q, k and v are left as
// they were. Returns false, having done nothing, where the pass does not apply (CUDA, an
// int8 cache, a sequence with other than one new token, heads it has no kernel for): then
// call rotary_embedding_and_write_kv and paged_attention.
bool rope_write_and_decode_attention(at::Tensor& out, const at::Tensor& positions,
                                     const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                     at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& slot_mapping,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& query_start_loc,
                                     const at::Tensor& context_lens, double scale);

// LoRA adapters (multi-LoRA): for each tile (slot s, start, end) of `tiles` (int32 [3, n],
// llmctl.engine.lora.slot_tiles) and each token t of rows[start:end] (int32 token indices),
// out[t, out_offsets[p] + c] += (Bt[s] ^T @ (A[s] @ x[t]))[part p, c] for each part p (of
// sizes[p] features, c < sizes[p]) with rank rows p R .. p R + R - 1 of the product:
// a float32 [slots, parts * R, K] (the parts' A stacked), bt float32 [slots, R, N] (each
// part's B * scale transposed, the parts side by side: N = sum of sizes). x [T, K] and out
// in the model dtype; out's other tokens and columns are left alone. CPU
// (cpu/lora_kernels.h); on CUDA lora_add_slots.
void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef out_offsets, at::IntArrayRef sizes, const at::Tensor& rows,
              const at::Tensor& tiles);

// The same pass on CUDA (cuda/lora.cu), with each token's slot in token_slots (int32 [T] on
// the device, -1: none) instead of host tiles, so the step's launches depend on T alone
// and a CUDA graph can capture them; a slot past a's last traps. x and out may be any
// activation dtype (fp32, bf16, fp16); at most 3 parts. CUDA only.
void lora_add_slots(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& bt, at::IntArrayRef out_offsets, at::IntArrayRef sizes,
                    const at::Tensor& token_slots);

namespace cpu {
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t groups);
void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef out_offsets, at::IntArrayRef sizes, const at::Tensor& rows,
              const at::Tensor& tiles);
int64_t gguf_block_bytes(int64_t ggml_type);
at::Tensor pack_gguf_weight(const at::Tensor& raw, int64_t ggml_type, int64_t groups,
                            bool offsets);
void embedding_gguf(at::Tensor& out, const at::Tensor& raw, const at::Tensor& ids,
                    int64_t ggml_type);
void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
            const at::Tensor& bias, const at::Tensor& scale, int64_t* argmax);
void linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scale);
void embedding(at::Tensor& out, const at::Tensor& embed, const at::Tensor& ids);
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache);
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& k_scale, const at::Tensor& v_scale);
void rotary_embedding_and_write_kv(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                   at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale);
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale);
bool rope_write_and_decode_attention(at::Tensor& out, const at::Tensor& positions,
                                     const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                     at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& slot_mapping,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& query_start_loc,
                                     const at::Tensor& context_lens, double scale);
}  // namespace cpu

#ifdef LLMCTL_TURBO_CUDA
namespace cuda {
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache);
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& k_scale, const at::Tensor& v_scale);
void rotary_embedding_and_write_kv(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                   at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale);
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale);
void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& bias, const at::Tensor& scale);
void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& bias);
void lora_add_slots(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& bt, at::IntArrayRef out_offsets, at::IntArrayRef sizes,
                    const at::Tensor& token_slots);
}  // namespace cuda
#endif

}  // namespace turbo
