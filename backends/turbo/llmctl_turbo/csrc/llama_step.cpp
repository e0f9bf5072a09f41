// The native step: one scheduler step's whole forward pass of a Llama-family model
// (Llama, Mistral, Qwen2) in one call, so Python runs once per step, not once per layer.
// Registered here for CPU and CUDA tensors; its schema is in ops.cpp.

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/matmul.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "checks.h"
#include "cpu/thread_pool.h"
#include "kernels.h"

namespace turbo {
namespace {

// Number of tensors in `weights` before the first layer, and per layer.
constexpr int64_t kHeadWeights = 3;
constexpr int64_t kLayerWeights = 12;
// Number of tensors per layer in `lora_weights`.
constexpr int64_t kLoraWeights = 8;
// Multiply-adds of a CPU step worth waking the workers for: about kWakeChunks (8) chunks
// of 8 µs at 64 multiply-adds a ns, the size at which its products' own parallel loops
// would wake them (cpu/thread_pool.cpp, cpu/row_kernels.h).
constexpr int64_t kWakeMacs = 4'000'000;

// Checks that the prepared weights fit together, once per call (cheap: shapes only).
void check_weights(at::TensorList weights, int64_t num_layers, int64_t hidden,
                   int64_t qkv_width, int64_t attn_width, int64_t vocab,
                   const at::Tensor& like) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kHeadWeights + kLayerWeights * num_layers,
              "weights must hold ", kHeadWeights, " + ", kLayerWeights, " x ", num_layers,
              " layers = ", kHeadWeights + kLayerWeights * num_layers, " tensors, got ",
              weights.size());
  // Embeddings, norms and biases are in the model dtype; matrices may be packed int8,
  // with their scales (check_linear_weight).
  auto check_model_dtype = [&](const at::Tensor& w, WeightName name) {
    TORCH_CHECK(w.scalar_type() == like.scalar_type() && w.device() == like.device(), name,
                " is ", w.scalar_type(), " on ", w.device(), "; it must be ",
                like.scalar_type(), " on ", like.device(), " like the final norm");
  };
  check_model_dtype(weights[0].scalar_type() == at::kByte ? like : weights[0],
                    {"weights[0] (embed_tokens)"});
  const at::Tensor none;
  check_linear_weight(weights[2], {"weights[2] (lm_head)"}, like, hidden, vocab, 1,
                      none);
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + kHeadWeights + kLayerWeights * l;
    check_model_dtype(w[0], {"input norm", l});
    check_model_dtype(w[2], {"qkv bias", l});
    check_model_dtype(w[4], {"o_proj bias", l});
    check_model_dtype(w[5], {"post-attention norm", l});
    TORCH_CHECK(w[7].dim() >= 2, "layer ", l, ": down must be [", hidden,
                ", intermediate] or packed, got shape ", w[7].sizes());
    const int64_t intermediate = linear_in_features(w[7]);  // down's input features
    check_linear_weight(w[1], {"qkv", l}, like, hidden, qkv_width, 1, w[8]);
    check_linear_weight(w[3], {"o_proj", l}, like, attn_width, hidden, 1, w[9]);
    check_linear_weight(w[6], {"gate_up", l}, like, hidden, 2 * intermediate, 2, w[10]);
    check_linear_weight(w[7], {"down", l}, like, intermediate, hidden, 1, w[11]);
  }
}

