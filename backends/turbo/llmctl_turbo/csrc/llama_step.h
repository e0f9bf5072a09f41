// The native step: one scheduler step's whole forward pass of a Llama-family model
// (Llama, Mistral, Qwen2) in one call, so Python runs once per step, not once per layer.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace turbo {

// Number of tensors in `weights` before the first layer, and per layer.
constexpr int64_t kHeadWeights = 3;
constexpr int64_t kLayerWeights = 12;
// Number of tensors per layer in `lora_weights`.
constexpr int64_t kLoraWeights = 8;

// Runs every layer over the step's T new tokens and returns fp32 logits [B, vocab] for
// the last new token of each of the B sequences, or with logits_indices (int32 [N], token
// indices: a speculative step verifying several positions per sequence) [N, vocab] for
// those tokens.
//
// weights (prepared once at load by runner.py; each matrix is the checkpoint's [out, in]
// weight, or on the CPU that weight packed for turbo's kernels: see linear in kernels.h):
//   embed_tokens [V, hidden], final norm [hidden], lm_head [V, hidden], then per layer:
//   input norm, qkv [(H + 2 KVH) D, hidden], qkv bias ((H + 2 KVH) D, or empty),
//   o_proj [hidden, H D], o_proj bias (hidden, or empty), post-attention norm,
//   gate_up [2 I, hidden] (gate rows first; packed in 2 groups), down [hidden, I],
//   then the scales of qkv, o_proj, gate_up and down: float32, packed like their matrix
//   when that is int8 (quantization=int8, CPU only), else empty.
// kv_cache: [layers, 2 (K, V), num_blocks, block_size, KVH, D], written in place: the
// model dtype, or int8 (kv_cache_dtype=int8, CPU only) with kv_cache_scale its float32
// scales [layers, 2, num_blocks, block_size, KVH] (none for a float cache; kernels.h).
// The batch tensors are int32 and follow kernels.h.
// LoRA adapters: lora_weights is empty, or per layer the slots' A and B of qkv, o_proj,
// gate_up and down as lora_add takes them (kernels.h): qkv's parts q, k, v, gate_up's gate,
// up, on the model's device. On the CPU they are applied to the tokens of lora_rows /
// lora_tiles (one slot per tile; none given or no tiles: the base model alone); on CUDA
// to each token by its slot in lora_slots (int32 [T] on the device, -1: none; none given:
// the base model alone), which keeps the step's launches fixed for a CUDA graph.
// kv_rotation: with an int8 cache, the [D, D] Hadamard matrix (model dtype) that q, k and v
// are multiplied by after RoPE, and the attention output after it
// (llmctl.engine.quant.kv_rotation); none: nothing rotated.
at::Tensor llama_step(const at::Tensor& input_ids, const at::Tensor& positions,
                      const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                      const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                      at::TensorList weights, at::Tensor kv_cache,
                      const at::Tensor& cos_sin_cache, int64_t num_heads, double rms_norm_eps,
                      at::TensorList lora_weights,
                      const std::optional<at::Tensor>& kv_cache_scale,
                      const std::optional<at::Tensor>& logits_indices,
                      const std::optional<at::Tensor>& lora_rows,
                      const std::optional<at::Tensor>& lora_tiles,
                      const std::optional<at::Tensor>& lora_slots,
                      const std::optional<at::Tensor>& kv_rotation);

}  // namespace turbo
