// Argument checks shared by the ops (ops.cpp) and the native step (llama_step.cpp).
// A failed check raises a RuntimeError in Python that names the argument and the rule.
#pragma once

#include <ATen/core/Tensor.h>

#include <ostream>

#include "gguf_types.h"
#include "kernels.h"

namespace turbo {

// `t` is a tensor of dtype `dtype` with `dim` dimensions on `device_of`'s device.
void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                  const at::Tensor& device_of);

// `t` holds floats of a type the kernels run in: float32, bfloat16 or float16.
void check_float_type(const at::Tensor& t, const char* name);

// Rows of `t` may be strided, the elements inside a row must be contiguous.
void check_rows_contiguous(const at::Tensor& t, const char* name);

// A weight's name in messages: "qkv" or, with a layer, "layer 3: qkv". Formatted only when
// a check fails (the native step checks its weights on every call).
struct WeightName {
  const char* name;
  int64_t layer = -1;
};
std::ostream& operator<<(std::ostream& out, const WeightName& weight);

// A linear weight from `in_features` to `features` outputs in `groups` row groups, with
// `like`'s (checked) dtype and device: the checkpoint's [out, in] matrix with contiguous rows, or
// that matrix packed by pack_linear_weight (kernels.h) for the CPU kernels; or int8 with
// `scale` its float32 scales: packed on the CPU, a contiguous [out, in] matrix on CUDA.
// `scale` is empty (or undefined) for float weights. Or GGUF blocks (uint8) with no
// `scale`: packed by pack_gguf_weight on the CPU, the file's rows on CUDA (kernels.h).
void check_linear_weight(const at::Tensor& w, WeightName name, const at::Tensor& like,
                         int64_t in_features, int64_t features, int64_t groups,
                         const at::Tensor& scale);

// A linear weight's input features: size(1), or blocks x 32 for GGUF blocks (uint8),
// blocks x the type's block weights for GGUF rows on CUDA (a type unknown there: 0).
inline int64_t linear_in_features(const at::Tensor& w) {
  if (w.scalar_type() == at::kByte && w.is_cuda()) {
    const GgufBlockType* type = w.dim() == 3 ? cuda_gguf_type_of_block(w.size(2)) : nullptr;
    return type == nullptr ? 0 : w.size(1) * type->weights;
  }
  return w.scalar_type() == at::kByte ? w.size(1) * kGgufBlock : w.size(1);
}

// One KV-cache tensor of one layer: [num_blocks, block_size, num_kv_heads, head_dim], in
// `like`'s dtype, or int8 with `scale` (check_cache_scale).
void check_cache(const at::Tensor& cache, const at::Tensor& scale, const char* name,
                 const at::Tensor& like);

// The scales beside a KV cache [..., num_kv_heads, head_dim] (one layer's or the whole
// step's): none (undefined or empty) for a float cache; for an int8 one a contiguous
// float32 [..., num_kv_heads] tensor on the cache's device, one per token and kv head.
void check_cache_scale(const at::Tensor& cache, const at::Tensor& scale, const char* name);

// The batch description every attention call relies on: query_start_loc starts at 0,
// grows by at least 1 per sequence and ends at num_tokens; each context holds its
// queries and fits its block-table row; every block id used is inside the cache. On
// CUDA tensors only shapes are checked (reading the values would synchronise).
void check_batch(const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                 const at::Tensor& context_lens, int64_t num_tokens, int64_t num_blocks,
                 int64_t block_size);

// Every slot is -1 (skip) or inside a cache of num_blocks * block_size slots.
void check_slots(const at::Tensor& slot_mapping, int64_t num_slots);

// Every token id has a row in an embedding table of `vocab_size` rows.
void check_token_ids(const at::Tensor& input_ids, int64_t vocab_size);

// Every position has a row in the cos/sin cache.
void check_positions(const at::Tensor& positions, int64_t max_positions);

// Every logits index names one of the step's num_tokens tokens (CPU tensors only).
void check_token_indices(const at::Tensor& indices, int64_t num_tokens);

// A linear's `argmax` output (kernels.h): contiguous int64 [rows], on like's device.
void check_argmax_out(const at::Tensor& argmax, int64_t rows, const at::Tensor& like);

// One layer's LoRA slots for lora_add / lora_add_slots (kernels.h): a float32 contiguous
// [slots, parts * R, in_features], bt float32 contiguous [slots, R, sum of sizes], both on
// like's device; at most 3 parts on CUDA.
void check_lora_weights(const at::Tensor& a, const at::Tensor& bt, WeightName name,
                        int64_t in_features, at::IntArrayRef sizes, const at::Tensor& like);

// A step's per-token LoRA slots (lora_add_slots): a contiguous int32 [num_tokens] on like's
// device. Their values are not read here (that would wait for the device): the kernels
// trap on a slot past the last.
void check_lora_slots(const at::Tensor& token_slots, int64_t num_tokens, const at::Tensor& like);

// A step's LoRA tiles (kernels.h, lora_add): rows int32 [n] of token indices below
// num_tokens, tiles int32 [3, tiles] of (slot below num_slots, start, end) with
// start <= end inside rows. CPU tensors.
void check_lora_tiles(const at::Tensor& rows, const at::Tensor& tiles, int64_t num_tokens,
                      int64_t num_slots);

}  // namespace turbo