// The LoRA slots of every layer (kLoraWeights per layer) fit the model.
void check_lora(at::TensorList lora, int64_t num_layers, int64_t hidden, int64_t q_width,
                int64_t kv_width, int64_t intermediate, const at::Tensor& like) {
  TORCH_CHECK(static_cast<int64_t>(lora.size()) == kLoraWeights * num_layers, "lora_weights must ",
              "hold ", kLoraWeights, " x ", num_layers, " layers tensors, got ", lora.size());
  const int64_t attn_width = q_width;  // the attention output's width (heads x head_dim)
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = lora.data() + kLoraWeights * l;
    check_lora_weights(w[0], w[1], {"qkv LoRA", l}, hidden, {q_width, kv_width, kv_width}, like);
    check_lora_weights(w[2], w[3], {"o_proj LoRA", l}, attn_width, {hidden}, like);
    check_lora_weights(w[4], w[5], {"gate_up LoRA", l}, hidden, {intermediate, intermediate}, like);
    check_lora_weights(w[6], w[7], {"down LoRA", l}, intermediate, {hidden}, like);
  }
}

}  // namespace

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
// argmax (int64 [rows of logits]): filled with each row's greedy token (the first largest
// logit), found as the LM head writes the logits (kernels.h, linear).
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
                      const std::optional<at::Tensor>& kv_rotation,
                      const std::optional<at::Tensor>& argmax) {
  // No autograd bookkeeping for any ATen call below.
  c10::InferenceMode inference_mode;

  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [layers, 2, num_blocks, block_size, kv_heads, "
              "head_dim] tensor, got shape ", kv_cache.sizes());
  TORCH_CHECK(!weights.empty(), "weights is empty");
  // The final norm is in the model dtype; the embedding table is too, or a GGUF file's
  // rows (uint8, quantization=gguf: kernels.h's embedding_gguf reads them).
  TORCH_CHECK(weights.size() > 1, "weights holds ", weights.size(), " tensors");
  const at::Tensor& embed = weights[0];
  const at::Tensor& like = weights[1];
  const int64_t num_layers = kv_cache.size(0);
  const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t num_kv_heads = kv_cache.size(4), head_dim = kv_cache.size(5);
  check_float_type(like, "weights[1] (final norm)");
  TORCH_CHECK(like.dim() == 1, "weights[1] (final norm) must be [hidden], got ", like.sizes());
  const int64_t hidden = like.size(0);
  const int64_t vocab = embed.size(0);
  const int64_t num_tokens = input_ids.size(0), num_seqs = context_lens.size(0);
  TORCH_CHECK(num_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a positive multiple of the cache's kv heads (", num_kv_heads, ")");
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;

  if (embed.scalar_type() == at::kByte) {
    TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && embed.is_cpu() &&
                    hidden % kGgufBlock == 0 &&
                    gguf_block_bytes(gguf_row_type(embed.size(1), hidden)) != 0,
                "weights[0] (embed_tokens) is uint8, so it must be a GGUF file's contiguous "
                "[vocab, row bytes] rows of Q8_0, Q4_0 or Q4_1 blocks for ", hidden,
                " features, on the CPU; got ", embed.sizes(), " on ", embed.device());
  } else {  // its dtype: check_weights
    TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && embed.size(1) == hidden,
                "weights[0] (embed_tokens) must be a contiguous [vocab, ", hidden, "] tensor, "
                "got ", embed.sizes());
  }
  check_tensor(input_ids, "input_ids", at::kInt, 1, like);
  check_tensor(positions, "positions", at::kInt, 1, like);
  check_tensor(slot_mapping, "slot_mapping", at::kInt, 1, like);
  check_tensor(block_tables, "block_tables", at::kInt, 2, like);
  check_tensor(query_start_loc, "query_start_loc", at::kInt, 1, like);
  check_tensor(context_lens, "context_lens", at::kInt, 1, like);
  const bool int8_cache = kv_cache.scalar_type() == at::kChar;
  check_tensor(kv_cache, "kv_cache", int8_cache ? at::kChar : like.scalar_type(), 6, like);
  const at::Tensor kv_scale = kv_cache_scale.has_value() ? *kv_cache_scale : at::Tensor();
  check_cache_scale(kv_cache, kv_scale, "kv_cache");
  check_tensor(cos_sin_cache, "cos_sin_cache", at::kFloat, 2, like);
  TORCH_CHECK(positions.size(0) == num_tokens && slot_mapping.size(0) == num_tokens,
              "input_ids, positions and slot_mapping must all have one entry per token");
  TORCH_CHECK(cos_sin_cache.size(1) == head_dim && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous [max_positions, ", head_dim, "] tensor");
  check_weights(weights, num_layers, hidden, qkv_width, q_width, vocab, like);
  check_batch(block_tables, query_start_loc, context_lens, num_tokens, num_blocks, block_size);
  check_slots(slot_mapping, num_blocks * block_size);
  check_positions(positions, cos_sin_cache.size(0));
  check_token_ids(input_ids, vocab);

  const int64_t intermediate = linear_in_features(weights[kHeadWeights + 7]);
  // Between steps the CPU workers sleep (the engine's host work outlasts their polling).
  // A step whose products are work for several threads wakes them now, so that they are
  // up by its first layer's products, not a few loops later. A smaller one (a few
  // sequences of a tiny model) runs on this thread, as its loops would anyway: a woken
  // worker beside a busy neighbour can be descheduled holding a chunk the step waits for.
  const int64_t step_macs =
      num_tokens * num_layers * hidden * (qkv_width + q_width + 3 * intermediate);
  if (like.is_cpu() && step_macs >= kWakeMacs) cpu::wake_workers();
  // LoRA adapters: applied when the step has tiles of adapted tokens (CPU) or per-token
  // slots (CUDA).
  const bool lora_tiled = lora_tiles.has_value() && lora_tiles->numel() > 0;
  const bool lora_slotted = lora_slots.has_value();
  const bool lora = lora_tiled || lora_slotted;
  if (lora) {
    TORCH_CHECK(!(lora_tiled && lora_slotted), "pass lora_rows / lora_tiles (CPU) or "
                "lora_slots (CUDA), not both");
    TORCH_CHECK(lora_slotted == like.is_cuda(), "LoRA adapters take lora_slots on CUDA and "
                "lora_rows / lora_tiles on the CPU; this step runs on ", like.device());
    check_lora(lora_weights, num_layers, hidden, q_width, kv_width, intermediate, like);
    if (lora_tiled) {
      TORCH_CHECK(lora_rows.has_value(), "lora_tiles needs lora_rows");
      check_lora_tiles(*lora_rows, *lora_tiles, num_tokens, lora_weights[0].size(0));
    } else {
      check_lora_slots(*lora_slots, num_tokens, like);
    }
  }
  // out[t] += the adapter pass of one fused linear (kernels.h), the way this device takes it.
  const auto adapt = [&](at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                         const at::Tensor& bt, at::IntArrayRef out_offsets,
                         at::IntArrayRef sizes) {
    if (lora_tiled) {
      lora_add(out, x, a, bt, out_offsets, sizes, *lora_rows, *lora_tiles);
    } else {
      lora_add_slots(out, x, a, bt, out_offsets, sizes, *lora_slots);
    }
  };
  // With adapters gate/up is not fused with silu (the adapter adds to both before it): the
  // product goes to a buffer, up's columns after gate's whole panels when packed.
  const bool packed_gate_up = weights[kHeadWeights + 6].dim() == 3;
  const int64_t up_offset =
      packed_gate_up ? (intermediate + kPanelWidth - 1) / kPanelWidth * kPanelWidth : intermediate;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const auto options = like.options();

  // The step's buffers, reused by every layer. The residual stream starts as embeddings.
  at::Tensor residual = at::empty({num_tokens, hidden}, options);
  if (embed.scalar_type() == at::kByte) {
    embedding_gguf(residual, embed, input_ids, gguf_row_type(embed.size(1), hidden));
  } else {
    embedding(residual, embed, input_ids);
  }
  at::Tensor normed = at::empty({num_tokens, hidden}, options);
  at::Tensor projected = at::empty({num_tokens, hidden}, options);
  at::Tensor qkv = at::empty({num_tokens, qkv_width}, options);
  at::Tensor attn = at::empty({num_tokens, num_heads, head_dim}, options);
  at::Tensor gate_up;  // allocated by linear_silu_mul where it does not fuse (kernels.h)
  at::Tensor activated = at::empty({num_tokens, intermediate}, options);
  // Views of qkv's columns, as [T, heads, D] with strided rows.
  at::Tensor q = qkv.narrow(1, 0, q_width).view({num_tokens, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_width, kv_width).view({num_tokens, num_kv_heads, head_dim});
  at::Tensor v =
      qkv.narrow(1, q_width + kv_width, kv_width).view({num_tokens, num_kv_heads, head_dim});
  const at::Tensor attn_rows = attn.view({num_tokens, q_width});
  const at::Tensor no_bias = at::empty({0}, options);
  // An int8 cache holds every head's K and V rows rotated by an orthonormal Hadamard
  // matrix H (symmetric, H H = I): q k^T = (q H)(k H)^T, and attention over the rotated
  // values gives out H, so H again undoes it. The rotation spreads a row's outlier over
  // all of it, so the row's int8 scale (max|row| / 127) fits its values closer.
  const at::Tensor rotation = kv_rotation.has_value() ? *kv_rotation : at::Tensor();
  TORCH_CHECK(!rotation.defined() ||
                  (int8_cache && rotation.dim() == 2 && rotation.size(0) == head_dim &&
                   rotation.size(1) == head_dim && rotation.scalar_type() == options.dtype()),
              "kv_rotation must be a [head_dim, head_dim] matrix in the model dtype, given "
              "with an int8 cache only");

  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + kHeadWeights + kLayerWeights * l;
    at::Tensor k_cache = kv_cache.select(0, l).select(0, 0);
    at::Tensor v_cache = kv_cache.select(0, l).select(0, 1);
    const at::Tensor k_scale = int8_cache ? kv_scale.select(0, l).select(0, 0) : at::Tensor();
    const at::Tensor v_scale = int8_cache ? kv_scale.select(0, l).select(0, 1) : at::Tensor();

    // Attention block. The previous layer's MLP output joins the residual in the norm.
    if (l == 0) {
      rms_norm(normed, residual, w[0], rms_norm_eps);
    } else {
      add_rms_norm(normed, residual, projected, w[0], rms_norm_eps);
    }
    const at::Tensor* lw = lora ? lora_weights.data() + kLoraWeights * l : nullptr;
    linear(qkv, normed, w[1], w[2], w[8]);
    if (lora) {
      adapt(qkv, normed, lw[0], lw[1], {0, q_width, q_width + kv_width},
            {q_width, kv_width, kv_width});
    }
    if (rotation.defined()) {  // int8 cache: q, k, v rotated after RoPE, before quantizing
      rotary_embedding(positions, q, k, cos_sin_cache);
      q.copy_(at::matmul(q, rotation));
      k.copy_(at::matmul(k, rotation));
      v.copy_(at::matmul(v, rotation));
      write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
      paged_attention(attn, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                      scale, k_scale, v_scale);
    } else if (!rope_write_and_decode_attention(attn, positions, q, k, v, cos_sin_cache,
                                                k_cache, v_cache, slot_mapping, block_tables,
                                                query_start_loc, context_lens, scale)) {
      rotary_embedding_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                    slot_mapping, k_scale, v_scale);
      paged_attention(attn, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                      scale, k_scale, v_scale);
    }
    if (rotation.defined()) attn.copy_(at::matmul(attn, rotation));  // H H = I
    linear(projected, attn_rows, w[3], w[4], w[9]);
    if (lora) adapt(projected, attn_rows, lw[2], lw[3], {0}, {hidden});

    // MLP block.
    add_rms_norm(normed, residual, projected, w[5], rms_norm_eps);
    if (!lora) {
      linear_silu_mul(activated, normed, w[6], w[10], gate_up);
    } else {
      if (!gate_up.defined()) gate_up = at::empty({num_tokens, up_offset + intermediate}, options);
      linear(gate_up, normed, w[6], no_bias, w[10]);
      adapt(gate_up, normed, lw[4], lw[5], {0, up_offset}, {intermediate, intermediate});
      silu_and_mul(activated, up_offset == intermediate
                                  ? gate_up
                                  : at::cat({gate_up.narrow(1, 0, intermediate),
                                             gate_up.narrow(1, up_offset, intermediate)},
                                            1));
    }
    linear(projected, activated, w[7], no_bias, w[11]);
    if (lora) adapt(projected, activated, lw[6], lw[7], {0}, {hidden});
  }
  add_rms_norm(normed, residual, projected, weights[1], rms_norm_eps);

  // Logits only for the tokens asked for (a speculative step's), else for each sequence's
  // last new token (all tokens when every one decodes).
  at::Tensor last_rows;
  if (logits_indices.has_value()) {
    check_tensor(*logits_indices, "logits_indices", at::kInt, 1, like);
    check_token_indices(*logits_indices, num_tokens);
    last_rows = at::index_select(normed, 0, *logits_indices);
  } else {
    last_rows = num_tokens == num_seqs
                    ? normed
                    : at::index_select(normed, 0, query_start_loc.narrow(0, 1, num_seqs).sub(1));
  }
  at::Tensor logits = at::empty({last_rows.size(0), vocab}, options);
  if (argmax.has_value()) check_argmax_out(*argmax, last_rows.size(0), like);
  // The LM head: never int8; with `argmax`, each row's greedy token too.
  linear(logits, last_rows, weights[2], no_bias, no_bias, argmax.value_or(at::Tensor()));
  return logits.scalar_type() == at::kFloat ? logits : logits.to(at::kFloat);
}

}  // namespace turbo

TORCH_LIBRARY_IMPL(llmctl_turbo, CPU, m) { m.impl("llama_step", &turbo::llama_step); }
#ifdef LLMCTL_TURBO_CUDA
TORCH_LIBRARY_IMPL(llmctl_turbo, CUDA, m) { m.impl("llama_step", &turbo::llama_step); }
#endif
